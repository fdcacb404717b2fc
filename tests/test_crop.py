"""`crop()` on the quantized layers: a crop leaves a layer exactly as if the dropped tokens had
never been appended, so assisted decoding (which appends a draft, then crops what the model
rejected) computes what plain decoding computes.

Layer under test: sink 1, an 8-token full-precision window, per-channel keys in 16-token blocks,
so at 100 tokens the body holds [0, 80) (the sink stood in) and the side store's ring positions
[76, 100). The boundaries crossed: inside the window (the body keeps its end), the block edge
(the last length with the same body end, and one token past it), into the packed body (blocks
that must return to full precision), and past what the layer can restore.
"""

import pytest
import torch

from conftest import kvquant_config, tiny_llama
from kvq_ao import KVQuantConfig, LayerKV, QuantSpec, make_cache, quantize_kv_
from kvq_ao.cache import QuantizedLayer, QuantizedStaticLayer
from kvq_ao.tensor import attention

SINK, WINDOW, BLOCK, HEADS, DIM = 1, 8, 16, 2, 64
FORMATS = {
    "kivi-4": LayerKV(QuantSpec(4, "channel", BLOCK), QuantSpec(4, "token", 32)),
    "int2": LayerKV(QuantSpec(2, "channel", BLOCK), QuantSpec(2, "token", 16)),
}


def _layer(fmt: str, static: bool) -> QuantizedLayer:
    kw = dict(sink_tokens=SINK, residual_length=WINDOW)
    return QuantizedStaticLayer(FORMATS[fmt], max_cache_len=160, **kw) if static else QuantizedLayer(FORMATS[fmt], **kw)


def _tokens(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(1, HEADS, n, DIM, generator=g), torch.randn(1, HEADS, n, DIM, generator=g)


def _append(layer: QuantizedLayer, k: torch.Tensor, v: torch.Tensor, chunks=(1,)) -> None:
    """Append in chunks of the given sizes, cycling (1: token by token, as decoding does)."""
    i, c = 0, 0
    while i < k.shape[2]:
        n = chunks[c % len(chunks)]
        layer.update(k[:, :, i : i + n], v[:, :, i : i + n])
        i, c = i + n, c + 1


def _attend(layer: QuantizedLayer, seed: int = 1) -> torch.Tensor:
    """One decode query over the layer as it is (mask: the positions it holds)."""
    keys, values = layer.keys_values()
    q = torch.randn(1, HEADS * 3, 1, DIM, generator=torch.Generator().manual_seed(seed))
    mask = (torch.arange(keys.shape[2]) < int(layer.cumulative_length)).view(1, 1, 1, -1)
    return attention(q, keys, values, mask, DIM**-0.5)


def _state(layer: QuantizedLayer) -> dict:
    """Everything a layer's attention reads, for positions it holds."""
    n = int(layer.cumulative_length)
    return {"keys": layer.keys[:, :, :n], "values": layer.values[:, :, :n], "body_end": layer.body_end.clone(), "length": n}


def _boundary(length: int) -> int:
    return max(length - WINDOW, 0) // BLOCK * BLOCK


# (target length, record from) for a layer of 100 tokens: None = no record
RESTORABLE = {
    "inside the window": (95, None),
    "at the block edge": (88, None),  # the shortest length whose body end is still 80
    "one past the block edge": (87, 90 - 10),  # body end 64: positions [64, 80) return to full precision
    "into the body": (41, 30),  # body end 32: three packed blocks return to full precision
    "to empty": (0, 0),
}


@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("case", list(RESTORABLE))
def test_crop_restores_the_layer_a_shorter_sequence_builds(case, fmt, static):
    target, record_from = RESTORABLE[case]
    k, v = _tokens(100)
    layer = _layer(fmt, static)
    if record_from is None:
        _append(layer, k, v, chunks=(7, 1, 3))
    else:
        _append(layer, k[:, :, :record_from], v[:, :, :record_from], chunks=(7, 1, 3))
        layer.activate_past_recording()
        _append(layer, k[:, :, record_from:], v[:, :, record_from:], chunks=(5, 1))
    before, out_before = _state(layer), _attend(layer)

    layer.crop(target - 100)

    fresh = _layer(fmt, static)
    _append(fresh, k[:, :, :target], v[:, :, :target])
    after = _state(layer)
    assert after["length"] == target and int(after["body_end"]) == _boundary(target)
    if target:
        assert torch.equal(after["keys"], _state(fresh)["keys"]) and torch.equal(after["values"], _state(fresh)["values"])
        # each kept position reads back as before the crop, except those whose block was packed only
        # because of the dropped tokens: they are back in full precision, i.e. the input itself
        back = ((torch.arange(target) >= _boundary(target)) & (torch.arange(target) < _boundary(100))).view(1, 1, -1, 1)
        assert torch.equal(after["keys"], torch.where(back, k[:, :, :target], before["keys"][:, :, :target]))
        assert torch.equal(after["values"], torch.where(back, v[:, :, :target], before["values"][:, :, :target]))
        if not back.any():
            assert torch.equal(after["keys"], before["keys"][:, :, :target])
    if static:  # like transformers' StaticLayer: every position past the length reads as zero
        assert not layer.keys[:, :, target:].any() and not layer.values[:, :, target:].any()

    _append(layer, k[:, :, target:], v[:, :, target:], chunks=(2, 1))  # the dropped tokens again
    again = _state(layer)
    assert torch.equal(again["keys"], before["keys"]) and torch.equal(again["values"], before["values"])
    assert torch.equal(_attend(layer), out_before)  # bit-exact: the same storage as before the crop


def test_crop_that_cannot_be_restored_raises_and_changes_nothing():
    k, v = _tokens(100)
    layer = _layer("kivi-4", static=False)
    _append(layer, k, v, chunks=(9,))
    before = _state(layer)
    with pytest.raises(ValueError, match=r"cannot crop the layer back to 87 of its 100 tokens: positions \[64, 87\).*"
                                         r"activate_past_recording"):  # fmt: skip
        layer.crop(-13)  # [64, 80) are packed and the ring no longer holds them
    assert torch.equal(_state(layer)["keys"], before["keys"]) and _state(layer)["length"] == 100

    layer.activate_past_recording()
    _append(layer, *_tokens(6, seed=3))
    with pytest.raises(ValueError, match="the record since the last crop starts at 100 tokens"):
        layer.crop(-30)  # below where the record starts, and not in the side store
    with pytest.raises(ValueError, match="cannot crop 200 tokens from a layer that holds 106"):
        layer.crop(-200)
    with pytest.raises(ValueError, match="pass a negative count"):
        layer.crop(5)
    layer.crop(-6)  # the record still serves a crop within it
    assert torch.equal(_state(layer)["keys"], before["keys"])


def test_crop_zero_ends_the_record():
    """transformers calls crop(0) after a step it keeps: later crops cannot reach behind it."""
    k, v = _tokens(100)
    layer = _layer("kivi-4", static=False)
    layer.activate_past_recording()
    _append(layer, k[:, :, :90], v[:, :, :90], chunks=(30,))
    layer.crop(0)
    _append(layer, k[:, :, 90:], v[:, :, 90:], chunks=(10,))
    with pytest.raises(ValueError, match="starts at 90 tokens"):
        layer.crop(-20)
    layer.record_past = False  # what transformers does when it hands the cache back: the record goes
    assert layer._checkpoint is None and layer._pending == []


@pytest.mark.parametrize("kind", ["kvquant", "static-kivi"])
def test_model_cache_crop_then_decode_equals_never_having_seen_the_tokens(kind):
    """Through a model: pre-RoPE keys with outliers and a sink (calibrated KVQuant format), and a
    static cache; a draft of 9 tokens appended, 6 rejected, then decoding on. (Token by token, as
    a draft model's cache takes its draft: a chunk's K/V come out of the model's matmuls with other
    rounding than one token's, in any cache; the chunk path is the layer tests' and generate's.)"""
    model = tiny_llama(seed=2)
    cfg = kvquant_config(bits=3, outliers=0.02, model=model) if kind == "kvquant" else KVQuantConfig.preset("kivi-4")
    quantize_kv_(model, _window(cfg, 4))
    ids = torch.randint(3, 128, (1, 60), generator=torch.Generator().manual_seed(5))
    static = 80 if kind == "static-kivi" else None

    def run(crop: bool) -> torch.Tensor:
        cache = make_cache(model, max_cache_len=static)
        cache.activate_past_recording()
        with torch.no_grad():
            model(ids[:, :40], cache=cache)
            cache.crop(0)
            for t in range(40, 49 if crop else 43):  # a draft of 9, as the draft model's own cache takes it
                model(ids[:, t : t + 1], cache=cache)
            if crop:
                cache.crop(-6)  # three accepted
            out = [model(ids[:, t : t + 1], cache=cache).logits for t in range(43, 60)]
        return torch.cat(out, 1)

    assert torch.equal(run(crop=True), run(crop=False))


def _window(cfg: KVQuantConfig, residual: int) -> KVQuantConfig:
    import dataclasses

    return dataclasses.replace(cfg, residual_length=residual, name=f"{cfg.name}-w{residual}")


def test_context_parallel_layer_crops_the_same_way():
    """A context-parallel cache (one process here: world size 1) replays through its segmented body."""
    from kvq_ao.parallel import make_context_parallel_cache

    model = tiny_llama(seed=2)
    quantize_kv_(model, _window(KVQuantConfig.preset("kivi-4"), 4))
    ids = torch.randint(3, 128, (1, 70), generator=torch.Generator().manual_seed(6))

    def run(crop: bool) -> torch.Tensor:
        cache = make_context_parallel_cache(model, segment=32)
        cache.activate_past_recording()
        with torch.no_grad():
            model(ids[:, :30], cache=cache)
            cache.crop(0)
            for t in range(30, 45 if crop else 36):
                model(ids[:, t : t + 1], cache=cache)
            if crop:
                cache.crop(-9)
            return torch.cat([model(ids[:, t : t + 1], cache=cache).logits for t in range(36, 70)], 1)

    assert torch.equal(run(crop=True), run(crop=False))
    cache = make_context_parallel_cache(model, segment=32)
    with torch.no_grad():
        model(ids[:, :10], cache=cache)
    with pytest.raises(NotImplementedError, match="live on several ranks"):
        cache.layers[0].keys
