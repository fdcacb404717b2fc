"""What kvq_ao ships for SmolLM2 (`kvq_ao/shipped/`): seeded into the user cache only where it is
missing, every file still fitting the preset it was made for, and a shipped calibration equal to
what `calibrate` computes now (so a first `kvq demo` skips work without changing a result)."""

import pytest
import torch

from kvq_ao import artifacts
from kvq_ao.calibration import Calibration, calibrate, collect, default_path, model_key
from kvq_ao.models import calibration_windows
from kvq_ao.config import KVQuantConfig

CALIBRATED = [n for n in KVQuantConfig.preset_names() if KVQuantConfig.preset(n).needs_calibration]


@pytest.fixture
def fake_tree(tmp_path, monkeypatch):
    shipped, cache = tmp_path / "shipped", tmp_path / "cache"
    (shipped / "calibration" / "m").mkdir(parents=True)
    for name, text in (("p.json", "meta"), ("p.safetensors", "tensors"), ("p-1pct.json", "other preset")):
        (shipped / "calibration" / "m" / name).write_text(text)
    monkeypatch.setattr(artifacts, "SHIPPED", shipped)
    monkeypatch.setenv("KVQ_AO_CACHE", str(cache))
    return cache


def test_seed_copies_the_shipped_file_and_its_companions_into_an_empty_cache(fake_tree):
    path = artifacts.seed(fake_tree / "calibration" / "m" / "p.json")
    assert path.read_text() == "meta" and path.with_suffix(".safetensors").read_text() == "tensors"
    assert sorted(f.name for f in path.parent.iterdir()) == ["p.json", "p.safetensors"]  # not p-1pct, no temp file


def test_seed_never_overwrites_the_users_file_and_ignores_paths_outside_the_cache(fake_tree, tmp_path):
    mine = fake_tree / "calibration" / "m" / "p.json"
    mine.parent.mkdir(parents=True)
    mine.write_text("made by the user")
    assert artifacts.seed(mine).read_text() == "made by the user"
    assert not mine.with_suffix(".safetensors").exists()
    elsewhere = tmp_path / "calibration" / "m" / "p.json"  # same relative layout, not under the cache
    assert not artifacts.seed(elsewhere).exists()
    assert not artifacts.seed(fake_tree / "calibration" / "m" / "absent.json").exists()


@pytest.mark.slow
def test_every_calibrated_preset_ships_a_calibration_that_fits_it(smollm2, tmp_path, monkeypatch):
    monkeypatch.setenv("KVQ_AO_CACHE", str(tmp_path))
    model, _ = smollm2
    for name in CALIBRATED:
        config = KVQuantConfig.preset(name)
        shipped = artifacts.SHIPPED / "calibration" / model_key(model) / f"{name}.json"
        calib = Calibration.load(shipped)  # checks the format version and the tensors' sha256
        calib.check_model(30, 3, 64)
        assert calib.made_for(config, 30), f"{shipped} no longer fits {name}: python benchmarks/ship_artifacts.py"
        assert artifacts.seed(default_path(model, config)).exists()


@pytest.mark.slow
def test_the_shipped_tuned_config_is_an_assignment_of_kvtuners_base_within_its_budget(smollm2):
    from kvq_ao.demo import DEFAULT_BUDGET, tuned_config_name
    from kvq_ao.tuning.profile import assignment_config, base_config

    model, _ = smollm2
    tuned = KVQuantConfig.load(artifacts.SHIPPED / "tune" / tuned_config_name(model, DEFAULT_BUDGET))
    pairs = [(kv.key.bits, kv.value.bits) for kv in tuned.resolve(30)]
    assert tuned == assignment_config(pairs, base_config(), name=tuned.name)
    assert sum(k + v for k, v in pairs) / (2 * len(pairs)) <= DEFAULT_BUDGET
    assert len(set(pairs)) > 1  # a mixed assignment, not one width everywhere


@pytest.mark.slow
def test_a_shipped_calibration_is_what_calibrate_computes_now(smollm2):
    """kvquant-3-1pct (calibrated 3-bit levels for keys and values, outlier thresholds, pre-RoPE keys)
    recomputed from the model: the same tensors as the shipped file, to float32 rounding."""
    model, tokenizer = smollm2
    config = KVQuantConfig.preset("kvquant-3-1pct")
    fresh = calibrate(model, None, config, activations=collect(model, calibration_windows(tokenizer), True), progress=False)
    shipped = Calibration.load(artifacts.SHIPPED / "calibration" / model_key(model) / "kvquant-3-1pct.json")
    assert sorted(fresh.tensors) == sorted(shipped.tensors)
    for key, tensor in shipped.tensors.items():
        torch.testing.assert_close(fresh.tensors[key], tensor, rtol=1e-4, atol=1e-5, msg=lambda m: f"{key}: {m}")
