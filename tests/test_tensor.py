"""QuantizedKV: flatten/unflatten, copy_, mutation guard, dequantizing fallback."""

import pytest
import torch

from kvq_ao.api import make_cache, quantize_kv_
from kvq_ao.config import KVQuantConfig, LayerKV, QuantSpec
from kvq_ao.tensor import QuantizedKV

CFG = KVQuantConfig(default=LayerKV(QuantSpec(4, "channel", 16), QuantSpec(2, "token", 32)), sink_tokens=1,
                    residual_length=8, name="t")  # fmt: skip


def _filled_layer(model, tokens=70):
    quantize_kv_(model, CFG)
    cache = make_cache(model)
    with torch.no_grad():
        model(torch.randint(0, 128, (1, tokens)), cache=cache)
    return cache.layers[0]


def test_flatten_unflatten_round_trip(tiny_model):
    keys, _ = _filled_layer(tiny_model).keys_values()
    names, attrs = keys.__tensor_flatten__()
    again = QuantizedKV.__tensor_unflatten__({n: getattr(keys, n) for n in names}, attrs, keys.shape, keys.stride())
    assert again.shape == keys.shape and torch.equal(again.dequantize(), keys.dequantize())


def test_dequantize_uses_side_entries_outside_the_body(tiny_model):
    layer = _filled_layer(tiny_model)
    keys, _ = layer.keys_values()
    full = keys.dequantize()
    end = int(layer.body_end)
    assert end == 48  # 70 tokens, window 8, blocks of 16 -> 48 quantized
    slot_of = {int(p): i for i, p in enumerate(layer.side_pos) if p >= 0}
    torch.testing.assert_close(full[:, :, 0], layer.side_k[:, :, slot_of[0]])  # sink, exact
    torch.testing.assert_close(full[:, :, 69], layer.side_k[:, :, slot_of[69]])  # window, exact
    assert not torch.equal(full[:, :, 10], torch.zeros_like(full[:, :, 10]))


def test_unhandled_ops_dequantize_and_mutating_ops_raise(tiny_model):
    keys, _ = _filled_layer(tiny_model).keys_values()
    torch.testing.assert_close(keys * 2, keys.dequantize() * 2)
    assert (keys.sum() - keys.dequantize().sum()).abs() < 1e-3
    with pytest.raises(RuntimeError, match="does not support the in-place op"):
        keys.add_(1)
    with pytest.raises(RuntimeError, match="does not support the in-place op"):
        keys.zero_()


def test_copy_between_quantized_tensors_and_from_float(tiny_model):
    keys, _ = _filled_layer(tiny_model).keys_values()
    clone = keys.clone()
    other, _ = _filled_layer(tiny_model, tokens=70).keys_values()
    other.copy_(clone)
    assert torch.equal(other.dequantize(), keys.dequantize())
    fields = {n: getattr(keys, n) for n in QuantizedKV.tensor_data_names + QuantizedKV.tensor_attribute_names}
    fields.update({n: fields[n].clone() for n in ("codes", "scale", "zero", "side", "side_pos", "body_end")})
    plain = QuantizedKV(**dict(fields, body_start=0))
    x = torch.randn(plain.shape)
    plain.copy_(x)
    step = (x.amax(2) - x.amin(2)).max() / 15  # 4-bit per-channel groups of 16 over the whole range
    assert (plain.dequantize() - x).abs().max() <= step
