"""Rotated formats: keys and values stored x R, queries rotated, outputs rotated back."""

import dataclasses

import pytest
import torch

from kvq_ao import KVQuantConfig, LayerKV, QuantSpec
from kvq_ao.api import make_cache, quantize_kv_
from kvq_ao.quant.rotation import rotate, rotation_matrix, unrotate
from tests.conftest import kvquant_config, tiny_llama


@pytest.mark.parametrize("head_dim", [64, 128, 96, 80])
def test_rotation_is_orthogonal_fixed_and_a_hadamard_where_it_can_be(head_dim):
    r = rotation_matrix(head_dim).double()
    torch.testing.assert_close(r @ r.T, torch.eye(head_dim, dtype=torch.float64), atol=1e-6, rtol=0)
    assert torch.equal(rotation_matrix(head_dim), rotation_matrix(head_dim))  # the same matrix in every process
    if head_dim & (head_dim - 1) == 0:  # every entry +-1/sqrt(D): each output mixes every channel equally
        torch.testing.assert_close(r.abs(), torch.full_like(r, head_dim**-0.5), atol=1e-7, rtol=0)
    x = torch.randn(3, head_dim, dtype=torch.float64, generator=torch.Generator().manual_seed(head_dim))
    # (R is stored in float32: orthogonal to float32 precision, so the round trip is exact to ~1e-7)
    torch.testing.assert_close(unrotate(rotate(x, r), r), x, atol=1e-6, rtol=1e-6)


def test_rotation_spreads_an_outlier_channel_over_all_channels():
    x = torch.randn(256, 64)
    x[:, 5] *= 40  # one channel 40x the others, as a key's massive channels
    peak = lambda t: (t.abs().amax(-1) / t.pow(2).mean(-1).sqrt()).mean()  # noqa: E731  (max / RMS per vector)
    assert peak(x) > 6 and peak(rotate(x, rotation_matrix(64))) < 3.5  # a Gaussian vector of 64: about 2.4


def _config(bits: int, key_rot=True, value_rot=True, window: int = 0, dtype: str = "int", metadata: str = "float") -> KVQuantConfig:
    rot = lambda on: "hadamard" if on else "none"  # noqa: E731
    return KVQuantConfig(default=LayerKV(QuantSpec(bits, "token", 64, dtype, rotation=rot(key_rot), metadata=metadata),
                                         QuantSpec(bits, "token", 64, dtype, rotation=rot(value_rot), metadata=metadata)),
                         residual_length=window, name=f"rot-{bits}")  # fmt: skip


def test_rotated_cache_dequantizes_to_the_unrotated_keys_and_values(tiny_model):
    quantize_kv_(tiny_model, _config(8))
    cache = make_cache(tiny_model)
    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tiny_model(ids, past_key_values=cache, use_cache=True)
    plain = make_cache(tiny_model, KVQuantConfig.preset("fp"))
    with torch.no_grad():
        tiny_model(ids, past_key_values=plain, use_cache=True)
    k, v = cache.layers[0].keys_values()
    assert k.rotated and v.rotated
    k_fp, v_fp = plain.layers[0].keys, plain.layers[0].values
    k_q, v_q = k.dequantize()[:, :, :40], v.dequantize()[:, :, :40]
    assert (k_q - k_fp).abs().max() < 0.02 * k_fp.abs().max()  # 8 bits per vector, rotated back
    assert (v_q - v_fp).abs().max() < 0.02 * v_fp.abs().max()
    assert (k.body()[:, :, :40] - k_fp).abs().max() > 0.1 * k_fp.abs().max()  # (stored rotated)


def _teacher_forced_logits(model, ids: torch.Tensor, prompt: int, cache) -> torch.Tensor:
    """Logits of every position after the prompt: the prompt prefilled, then one token a step."""
    with torch.no_grad():
        out = [model(ids[:, :prompt], past_key_values=cache, use_cache=True).logits[:, -1]]
        for t in range(prompt, ids.shape[1] - 1):
            out.append(model(ids[:, t : t + 1], past_key_values=cache, use_cache=True).logits[:, -1])
    return torch.stack(out, 1)


def test_8bit_metadata_holds_a_byte_a_scale_and_zero_and_decodes_nearly_as_float_metadata(tiny_model):
    """A rotated 4-bit cache with 8-bit scale and zero: the memory report counts one byte each (one
    less than float16 for every scale and zero the cache holds; the bytes held agree), the metadata
    is uint8, and teacher-forced logits stay about as close to fp's as with float16 metadata."""
    torch.manual_seed(0)
    ids = torch.randint(3, 128, (1, 300), generator=torch.Generator().manual_seed(2))
    logits, reported, metas = {}, {}, {}
    for metadata in ("float", "8-bit", None):
        cfg = KVQuantConfig.preset("fp") if metadata is None else _config(4, metadata=metadata)
        cache = make_cache(tiny_model, cfg)
        logits[metadata] = _teacher_forced_logits(tiny_model, ids, 200, cache)
        if metadata is None:
            continue
        held, report = cache.tensor_bytes(), cache.memory_report()
        assert abs(report.bytes - held) / held < 0.01
        reported[metadata] = report.bytes
        bodies = [body for layer in cache.layers for body in (layer.k_body, layer.v_body)]
        assert {b.scale.dtype for b in bodies} == {torch.uint8 if metadata == "8-bit" else torch.float16}
        metas[metadata] = sum(b.scale.numel() + b.zero.numel() for b in bodies)
    assert metas["float"] == metas["8-bit"] > 0 and reported["float"] - reported["8-bit"] == metas["8-bit"]
    err = {m: (logits[m] - logits[None]).abs().max().item() for m in ("float", "8-bit")}
    assert 0 < err["8-bit"] < 1.5 * err["float"], err


@pytest.mark.parametrize("key_rot,value_rot", [(True, True), (True, False), (False, True)])
def test_rotated_8bit_cache_decodes_as_the_fp_cache_does(key_rot, value_rot):
    """Teacher-forced prefill and decode steps: the rotated 8-bit cache's logits are as close to
    fp's as the unrotated 8-bit cache's (rotation changes where the rounding falls, not how much)."""
    model = tiny_llama(seed=3)
    ids = torch.randint(3, 128, (2, 36), generator=torch.Generator().manual_seed(1))
    logits = {}
    for name, cfg in (("fp", KVQuantConfig.preset("fp")), ("plain", _config(8, False, False)), ("rot", _config(8, key_rot, value_rot))):
        quantize_kv_(model, cfg)
        logits[name] = _teacher_forced_logits(model, ids, 24, make_cache(model))
    err = {name: (logits[name] - logits["fp"]).abs().max().item() for name in ("plain", "rot")}
    assert 0 < err["rot"] < 3 * err["plain"] + 1e-6 and err["rot"] < 0.01 * logits["fp"].abs().max().item(), err


@pytest.mark.parametrize("bits", [3, 4])
def test_rotation_lowers_the_error_of_a_per_vector_cache_on_keys_with_a_massive_channel(bits):
    """The same per-vector format with and without rotation, on keys with one channel offset far
    above the rest (as real keys have): the rotated cache's attention output is closer to exact."""
    from kvq_ao.cache import QuantizedLayer
    from kvq_ao.tensor import attention

    torch.manual_seed(0)
    q = torch.randn(1, 2, 1, 64) * 2
    k = torch.randn(1, 2, 300, 64)
    k[..., 7] += 30
    v = torch.randn(1, 2, 300, 64)
    ref = torch.softmax((q @ k.transpose(-1, -2)) / 8, -1) @ v
    errors = {}
    for rot in (False, True):
        layer = QuantizedLayer(_config(bits, rot, rot).default)
        layer.update(k, v)
        k_view, v_view = layer.keys_values()
        mask = torch.ones(1, 1, 1, k_view.shape[2], dtype=torch.bool)  # (the body's capacity)
        errors[rot] = (attention(q, k_view, v_view, mask, 1 / 8) - ref).pow(2).mean().item()
    assert errors[True] < 0.5 * errors[False], errors  # (3 bits: 0.015 vs 0.17; 4 bits: 0.011 vs 0.036)


def test_rotated_keys_refuse_pre_rope_storage():
    with pytest.raises(ValueError, match="rotated keys need pre_rope_keys false"):
        KVQuantConfig(default=LayerKV(QuantSpec(3, "token", 64, rotation="hadamard"), QuantSpec(3, "token", 64)), pre_rope_keys=True)
    with pytest.raises(ValueError, match="rotation must be one of"):
        QuantSpec(3, rotation="givens")


def test_rotation_round_trips_through_json_and_names_itself(tmp_path):
    cfg = _config(3, key_rot=True, value_rot=False)
    cfg.save(tmp_path / "c.json")
    back = KVQuantConfig.load(tmp_path / "c.json")
    assert back == cfg and back.default.key.rotation == "hadamard" and back.default.value.rotation == "none"
    assert back.default.key.label().startswith("rot-") and not back.default.value.label().startswith("rot-")


def test_a_calibration_fitted_for_rotated_vectors_fits_them_and_only_them(tmp_path):
    """nuq levels and calibrated key ranges of a rotated format are fitted to x R; a calibration
    of the unrotated format is refused for it."""
    model = tiny_llama()
    cfg = kvquant_config(bits=3, outliers=0.0, pre_rope=False, sink=0, key_ranges="calibrated", model=model, folder=tmp_path)
    rot = lambda s: dataclasses.replace(s, rotation="hadamard")  # noqa: E731
    rotated = dataclasses.replace(cfg, default=LayerKV(rot(cfg.default.key), rot(cfg.default.value)), name="rotated",
                                  calibration=None)  # fmt: skip
    with pytest.raises(ValueError, match="calibrate this config"):
        quantize_kv_(model, dataclasses.replace(rotated, calibration=cfg.calibration))
        make_cache(model)
    from kvq_ao.calibration import calibrate

    ids = torch.randint(3, 128, (4, 64), generator=torch.Generator().manual_seed(1))
    calib = calibrate(model, ids, rotated, progress=False)
    lo, hi = calib.layer(0)[0].lo, calib.layer(0)[0].hi
    plain_lo = calibrate(model, ids, dataclasses.replace(cfg, calibration=None), progress=False).layer(0)[0].lo
    # rotated ranges are the ranges of rotated keys: evener across channels than the raw ones
    spread = lambda t: (t.abs().amax(-1) / t.abs().mean(-1)).mean()  # noqa: E731
    assert not torch.allclose(lo, plain_lo) and spread(hi - lo) < spread(-plain_lo)
    path = calib.save(tmp_path / "rotated.json")
    quantize_kv_(model, dataclasses.replace(rotated, calibration=str(path)))
    with torch.no_grad():
        out = model.generate(ids[:1, :20], max_new_tokens=6, do_sample=False)
    assert out.shape == (1, 26)


@pytest.mark.parametrize("metadata", ["float", "8-bit"])
def test_a_rotated_cache_exports_to_executorch_and_onnx_and_matches_eager(metadata, tmp_path):
    """The rotations are two matrix products in the decode step's graph: the exported programs
    (ExecuTorch with the kvq kernel library, ONNX) generate what the eager step does, with float
    and with 8-bit scale and zero (whose coding is compares and multiplies, the same in every runtime)."""
    pytest.importorskip("executorch", reason="export needs executorch (installed by the test extra)")
    pytest.importorskip("onnxruntime", reason="export needs onnxruntime (installed by the test extra)")
    from kvq_ao.export import export_executorch, export_onnx
    from kvq_ao.export.decoder import DecodeStep
    from kvq_ao.export.executorch import ExecuTorchRunner
    from kvq_ao.export.onnx import OnnxRunner

    cfg, max_len = _config(4, metadata=metadata), 48  # no fp window: the exported cache's rotated codes are read
    prompt = torch.randint(3, 128, (12,), generator=torch.Generator().manual_seed(4)).tolist()
    pte = export_executorch(tiny_llama(seed=5), cfg, tmp_path / "r.pte", max_seq_len=max_len)
    onnx_path = export_onnx(tiny_llama(seed=5), cfg, tmp_path / "r.onnx", max_seq_len=max_len)
    step = DecodeStep(tiny_llama(seed=5), cfg, max_len)
    assert all(layer.k_rot.numel() and layer.v_rot.numel() for layer in step.cache.layers)
    assert all((layer.k_body.scale.dtype == torch.uint8) == (metadata == "8-bit") for layer in step.cache.layers)
    for runner in (ExecuTorchRunner(pte.path), OnnxRunner(onnx_path)):
        new, logits = runner.generate(prompt, 12)
        step = DecodeStep(tiny_llama(seed=5), cfg, max_len)
        with torch.no_grad():
            eager = [step(torch.tensor([[t]]), torch.tensor([i]))[0, -1] for i, t in enumerate(prompt + new[:-1])]
        diff = max((a - b).abs().max().item() for a, b in zip(logits, eager))
        assert diff / max(b.abs().max().item() for b in eager) < 1e-3, type(runner).__name__
        assert new == [int(x.argmax()) for x in eager[len(prompt) - 1 :]]


@pytest.mark.parametrize("name,budget", [("rot-k4v3", 4.5), ("rot-k3v2", 3.5), ("rot-k3v2-recall", 3.5), ("kvquant-2-rotv", 2.5),
                                         ("kvtuner-rot-4.5", 4.5), ("kvtuner-rot-3.5", 3.5)])  # fmt: skip
def test_rotated_presets_fit_their_budget_and_generate_once_calibrated(name, budget, tmp_path):
    """Each rotated preset stays within the bits per element it was chosen for (SmolLM2's shape,
    4096 tokens, everything counted), stores what it says, and runs once calibrated."""
    from kvq_ao.calibration import calibrate
    from kvq_ao.memory import estimate

    cfg = KVQuantConfig.preset(name)
    assert estimate(cfg, 30, 3, 64, 4096).bits_per_element <= budget
    assert cfg.default.value.rotated and cfg.default.key.rotated == (not cfg.pre_rope_keys)
    model = tiny_llama()
    ids = torch.randint(3, 128, (4, 64), generator=torch.Generator().manual_seed(1))
    path = calibrate(model, ids, cfg, progress=False).save(tmp_path / f"{name}.json")
    quantize_kv_(model, dataclasses.replace(cfg, calibration=str(path)))
    with torch.no_grad():
        out = model.generate(ids[:1, :40], attention_mask=torch.ones_like(ids[:1, :40]), max_new_tokens=130, do_sample=False,
                             return_dict_in_generate=True)  # fmt: skip
    layer = out.cache.layers[0]
    assert int(layer.body_end) > 0  # tokens went past the 112-token window into rotated codes
    k, v = layer.keys_values()
    assert v.rotated and k.rotated == (not cfg.pre_rope_keys)


def test_rot_k3v2_recall_is_the_per_layer_config_its_measurements_ran():
    """docs/rotation.md measured the per-layer config file (4-bit keys listed for layers 0-7 and
    15-22 of SmolLM2's 30); the preset says the same with depth spans, so it must resolve to those
    layers and keep everything else, and widen no layer of a model without them."""
    measured = KVQuantConfig.load("benchmarks/configs/passkey/rot-k3v2-4-bit-keys-layers-0-7-15-22.json")
    preset = KVQuantConfig.preset("rot-k3v2-recall")
    assert preset.resolve(30) == measured.layers
    assert [i for i, kv in enumerate(preset.resolve(30)) if kv.key.bits == 4] == [*range(0, 8), *range(15, 23)]
    same = lambda c: dataclasses.replace(c, layers=(), depth_spans=(), name="")  # noqa: E731
    assert same(preset) == same(measured)
    assert preset.default == KVQuantConfig.preset("rot-k3v2").default and preset.residual_length == 48


@pytest.mark.parametrize("budget", ["4.5", "3.5"])
def test_kvtuner_rot_presets_are_the_configs_kvtuner_found_and_spread_by_depth(budget):
    """docs/rotation.md measured the configs `kvq tune` wrote (one spec per layer of SmolLM2's 30);
    the preset says the same with depth spans: on 30 layers it must resolve to those specs exactly
    and keep everything else, and a shallower model's layers take the pair found at their depth."""
    measured = KVQuantConfig.load(f"results/tune/tuned-rot-m8-{budget}.json")
    preset = KVQuantConfig.preset(f"kvtuner-rot-{budget}")
    assert preset.resolve(30) == measured.layers
    same = lambda c: dataclasses.replace(c, layers=(), depth_spans=(), name="", calibration=None)  # noqa: E731
    assert same(preset) == same(measured)
    assert all(s.metadata == "8-bit" and s.rotated for kv in preset.resolve(30) for s in (kv.key, kv.value))
    assert list(preset.resolve(4)) == [measured.layers[int((i + 0.5) * 30 / 4)] for i in range(4)]


def test_kvtuner_rot_preset_runs_on_gemma3_with_its_pairs_spread_by_depth(tmp_path):
    """A 4-layer Gemma-3 (local and global RoPE, head_dim 256, MQA) takes kvtuner-rot-3.5: each layer
    stores the pair found at its depth in SmolLM2's 30, calibrated, and generation reads the codes."""
    from kvq_ao.calibration import calibrate
    from tests.conftest import tiny_gemma

    cfg = KVQuantConfig.preset("kvtuner-rot-3.5")
    model = tiny_gemma(3, seed=2)
    ids = torch.randint(3, 128, (4, 64), generator=torch.Generator().manual_seed(1))
    path = calibrate(model, ids, cfg, progress=False).save(tmp_path / "gemma3.json")
    quantize_kv_(model, dataclasses.replace(cfg, calibration=str(path)))
    with torch.no_grad():
        out = model.generate(ids[:1, :40], attention_mask=torch.ones_like(ids[:1, :40]), max_new_tokens=130, do_sample=False,
                             return_dict_in_generate=True)  # fmt: skip
    want = cfg.resolve(4)
    for layer, kv in zip(out.cache.layers, want):
        assert int(layer.body_end) > 0 and layer.k_body.spec == kv.key and layer.v_body.spec == kv.value
        assert layer.k_body.scale.dtype == layer.v_body.scale.dtype == torch.uint8  # 8-bit scale and zero
    assert len({(kv.key.bits, kv.value.bits) for kv in want}) > 1  # the depths take different pairs
