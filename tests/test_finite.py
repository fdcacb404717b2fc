"""NaN and Inf: refused with an error naming layer, kind, position, batch row, head and channel when
they would be quantized, on every backend that quantizes (the reference ops, the native CPU
one-token key append, the Triton kernels in Triton's interpreter), on the eager and the static
append (compiled code is not checked: kvq_ao/finite.py says why); held exactly, as an fp cache holds them, while in the window or sink."""

import dataclasses
import re

import pytest
import torch

from conftest import kvquant_config, tiny_llama
from kvq_ao import KVQuantConfig, LayerKV, QuantSpec, make_cache, quantize_kv_
from kvq_ao.cache import QuantizedKVCache
from kvq_ao import NonFiniteKVError
from kvq_ao.kernels import gpu as gpu_kernels
from kvq_ao.kernels import cpu as native_cpu

WINDOW = 8


def _kv(layers: int, n: int, seed: int, d: int = 64) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, 2, n, d, generator=g), torch.randn(1, 2, n, d, generator=g)) for _ in range(layers)]


def _append(cache, kv, one_by_one: bool) -> None:
    n = kv[0][0].shape[2]
    steps = [(t, t + 1) for t in range(n)] if one_by_one else [(0, n)]
    for a, b in steps:
        for layer, (k, v) in zip(cache.layers, kv):
            layer.update(k[:, :, a:b], v[:, :, a:b])


def _kivi(bits: int = 4, window: int = WINDOW, sink: int = 0) -> KVQuantConfig:
    return dataclasses.replace(KVQuantConfig.preset(f"kivi-{bits}"), residual_length=window, sink_tokens=sink,
                               name=f"kivi-{bits}-w{window}-s{sink}")  # fmt: skip


@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("one_by_one", [False, True])
@pytest.mark.parametrize("kind, bad", [("key", float("nan")), ("value", float("inf")), ("key", float("-inf"))])
def test_reference_quantize_refuses_non_finite_naming_where(kind, bad, one_by_one, static):
    cache = QuantizedKVCache(_kivi(), 3, max_cache_len=128 if static else None)
    kv = _kv(3, 96, seed=1)
    kv[2][0 if kind == "key" else 1][0, 1, 37, 5] = bad
    with pytest.raises(NonFiniteKVError) as err:
        _append(cache, kv, one_by_one)
    msg = str(err.value)
    assert f"{kind} with {bad}" in msg and "position 37 " in msg and "layer 2," in msg and "head 1," in msg and "stored channel 5)" in msg


def test_the_native_cpu_key_append_refuses_non_finite():
    """Calibrated key ranges: the one-token key append is the native kernel (kvq.quantize_fixed on
    CPU), whose clamp would otherwise turn a NaN into a code."""
    if not native_cpu.load():
        pytest.fail("the native CPU kernels did not build here")  # the native path is what this test is about
    model = tiny_llama(layers=2)
    cfg = kvquant_config(bits=3, outliers=0.0, key_ranges="calibrated", model=model)
    cfg = dataclasses.replace(cfg, residual_length=0)
    quantize_kv_(model, cfg)
    cache = make_cache(model, cfg)
    assert cache.layers[0].spec.key.calibrated_ranges
    kv = _kv(2, 40, seed=2)
    kv[1][0][0, 0, 20, 63] = float("nan")
    # pre-RoPE keys: undoing RoPE mixes channel 63 with its rotary partner 31
    with pytest.raises(NonFiniteKVError, match=r"key with nan at position 20 \(layer 1, batch row 0, head 0, stored channel (31|63)\)"):
        _append(cache, kv, one_by_one=True)


def test_the_triton_kernels_refuse_non_finite_in_the_interpreter():
    cfg = _kivi(bits=2)
    kv = _kv(2, 96, seed=3)
    kv[0][1][0, 0, 33, 0] = float("nan")
    with gpu_kernels.on_cpu():
        x = kv[0][1][:, :, :32]
        assert gpu_kernels.quantize_op(x, 0, 32, torch.float16) is torch.ops.kvq.triton_quantize  # the Triton kernel serves
        cache = QuantizedKVCache(cfg, 2)
        with pytest.raises(NonFiniteKVError, match=r"value with nan at position 33 \(layer 0, batch row 0, head 0, stored channel 0\)"):
            _append(cache, kv, one_by_one=True)


def test_non_finite_in_window_and_sink_is_held_exactly_as_an_fp_cache_holds_it():
    """Not yet quantized (the window) or never quantized (the sink, per-token formats too): no
    error, and the stored entry reads back as given."""
    cfg = dataclasses.replace(KVQuantConfig(default=LayerKV(QuantSpec(4, "token", 32), QuantSpec(4, "token", 32))),
                              sink_tokens=2, residual_length=WINDOW, name="int4-token-s2-w8")  # fmt: skip
    cache = QuantizedKVCache(cfg, 1)
    kv = _kv(1, 40, seed=5)
    kv[0][0][0, 0, 1, 0] = float("nan")  # a sink token
    kv[0][1][0, 1, 38, 7] = float("inf")  # in the window at length 40
    _append(cache, kv, one_by_one=True)
    k, v = cache.layers[0].keys, cache.layers[0].values
    assert torch.isnan(k[0, 0, 1, 0]) and torch.isinf(v[0, 1, 38, 7])
    assert torch.isfinite(k[:, :, 2:]).all() and int(torch.isinf(v).sum()) == 1


def test_finite_entries_near_float32_max_are_not_refused():
    """The check sums each block; a sum that overflows on finite entries is not an error."""
    cache = QuantizedKVCache(KVQuantConfig(default=LayerKV(QuantSpec(8, "token", 32), QuantSpec(8, "token", 32)),
                                           name="int8-token"), 1)  # fmt: skip
    k = torch.full((1, 2, 32, 64), 3e38)
    cache.layers[0].update(k, -k)
    assert cache.get_seq_length() == 32


def test_fp_layers_are_not_checked():
    """A layer kept in full precision stores NaN as the fp cache does (KVTuner's "none" layers)."""
    fp_values = KVQuantConfig(default=LayerKV(QuantSpec(4, "channel", 32), QuantSpec(None)), name="k4-vfp")
    cache = QuantizedKVCache(fp_values, 1)
    kv = _kv(1, 64, seed=6)
    kv[0][1][0, 0, 3, 3] = float("nan")
    _append(cache, kv, one_by_one=False)
    assert re.search("nan", repr(cache.layers[0].values[0, 0, 3, 3].item()))


def test_on_cpu_the_native_writers_check_and_the_append_runs_no_check_of_its_own(monkeypatch):
    """With the native CPU kernels both writers refuse NaN/Inf in their own pass, so a clean eager
    append calls no Python check; a bad entry still ends in the named error, before anything of the
    block is written (keys and values are both encoded first), and a bad sink row is still no error."""
    import kvq_ao.cache as cache_module

    if not native_cpu.load():
        pytest.fail("the native CPU kernels did not build here")  # the native path is what this test is about
    calls = []
    checked = cache_module.refuse_non_finite
    monkeypatch.setattr(cache_module, "refuse_non_finite", lambda *a: (calls.append(a), checked(*a)))
    int4_token = KVQuantConfig(default=LayerKV(QuantSpec(4, "token", 32), QuantSpec(4, "token", 32)), name="int4-token")
    for cfg, static in ((int4_token, False), (int4_token, True), (_kivi(), False), (_kivi(), True)):
        cache = QuantizedKVCache(cfg, 2, max_cache_len=128 if static else None)
        kv = _kv(2, 100, seed=7)
        _append(cache, [(k[:, :, :60], v[:, :, :60]) for k, v in kv], one_by_one=True)
        assert calls == [], cfg.name
        kv[1][1][0, 1, 60, 9] = float("nan")
        before = [int(layer.get_seq_length()) for layer in cache.layers]
        with pytest.raises(NonFiniteKVError, match=r"value with nan at position 60 \(layer 1, batch row 0, head 1, stored channel 9\)"):
            for t in range(60, 100):  # kivi: the token is refused when its block leaves the window
                for layer, (k, v) in zip(cache.layers, kv):
                    layer.update(k[:, :, t : t + 1], v[:, :, t : t + 1])
        assert len(calls) == 1, cfg.name  # only to name the entry the kernel refused
        failed = 1  # the refused append was layer 1's; its length did not move
        assert int(cache.layers[failed].get_seq_length()) == before[failed] + (t - 60), cfg.name
        calls.clear()
    sink = dataclasses.replace(int4_token, sink_tokens=1, residual_length=0, name="int4-token-s1")
    cache = QuantizedKVCache(sink, 1)
    kv = _kv(1, 40, seed=8)
    kv[0][0][0, 0, 0, 0] = float("nan")  # the sink: coded by the per-token format, read from the side store
    _append(cache, kv, one_by_one=True)
    assert torch.isnan(cache.layers[0].keys[0, 0, 0, 0]) and torch.isfinite(cache.layers[0].keys[:, :, 1:]).all()


def test_a_context_parallel_layer_refuses_non_finite_too():
    """Its bodies code only their own segments, so the whole block is checked in Python before either is written."""
    from kvq_ao.parallel import make_context_parallel_cache

    model = tiny_llama(layers=2)
    quantize_kv_(model, _kivi(window=4))
    cache = make_context_parallel_cache(model, segment=32)
    kv = _kv(2, 80, seed=9, d=model.config.head_dim)
    kv[0][0][0, 1, 40, 3] = float("nan")
    with pytest.raises(NonFiniteKVError, match=r"key with nan at position 40 \(layer 0, batch row 0, head 1, stored channel 3\)"):
        _append(cache, kv, one_by_one=True)
