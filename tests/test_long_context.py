"""Long contexts: a cache that grows without quadratic copying, room reserved by generate(),
chunked prefill through the quantized cache, and bounds masks inside whole models."""

import dataclasses

import pytest
import torch

import kvq_ao.api as api
import kvq_ao.masks as masks
from conftest import tiny_gemma
from kvq_ao import KVQuantConfig, make_cache, quantize_kv_
from kvq_ao.cache import QuantizedLayer, _BodyStore


def test_a_dynamic_cache_grows_geometrically_not_by_fixed_steps():
    spec = KVQuantConfig.preset("kivi-2").resolve(1)[0]
    layer = QuantizedLayer(spec, residual_length=8)
    g = torch.Generator().manual_seed(0)
    capacities, length = [], 0
    for n in [1] * 300 + [97] * 40:  # one token at a time, then chunks
        k, v = torch.randn(1, 2, n, 64, generator=g), torch.randn(1, 2, n, 64, generator=g)
        layer.update(k, v)
        length += n
        if not capacities or capacities[-1] != layer.capacity:
            capacities.append(layer.capacity)
        assert length <= layer.capacity <= max(1.5 * length + 256, 512)
    # 4180 tokens: growth by 1.5x from 256 takes ~7 growths (fixed 256-token steps would take 16)
    assert len(capacities) <= 8, capacities
    assert all(b >= 1.5 * a for a, b in zip(capacities, capacities[1:]) if b != capacities[-1])


def test_reserve_is_validated_and_preallocates():
    spec = KVQuantConfig.preset("kivi-2").resolve(1)[0]
    with pytest.raises(ValueError, match="reserve must be >= 0"):
        QuantizedLayer(spec, reserve=-1)
    layer = QuantizedLayer(spec, reserve=5000)
    layer.update(torch.randn(1, 2, 3, 64), torch.randn(1, 2, 3, 64))
    assert layer.capacity >= 5000 and layer.k_body.codes.shape[2] == layer.capacity


def test_generate_reserves_prompt_plus_new_tokens_so_the_cache_never_grows(tiny_model, monkeypatch):
    quantize_kv_(tiny_model, KVQuantConfig.preset("kivi-2"))
    grows = []
    real_grow = _BodyStore.grow
    monkeypatch.setattr(_BodyStore, "grow", lambda self, c: grows.append(c) or real_grow(self, c))
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        tiny_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=120, do_sample=False)
    assert len(grows) == 2 * 2 and min(grows) >= 320  # k and v of 2 layers, each allocated once for 320 tokens
    grows.clear()
    with torch.no_grad():  # the same with a cache built without a reserve: it grows on the way
        tiny_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=120, do_sample=False,
                            cache=make_cache(tiny_model))  # fmt: skip
    assert len(grows) > 2 * 2


def _chunk_calls(monkeypatch) -> list:
    calls = []
    real = torch.ops.kvq.chunk_attention
    monkeypatch.setattr(torch.ops.kvq, "chunk_attention", lambda **a: calls.append((a["q"].shape[2], a["mask"].dtype)) or real(**a))
    return calls


def test_generate_prefills_a_long_prompt_in_chunks_with_bounds_masks(tiny_model, monkeypatch):
    # a window that holds the whole prompt: chunked and unchunked prefill see the same keys and values
    quantize_kv_(tiny_model, dataclasses.replace(KVQuantConfig.preset("kivi-4"), residual_length=256))
    ids = torch.randint(3, 128, (1, 100), generator=torch.Generator().manual_seed(1))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, output_logits=True,
              return_dict_in_generate=True)  # fmt: skip
    calls = _chunk_calls(monkeypatch)
    with torch.no_grad():
        whole = tiny_model.generate(ids, **kw)  # 100 tokens < PREFILL_CHUNK: one chunk
        assert calls == [(100, torch.int64)] * 2
        calls.clear()
        chunked = tiny_model.generate(ids, prefill_chunk_size=32, **kw)
        assert calls == [(32, torch.int64)] * 6 + [(4, torch.int64)] * 2  # 32 + 32 + 32 + 4, 2 layers
        calls.clear()
        monkeypatch.setattr(api, "PREFILL_CHUNK", 48)  # the default applies when the caller sets none
        by_default = tiny_model.generate(ids, **kw)
        assert [n for n, _ in calls] == [48] * 4 + [4] * 2
    assert torch.equal(chunked.sequences, whole.sequences) and torch.equal(by_default.sequences, whole.sequences)
    for a, b in zip(chunked.logits, whole.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_chunked_prefill_through_quantized_codes_stays_close_to_unchunked(tiny_model):
    quantize_kv_(tiny_model, dataclasses.replace(KVQuantConfig.preset("kivi-4"), residual_length=16, sink_tokens=1))
    ids = torch.randint(3, 128, (1, 160), generator=torch.Generator().manual_seed(2))
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, output_logits=True,
              return_dict_in_generate=True)  # fmt: skip
    with torch.no_grad():
        whole = tiny_model.generate(ids, prefill_chunk_size=1000, **kw).logits[0]
        chunked = tiny_model.generate(ids, prefill_chunk_size=40, **kw).logits[0]
    # chunks read some keys at full precision that one pass reads quantized: close, not equal
    assert (chunked - whole).abs().max() < 0.1 * whole.abs().max()
    assert not torch.equal(chunked, whole)


@pytest.mark.parametrize("left_pad", [0, 5])
def test_bounds_masks_equal_dense_masks_in_a_sliding_window_model(monkeypatch, left_pad):
    """Gemma-3 (sliding and global layers, window 16) on a left-padded batch: the model's logits with
    the kvq mask as bounds equal those with transformers' dense masks."""
    model = tiny_gemma(3)
    quantize_kv_(model, dataclasses.replace(KVQuantConfig.preset("kivi-4"), residual_length=8))
    ids = torch.randint(3, 128, (2, 60), generator=torch.Generator().manual_seed(3))
    attn = torch.ones_like(ids)
    attn[1, :left_pad] = 0
    calls = _chunk_calls(monkeypatch)

    def logits():
        with torch.no_grad():
            return model(ids, attention_mask=attn, cache=make_cache(model)).logits

    bounded = logits()
    assert {dtype for _, dtype in calls} == {torch.int64}
    calls.clear()
    monkeypatch.setattr(api, "interval_bounds", lambda *a, **k: None)
    dense = logits()
    assert {dtype for _, dtype in calls} == {torch.bool}
    torch.testing.assert_close(bounded[1, left_pad:], dense[1, left_pad:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(bounded[0], dense[0], rtol=1e-5, atol=1e-5)
    assert masks.is_bounds(torch.zeros(1, 1, 2, 2, dtype=torch.int64))
