"""Files kvq_ao writes are written atomically (`kvq_ao.files`): a failed write leaves the old file,
racing writers leave one whole file, and racing builders of the native kernels both end with a
working library."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from kvq_ao.calibration import CALIBRATION_VERSION, Calibration
from kvq_ao.files import atomic_write, replacing


def test_a_write_that_fails_leaves_the_old_file_and_no_temporary(tmp_path):
    path = atomic_write(tmp_path / "c.json", "old")
    with pytest.raises(RuntimeError):
        with replacing(path) as tmp:
            tmp.write_text("half of the new")
            raise RuntimeError("killed mid-write")
    assert path.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]
    assert atomic_write(path, b"new").read_bytes() == b"new"


def _calibration(value: float) -> Calibration:
    meta = {"kvq_ao_calibration": CALIBRATION_VERSION, "model": {"name": "m"}, "config": {"name": "c"}}
    return Calibration(meta, {"layers.0.key.codebook": torch.full((4096,), value)})


WRITER = textwrap.dedent("""
    import sys, torch
    from kvq_ao.calibration import CALIBRATION_VERSION, Calibration
    value, path = float(sys.argv[1]), sys.argv[2]
    meta = {"kvq_ao_calibration": CALIBRATION_VERSION, "model": {"name": "m"}, "config": {"name": "c"}}
    for i in range(40):
        Calibration(meta, {"layers.0.key.codebook": torch.full((4096,), value + i)}).save(path)
""")


def test_racing_calibration_writers_leave_a_whole_calibration_at_every_moment(tmp_path):
    """Two processes save calibrations of different tensors to one path 40 times each while this one
    reads it: every read is one writer's whole calibration (its JSON and the tensors it names)."""
    path = tmp_path / "c.json"
    _calibration(-1.0).save(path)
    writers = [subprocess.Popen([sys.executable, "-c", WRITER, str(v), str(path)]) for v in (0.0, 1000.0)]
    reads = 0
    while any(w.poll() is None for w in writers):
        calib = Calibration.load(path)
        values = calib.tensors["layers.0.key.codebook"]
        assert torch.equal(values, values[:1].expand_as(values))  # one save's tensors, not a mix
        reads += 1
    assert [w.returncode for w in writers] == [0, 0] and reads > 0
    final = float(Calibration.load(path).tensors["layers.0.key.codebook"][0])
    assert final in (39.0, 1039.0)
    assert json.loads(path.read_text())["tensors_file"] in os.listdir(tmp_path)


@pytest.mark.slow
def test_two_processes_building_the_native_kernels_at_once_both_get_them(tmp_path):
    """An empty user cache and two first uses at the same moment (two workers starting): both load
    a working library (torch's extension builder locks its build folder; the second waits)."""
    code = ("import torch, kvq_ao.kernels.cpu as cpu; assert cpu.load(), cpu._state['failed']; "
            "assert torch._C._dispatch_has_kernel_for_dispatch_key('kvq::decode_attention', 'CPU')")
    env = {**os.environ, "KVQ_AO_CACHE": str(tmp_path)}
    builders = [subprocess.Popen([sys.executable, "-c", code], env=env, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    for b in builders:
        _, err = b.communicate(timeout=900)
        assert b.returncode == 0, err[-2000:]


def test_the_converted_model_cache_is_checked_and_a_damaged_copy_converted_again(tmp_path, monkeypatch):
    """A GGUF is converted once into the user cache with a manifest of sizes and checksums (of the
    files and of the GGUF converted); a copy truncated or edited later (same size), a file gone, a
    manifest gone, or a conversion of another GGUF of the same name and size is converted again,
    with the reason logged."""
    from kvq_ao import models

    monkeypatch.setenv("KVQ_AO_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF" + bytes(60))
    conversions, logged = [], []

    def convert(source, out, log=print):  # what _convert_gguf leaves: a folder of files and their manifest
        conversions.append(source.read_bytes())
        tmp = out.with_name(out.name + ".partial")
        tmp.mkdir()
        (tmp / "config.json").write_text('{"model_type": "llama"}')
        (tmp / "model.safetensors").write_bytes(bytes(range(256)) * 64)
        models.write_manifest(tmp, source)
        tmp.rename(out)

    monkeypatch.setattr(models, "_convert_gguf", convert)
    resolve = lambda: models.resolve_model_path(str(gguf), log=logged.append)  # noqa: E731
    folder = resolve()
    assert len(conversions) == 1 and resolve() == folder and len(conversions) == 1
    weights = folder / "model.safetensors"
    damage = {
        "truncated": lambda: weights.write_bytes(weights.read_bytes()[:1000]),
        "one byte edited": lambda: weights.write_bytes(b"\x01" + weights.read_bytes()[1:]),
        "a file gone": weights.unlink,
        "the manifest gone": (folder / models.MANIFEST).unlink,
        "another GGUF of the same name and size": lambda: gguf.write_bytes(b"GGUF" + bytes(59) + b"\x07"),
    }
    for n, (what, act) in enumerate(damage.items(), start=2):
        act()
        assert models.manifest_problem(folder, gguf), what
        assert resolve() == folder and len(conversions) == n, what
        assert "cannot be used" in logged[-1] and "converting it again" in logged[-1], what
        assert models.manifest_problem(folder, gguf) is None and weights.read_bytes() == bytes(range(256)) * 64
    assert "converted from another tiny.gguf" in logged[-1] and conversions[-1] == gguf.read_bytes()


def _artifacts(tmp_path):
    """(path, loader, also_tolerated) for each file type kvq_ao reads back: calibration metadata and
    tensors, a config, a layer profile. `also_tolerated`: what a damaged copy may load as instead of
    raising (hand-editable JSON: any config that validates; checksummed content, the calibration's
    tensors and a layer profile: nothing)."""
    import numpy as np

    from kvq_ao import KVQuantConfig
    from kvq_ao.tuning.profile import LayerProfile

    calib = _calibration(3.0).save(tmp_path / "c.json")
    tensors = tmp_path / json.loads(calib.read_text())["tensors_file"]
    config = tmp_path / "config.json"
    KVQuantConfig.preset("kvquant-3-1pct").save(config)
    profile = LayerProfile({"name": "m", "num_layers": 2, "kv_heads": 1, "head_dim": 8}, {}, [(4, 4), (2, 2)],
                           np.ones((2, 2)), np.ones((2, 2)), 64, {}).save(tmp_path / "profile.json")  # fmt: skip
    return [(calib, Calibration.load, "structure"), (tensors, lambda _: Calibration.load(calib), None),
            (config, KVQuantConfig.load, "structure"), (profile, LayerProfile.load, None)]  # fmt: skip


def test_damaged_files_of_every_kind_raise_an_error_naming_the_file(tmp_path):
    """Each file truncated at 40 random offsets and with 40 random bytes flipped (one at a time):
    loading raises a ValueError that names the file, or (for JSON a user may edit) loads a whole
    object that passed validation; never another exception, never a partial load. Calibration
    tensors are checksummed, so any change there is an error."""
    import random

    rng = random.Random(49)
    artifacts = _artifacts(tmp_path)
    calib_name = artifacts[0][0].name  # a damaged tensors file is reported by the calibration that names it
    for path, load, tolerated in artifacts:
        original = path.read_bytes()
        damaged = []
        for _ in range(40):
            damaged.append(original[: rng.randrange(1, len(original))])
            i = rng.randrange(len(original))
            damaged.append(original[:i] + bytes([original[i] ^ rng.randrange(1, 256)]) + original[i + 1 :])
        for data in damaged:
            path.write_bytes(data)
            try:
                loaded = load(path)
            except (ValueError, FileNotFoundError) as e:  # FileNotFoundError: an edited name of the tensors file
                assert path.name in str(e) or calib_name in str(e), f"{path.name}: the error does not name the file: {e}"
                continue
            assert tolerated, f"{path.name}: a damaged copy loaded without an error"
            assert loaded is not None
        path.write_bytes(original)
        load(path)  # the undamaged file still loads


def test_another_version_or_another_model_of_every_kind_is_refused_by_name(tmp_path):
    """Each artifact kvq_ao reads back, written by a kvq_ao of another format version, or made for
    another model, gives an error naming the file (or the artifact) and what is wrong. (Exported
    programs: tests/export/test_export.py, which also checks their recorded checksums; they carry
    their model's weights, so "another model" is another config there.)"""
    from conftest import tiny_llama
    from kvq_ao import KVQuantConfig, LayerKV, QuantSpec, quantize_kv_
    from kvq_ao import models
    from kvq_ao.tuning.profile import LayerProfile

    artifacts = _artifacts(tmp_path)
    version_keys = {"c.json": "kvq_ao_calibration", "config.json": "kvq_ao_config", "profile.json": "kvq_ao_profile"}
    loaders = {path.name: load for path, load, _ in artifacts}
    for name, key in version_keys.items():
        path = tmp_path / name
        data = json.loads(path.read_text())
        assert key in data, f"{name} records no version under {key!r}"
        path.write_text(json.dumps({**data, key: data[key] + 1}))
        with pytest.raises(ValueError, match=f"{name}: .*(version|not a kvq_ao)"):
            loaders[name](path)

    # another model: a calibration, a layer profile and a per-layer config made for another layout
    calib = _calibration(1.0)
    calib.meta["model"] = {"name": "other", "num_layers": 30, "kv_heads": 3, "head_dim": 64}
    with pytest.raises(ValueError, match=r"was made for other \(30 layers, 3 KV heads"):
        calib.check_model(2, 2, 64)
    profile = LayerProfile({"name": "other", "num_layers": 2, "kv_heads": 1, "head_dim": 8}, {}, [(4, 4)],
                           np.ones((2, 1)), np.ones((2, 1)), 64, {})  # fmt: skip
    with pytest.raises(ValueError, match=r"this profile was made for other \(2 layers, 1 KV heads, head_dim 8\)"):
        profile.check_model(tiny_llama(layers=2))
    per_layer = KVQuantConfig(layers=(LayerKV(QuantSpec(4, "channel"), QuantSpec(4)),) * 30, name="tuned-for-30")
    with pytest.raises(ValueError, match="'tuned-for-30' has 30 layer specs but the model has 2 layers"):
        quantize_kv_(tiny_llama(layers=2), per_layer)

    # the converted-model cache: a manifest of another version is a problem (the folder is converted again)
    folder = tmp_path / "converted"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    models.write_manifest(folder, gguf)
    manifest = json.loads((folder / models.MANIFEST).read_text())
    (folder / models.MANIFEST).write_text(json.dumps({**manifest, "kvq_ao_model_cache": models.MANIFEST_VERSION + 1}))
    assert f"not a version-{models.MANIFEST_VERSION} kvq_ao manifest" in models.manifest_problem(folder, gguf)


def test_an_edited_or_outdated_cached_layer_profile_is_replaced_not_used(tmp_path, monkeypatch):
    """A layer profile is measured, never hand-written: one edited number is refused by its recorded
    sha256. At `kvq tune`'s default place in the user cache such a file (or one of an older version)
    is removed with the reason logged, so it is seeded or profiled again; the packaged model's
    shipped profile goes back in its place, byte for byte."""
    import shutil

    import torch

    from conftest import tiny_llama
    from kvq_ao import artifacts
    from kvq_ao.tuning.profile import LayerProfile, base_config
    from kvq_ao.tuning.tuner import default_profile_path

    path = _artifacts(tmp_path)[3][0]
    data = json.loads(path.read_text())
    data["kl"][1][0] = 0.5  # a plausible number, so only the checksum can tell
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="profile.json: .*differs from the sha256 recorded"):
        LayerProfile.load(path)

    monkeypatch.setenv("KVQ_AO_CACHE", str(tmp_path / "cache"))
    model, ids, logged = tiny_llama(), torch.zeros(2, 16, dtype=torch.int64), []
    cached = default_profile_path(model, base_config(), ids, logged.append)
    cached.parent.mkdir(parents=True)
    shutil.copyfile(path, cached)
    assert default_profile_path(model, base_config(), ids, logged.append) == cached and not cached.exists()
    assert "cached layer profile cannot be used" in logged[-1] and "differs from the sha256" in logged[-1]

    shipped = next(f for f in (artifacts.SHIPPED / "tune").glob("*.json") if "kvq_ao_profile" in f.read_text()[:40])
    user_copy = tmp_path / "cache" / "tune" / shipped.name
    old = json.loads(shipped.read_text())
    old.pop("sha256")
    user_copy.write_text(json.dumps({**old, "kvq_ao_profile": 1}))  # as an older kvq_ao left it
    monkeypatch.setattr("kvq_ao.calibration.model_key", lambda _m: shipped.name.split("-r128-")[0])
    assert default_profile_path(model, base_config(), torch.zeros(2, 512, dtype=torch.int64), logged.append) == user_copy
    assert "older kvq_ao" in logged[-1] and user_copy.read_bytes() == shipped.read_bytes()
    LayerProfile.load(user_copy)
