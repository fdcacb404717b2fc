"""`QuantizedKV`: one layer's keys (or values) as they sit in the quantized cache.

A wrapper tensor subclass (on torchao's `TorchAOBaseTensor`) whose logical value is the
[B, H, T, D] float tensor the model would have cached, and whose storage is

* `codes`, `scale`, `zero`: the packed body over the layer's T positions (see
  `kvq_ao.quant.uniform`; `bits == 0` means `codes` is plain float and scale/zero are empty);
* `side`, `side_pos`: full-precision entries (sink tokens, recent window) and their positions;
* `body_end` (0-dim int64 tensor) and `body_start` (int): body positions in
  [body_start, body_end) are read from the codes, every other valid position from `side`.

It is what the cache's `update()` returns; `kvq_ao.api`'s attention function hands its fields
to `torch.ops.kvq.attention` without materializing float K/V. Any other non-mutating op
dequantizes first (correct, slow). `copy_` is implemented (compiled in-place writes into a
subclass are silently lost otherwise); every other in-place op raises.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map_only

from kvq_ao import ops as _ops  # noqa: F401  (registers torch.ops.kvq)
from kvq_ao._torchao import TorchAOBaseTensor
from kvq_ao.quant.uniform import AXIS_CHANNEL

aten = torch.ops.aten


class QuantizedKV(TorchAOBaseTensor):
    tensor_data_names = ["codes", "scale", "zero", "side", "side_pos", "body_end"]
    tensor_attribute_names = ["bits", "axis", "group", "body_start", "logical_dtype"]

    def __new__(cls, codes, scale, zero, side, side_pos, body_end, bits, axis, group, body_start, logical_dtype):
        b, h, t = codes.shape[:3]
        shape = (b, h, t, side.shape[-1])
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=logical_dtype, device=codes.device)

    def __init__(self, codes, scale, zero, side, side_pos, body_end, bits, axis, group, body_start, logical_dtype):
        self.codes, self.scale, self.zero = codes, scale, zero
        self.side, self.side_pos, self.body_end = side, side_pos, body_end
        self.bits, self.axis, self.group = bits, axis, group
        self.body_start, self.logical_dtype = body_start, logical_dtype

    def __repr__(self) -> str:
        fmt = "float" if self.bits == 0 else f"{self.bits}-bit {'channel' if self.axis == AXIS_CHANNEL else 'token'} g{self.group}"
        return f"QuantizedKV(shape={tuple(self.shape)}, {fmt}, side={self.side.shape[2]})"

    def body(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dequantized body over all T positions (side entries not applied)."""
        dtype = dtype or self.logical_dtype
        return torch.ops.kvq.dequantize(self.codes, self.scale, self.zero, self.bits, self.axis, self.group, dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The logical [B, H, T, D] tensor: body where it is read, side entries elsewhere.

        Positions the cache holds nowhere (beyond its length) are zero.
        """
        out = self.body(dtype)
        positions = torch.arange(out.shape[2], device=out.device)
        in_body = (positions >= self.body_start) & (positions < self.body_end)
        out = out * in_body.view(1, 1, -1, 1).to(out.dtype)
        pos = self.side_pos
        use = (pos >= 0) & ((pos < self.body_start) | (pos >= self.body_end)) & (pos < out.shape[2])
        if bool(use.any()):
            out.index_copy_(2, pos[use], self.side[:, :, use].to(out.dtype))
        return out

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        table = cls._ATEN_OP_TABLE.get(cls, {})
        if func in table:
            return table[func](func, types, args, kwargs)
        if func._schema.is_mutable:
            raise RuntimeError(
                f"QuantizedKV does not support the in-place op {func}: the cache owns its storage "
                "(write through the cache's update(), or copy_ a whole QuantizedKV)"
            )
        args, kwargs = tree_map_only(QuantizedKV, lambda t: t.dequantize(), (args, kwargs))
        return func(*args, **kwargs)


@QuantizedKV.implements(aten.copy_.default)
def _copy(func, types, args, kwargs):
    dst, src = args[0], args[1]
    if isinstance(src, QuantizedKV):
        if src.shape != dst.shape or src.__tensor_flatten__()[1] != dst.__tensor_flatten__()[1]:
            raise ValueError(f"copy_ between QuantizedKV of different formats: {dst!r} <- {src!r}")
        for name in QuantizedKV.tensor_data_names:
            getattr(dst, name).copy_(getattr(src, name))
        return dst
    if src.shape != dst.shape:
        raise ValueError(f"copy_ into QuantizedKV of shape {tuple(dst.shape)} from shape {tuple(src.shape)}")
    if dst.body_start:
        raise ValueError("copy_ of a float tensor into a QuantizedKV with sink tokens is not supported")
    if dst.bits == 0:
        dst.codes.copy_(src)
    else:
        codes, scale, zero = torch.ops.kvq.quantize(src, dst.bits, dst.axis, dst.group, dst.scale.dtype)
        dst.codes.copy_(codes)
        dst.scale.copy_(scale)
        dst.zero.copy_(zero)
    dst.side_pos.fill_(-1)
    dst.body_end.fill_(dst.shape[2])
    return dst


torch.serialization.add_safe_globals([QuantizedKV])
