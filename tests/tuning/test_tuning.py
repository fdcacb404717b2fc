"""KVTuner's pieces on their own: Pareto pruning, layer clustering, the search."""

import dataclasses

import numpy as np
import pytest

from kvq_ao.tuning import CANDIDATES, candidate_pairs, cluster_layers, pair_bits, pareto_front, prune, search
from kvq_ao.tuning.cluster import group_candidates


def test_pareto_front_on_hand_made_points():
    pts = [(2, 0.5), (3, 0.5), (3, 0.2), (4, 0.3), (5, 0.1), (2, 0.6), (5, 0.1)]
    # (3, 0.5) and (4, 0.3) are dominated, (2, 0.6) too, the duplicate (5, 0.1) keeps the first
    assert pareto_front(pts) == [0, 2, 4]


def test_prune_keeps_the_cheapest_pair_per_error_level():
    errors = {(2, 2): 0.30, (2, 4): 0.28, (4, 2): 0.10, (2, 8): 0.27, (4, 4): 0.05, (8, 2): 0.09,
              (4, 8): 0.05, (8, 4): 0.02, (8, 8): 0.02}  # fmt: skip
    # keys matter more: K4V2 beats K2V4 at the same bits; K4V8 is no better than K4V4; K8V8 no better than K8V4
    assert prune(errors) == [(2, 2), (4, 2), (4, 4), (8, 4)]


def test_unknown_pair_is_rejected():
    with pytest.raises(ValueError, match="unknown candidate pair \\(5, 4\\)"):
        prune({(5, 4): 0.1})
    with pytest.raises(ValueError, match="unknown candidate pair"):
        pair_bits((16, 2))


def test_candidate_pairs_over_chosen_widths():
    import argparse

    from kvq_ao.cli import _widths

    assert CANDIDATES == candidate_pairs((8, 2, 4)) and len(CANDIDATES) == 9  # KVTuner's {2,4,8}^2 by default
    with_three = candidate_pairs((2, 3, 4, 8))
    assert len(with_three) == 16 and (3, 4) in with_three and set(CANDIDATES) < set(with_three)
    for bad in ((), (2, 5), (1, 2), (True, 2)):
        with pytest.raises(ValueError, match="candidate widths"):
            candidate_pairs(bad)
    assert _widths("2,3,4,8") == (2, 3, 4, 8)
    with pytest.raises(argparse.ArgumentTypeError, match="--widths '2,6'"):
        _widths("2,6")


def test_clustering_recovers_synthetic_groups():
    rng = np.random.default_rng(0)
    levels = np.array([1e-3, 1e-2, 1e-1])
    truth = rng.integers(0, 3, size=30)
    shape = np.linspace(1.0, 0.1, len(CANDIDATES))  # error falls with bits
    profiles = levels[truth, None] * shape[None, :] * np.exp(rng.normal(0, 0.05, (30, len(CANDIDATES))))
    groups = cluster_layers(profiles, 3)
    # same partition as the truth, up to the group numbering
    mapping = {}
    for g, t in zip(groups, truth):
        assert mapping.setdefault(g, t) == t
    assert groups[0] == 0 and len(set(groups)) == 3
    with pytest.raises(ValueError, match="n_groups must be in"):
        cluster_layers(profiles, 31)
    with pytest.raises(ValueError, match="finite positive"):
        cluster_layers(-profiles, 2)


def test_group_candidates_are_unions_of_pareto_sets():
    pruned = [[(2, 2), (4, 4)], [(4, 2)], [(8, 8)]]
    assert group_candidates([0, 0, 1], pruned) == [[(2, 2), (4, 2), (4, 4)], [(8, 8)]]


def _synthetic_loss(assignment):
    """Loss falls with bits, keys count 4x values, group 1 is 10x as sensitive as group 0."""
    weights = (1.0, 10.0, 1.0)
    return sum(w * (4 * 2.0 ** -k + 2.0 ** -v) for w, (k, v) in zip(weights, assignment))


@pytest.mark.parametrize("exhaustive_limit", [10_000, 1])  # exhaustive, then NSGA-II
def test_search_finds_the_known_optimum_under_a_budget(exhaustive_limit):
    candidates = [list(CANDIDATES)] * 3
    sizes = [10, 10, 10]
    front = search(candidates, sizes, _synthetic_loss, max_avg_bits=4.0, exhaustive_limit=exhaustive_limit, trials=300)
    assert all(r.avg_bits <= 4.0 for r in front)
    best = min(front, key=lambda r: r.loss)
    # the optimum at <= 4 average bits, found by brute force over all 729 assignments
    import itertools

    from kvq_ao.tuning.search import average_bits

    feasible = [a for a in itertools.product(CANDIDATES, repeat=3) if average_bits(a, sizes) <= 4.0]
    optimum = min(_synthetic_loss(a) for a in feasible)
    if exhaustive_limit > 729:
        assert best.loss == optimum
    else:
        assert best.loss <= optimum * 1.25  # NSGA-II with 300 trials gets close
    assert best.assignment[1][0] >= best.assignment[0][0]  # the sensitive group gets at least as many key bits


def test_predicted_front_is_the_exact_front_of_an_additive_loss():
    import itertools
    import random

    from kvq_ao.tuning.pareto import pareto_front
    from kvq_ao.tuning.search import average_bits, predicted_front

    rng = random.Random(0)
    sizes = [3, 1, 4, 2]
    candidates = [rng.sample(list(CANDIDATES), k) for k in (4, 9, 3, 5)]
    table = {(g, p): rng.uniform(0, 1) * 2.0 ** -(p[0] + p[1]) for g in range(4) for p in CANDIDATES}
    front = predicted_front(candidates, sizes, lambda g, p: table[g, p])
    every = list(itertools.product(*candidates))
    points = [(average_bits(a, sizes), sum(table[g, p] for g, p in enumerate(a))) for a in every]
    want = sorted((points[i][0], round(points[i][1], 12)) for i in pareto_front(points))
    assert sorted((r.avg_bits, round(r.loss, 12)) for r in front) == want
    for r in front:  # each assignment really has the bits and loss it is listed with
        assert r.avg_bits == average_bits(r.assignment, sizes)
        assert abs(r.loss - sum(table[g, p] for g, p in enumerate(r.assignment))) < 1e-12


def test_search_seeds_start_nsga2_and_are_checked():
    seen = []

    def loss(a):
        seen.append(a)
        return _synthetic_loss(a)

    candidates, sizes = [list(CANDIDATES)] * 3, [10, 10, 10]
    seed_assignment = ((4, 4), (8, 4), (2, 2))
    search(candidates, sizes, loss, max_avg_bits=4.0, exhaustive_limit=1, trials=8, seeds=[seed_assignment])
    assert seen[0] == seed_assignment
    with pytest.raises(ValueError, match="not one candidate per group"):
        search([[(2, 2), (4, 4)]] * 2, [1, 1], loss, max_avg_bits=3.0, seeds=[((8, 8), (2, 2))])


def test_budget_outside_the_candidates_is_a_clear_error():
    candidates, sizes = [[(2, 2), (8, 8)]] * 2, [5, 5]
    with pytest.raises(ValueError, match="below the cheapest"):
        search(candidates, sizes, _synthetic_loss, max_avg_bits=1.5)
    with pytest.raises(ValueError, match="above the most expensive"):
        search(candidates, sizes, _synthetic_loss, max_avg_bits=9.0)


# ----------------------------------------------------------------------------- on a tiny model
def test_tune_a_tiny_model_end_to_end_and_reuse_the_profile(tmp_path):
    import torch

    from conftest import tiny_llama
    from kvq_ao import KVQuantConfig, make_cache, quantize_kv_
    from kvq_ao.tuning.profile import LayerProfile, base_config, profile
    from kvq_ao.tuning.tuner import tune, write_front

    model = tiny_llama()
    ids = torch.randint(3, 128, (1, 96), generator=torch.Generator().manual_seed(0))
    base = base_config(residual_length=8, group_size=16)
    logs = []
    prof_path = tmp_path / "profile.json"
    result = tune(model, ids, max_avg_bits=4.0, n_groups=2, base=base, profile_path=prof_path, progress=False, log=logs.append)
    prof = result.profile
    assert prof.kl.shape == (2, 9) and prof.attn_error.shape == (2, 9) and (prof.kl > 0).all()
    # more bits never cost more attention error, per layer, for keys and values alike
    for layer in range(2):
        assert prof.attn_error[layer, prof.column((8, 8))] < prof.attn_error[layer, prof.column((2, 2))]
    assert result.chosen.avg_bits <= 4.0 and result.chosen in result.front
    result.config.save(tmp_path / "tuned.json")
    cfg = KVQuantConfig.load(tmp_path / "tuned.json")
    assert len(cfg.layers) == 2
    quantize_kv_(model, cfg)
    with torch.no_grad():
        model(ids, cache=make_cache(model))
    write_front(result, tmp_path / "front.csv", tmp_path / "front.png")
    assert (tmp_path / "front.png").stat().st_size > 1000
    assert (tmp_path / "front.csv").read_text().count("uniform") == 9
    again = tune(model, ids, max_avg_bits=3.0, n_groups=2, base=base, profile_path=prof_path, progress=False, log=logs.append)
    assert any("reusing" in m for m in logs) and again.chosen.avg_bits <= 3.0
    # adding 3-bit candidates profiles only the 7 new pairs and keeps the 9 measured ones as they were
    logs.clear()
    wider = tune(model, ids, max_avg_bits=3.0, n_groups=2, base=base, profile_path=prof_path, progress=False, log=logs.append,
                 widths=(2, 3, 4, 8))  # fmt: skip
    assert any("profiling the 7 pairs it lacks" in m for m in logs)
    assert wider.profile.candidates == list(candidate_pairs((2, 3, 4, 8))) and wider.profile.kl.shape == (2, 16)
    saved = LayerProfile.load(prof_path)
    assert saved.candidates[:9] == list(CANDIDATES) and np.array_equal(saved.kl[:, :9], prof.kl)
    fresh = profile(model, ids, base, candidates=[(3, 4), (2, 3)], progress=False)  # deterministic: same numbers
    for pair in fresh.candidates:
        assert np.array_equal(wider.profile.kl[:, wider.profile.column(pair)], fresh.kl[:, fresh.column(pair)]), pair
    assert wider.chosen.avg_bits <= 3.0 and len(wider.uniform) == 16
    with pytest.raises(ValueError, match="not for"):
        tune(tiny_llama(layers=3), ids, max_avg_bits=3.0, base=base, profile_path=prof_path, progress=False)
    with pytest.raises(ValueError, match="invalid layer profile"):
        (tmp_path / "bad.json").write_text("{}")
        LayerProfile.load(tmp_path / "bad.json")


def test_tune_over_kvquant_datatypes_nf_levels_and_pre_rope_keys(tmp_path):
    """KVQuant's uncalibrated datatype (NormalFloat levels) and pre-RoPE keys as tuning candidates:
    2/4-bit candidates take the base's levels, 8-bit ones stay int; the tuned config runs, with the
    base's 16-bit window, and its profile is kept apart from a float32-window base's."""
    import torch

    from conftest import tiny_llama
    from kvq_ao import make_cache, quantize_kv_
    from kvq_ao.tuning.profile import base_config, layer_spec
    from kvq_ao.tuning.tuner import default_profile_path, tune

    base = base_config(residual_length=8, group_size=16, dtype="nf", pre_rope_keys=True, side_dtype="float16")
    spec = layer_spec((2, 8), base)
    assert (spec.key.dtype, spec.key.bits, spec.value.dtype, spec.value.bits) == ("nf", 2, "int", 8)
    model = tiny_llama()
    ids = torch.randint(3, 128, (1, 96), generator=torch.Generator().manual_seed(1))
    result = tune(model, ids, max_avg_bits=3.0, n_groups=2, base=base, progress=False, log=lambda _m: None)
    cfg = result.config
    assert cfg.pre_rope_keys and cfg.side_dtype == "float16" and result.chosen.avg_bits <= 3.0
    fp32_window = dataclasses.replace(base, side_dtype="model")
    assert default_profile_path(model, base, ids) != default_profile_path(model, fp32_window, ids)
    assert {s.dtype for layer in cfg.layers for s in (layer.key, layer.value) if s.bits in (2, 4)} <= {"nf"}
    # nf at 2 bits costs this layer more than nf at 4 bits (the profile measured real differences)
    assert (result.profile.kl[:, result.profile.column((2, 2))] > result.profile.kl[:, result.profile.column((4, 4))]).all()
    quantize_kv_(model, cfg)
    with torch.no_grad():
        model(ids, cache=make_cache(model, cfg))


def _assert_assembled_calibration_is_direct(model, calib_ids, cfg):
    """The calibration `tune` assembled layer by layer from one calibration per width equals
    calibrating the tuned config directly, up to float rounding (tuning left the model's attention
    on kvq_ao's path)."""
    import torch

    from kvq_ao.calibration import Calibration, calibrate

    assembled = Calibration.load(cfg.calibration)
    direct = calibrate(model, calib_ids, cfg, progress=False)
    assert assembled.tensors.keys() == direct.tensors.keys() and direct.tensors
    for name, t in direct.tensors.items():
        torch.testing.assert_close(assembled.tensors[name], t, rtol=1e-5, atol=1e-6, msg=name)


def test_tune_over_calibrated_kvquant_datatypes_calibrates_each_width_once(tmp_path):
    """`base_config(dtype="kvquant")`: the kvquant preset layout (nuq levels, calibrated key ranges,
    outliers) at every width. Each width is calibrated once; the tuned config's calibration, assembled
    layer by layer from them, is what calibrating the mixed config itself fits."""
    import torch

    from conftest import tiny_llama
    from kvq_ao import make_cache, quantize_kv_
    from kvq_ao.tuning.profile import base_config, layer_spec
    from kvq_ao.tuning.tuner import tune

    base = dataclasses.replace(base_config(dtype="kvquant"), residual_length=8, sink_tokens=1)  # tiny inputs: a short window
    spec = layer_spec((2, 8), base)
    key, value = spec.key, spec.value
    assert (key.bits, key.dtype, value.bits, value.dtype) == (2, "nuq", 8, "int")
    assert key.outliers == 0.01 and key.calibrated_ranges and base.pre_rope_keys
    assert value.outliers == 0.0  # the presets' layout: values keep no outliers
    with pytest.raises(ValueError, match="side_dtype"):
        base_config(dtype="kvquant", side_dtype="float16")
    model = tiny_llama()
    ids = torch.randint(3, 128, (1, 96), generator=torch.Generator().manual_seed(1))
    calib_ids = torch.randint(3, 128, (3, 64), generator=torch.Generator().manual_seed(2))
    result = tune(model, ids, max_avg_bits=3.0, n_groups=2, base=base, progress=False, log=lambda _m: None,
                  calibration_ids=calib_ids, calibration_folder=tmp_path, widths=(2, 3, 4, 8))  # fmt: skip
    cfg = result.config
    assert result.chosen.avg_bits <= 3.0 and {s.bits for layer in cfg.layers for s in (layer.key, layer.value)} > {2}
    assert sorted(p.name for p in tmp_path.glob("*bit.json")) == [f"{base.name}-{w}bit.json" for w in (2, 3, 4, 8)]
    _assert_assembled_calibration_is_direct(model, calib_ids, cfg)
    assert (result.profile.kl[:, result.profile.column((2, 2))] > result.profile.kl[:, result.profile.column((4, 4))]).all()
    quantize_kv_(model, cfg)
    with torch.no_grad():
        model(ids, cache=make_cache(model, cfg))


def test_tune_over_rotated_datatypes_keeps_the_rotated_layout(tmp_path):
    """`base_config(dtype="rot")`: the rotated presets' layout (keys and values rotated per vector,
    post-RoPE, calibrated nuq levels up to 4 bits, uniform at 8) at every width, each width calibrated
    once; the tuned config runs through the cache, and its assembled calibration is what calibrating
    it directly fits."""
    import torch

    from conftest import tiny_llama
    from kvq_ao import make_cache, quantize_kv_
    from kvq_ao.config import KVQuantConfig
    from kvq_ao.tuning.profile import base_config, layer_spec
    from kvq_ao.tuning.tuner import tune

    preset = KVQuantConfig.preset("rot-k4v3")
    base = base_config(dtype="rot")
    assert (base.sink_tokens, base.residual_length, base.side_dtype, base.pre_rope_keys) == (1, 112, "float16", False)
    for pair, dtypes in (((3, 2), ("nuq", "nuq")), ((8, 4), ("int", "nuq"))):
        spec = layer_spec(pair, base)
        for s, bits, dtype, like in zip((spec.key, spec.value), pair, dtypes, (preset.default.key, preset.default.value)):
            assert (s.bits, s.dtype) == (bits, dtype)
            assert (s.axis, s.group_size, s.rotation) == (like.axis, like.group_size, "hadamard")
    with pytest.raises(ValueError, match="side_dtype"):
        base_config(dtype="rot", side_dtype="float16")
    base = dataclasses.replace(base, residual_length=8)  # tiny inputs: a short window
    model = tiny_llama()
    ids = torch.randint(3, 128, (1, 96), generator=torch.Generator().manual_seed(1))
    calib_ids = torch.randint(3, 128, (3, 64), generator=torch.Generator().manual_seed(2))
    result = tune(model, ids, max_avg_bits=3.0, n_groups=2, base=base, progress=False, log=lambda _m: None,
                  calibration_ids=calib_ids, calibration_folder=tmp_path, widths=(2, 3, 4, 8))  # fmt: skip
    cfg = result.config
    assert result.chosen.avg_bits <= 3.0
    # a K8V8 layer needs nothing fitted: profiling it once stopped with "needs no calibration"
    assert result.profile.kl[:, result.profile.column((8, 8))].max() < result.profile.kl[:, result.profile.column((2, 2))].min()
    assert {s.rotation for layer in cfg.layers for s in (layer.key, layer.value)} == {"hadamard"}
    _assert_assembled_calibration_is_direct(model, calib_ids, cfg)
    assert (result.profile.kl[:, result.profile.column((2, 2))] > result.profile.kl[:, result.profile.column((4, 4))]).all()
    quantize_kv_(model, cfg)
    with torch.no_grad():
        model(ids, cache=make_cache(model, cfg))
