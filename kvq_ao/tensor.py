"""`QuantizedKV`: one layer's keys (or values) as they sit in the quantized cache.

A wrapper tensor subclass (on torchao's `TorchAOBaseTensor`) whose logical value is the
[B, H, T, D] float tensor the model would have cached, and whose storage is

* `codes`, `scale`, `zero`: the packed body over the layer's T positions (see
  `kvq_ao.format`; a float format means `codes` is plain float and scale/zero are empty);
  `codebook` (empty: uniform levels), `out_val`/`out_idx` (exact outliers, k per vector);
* `rope_inv_freq` (empty unless keys are stored before RoPE) and `rope_scale`: the rotation
  applied to each key at its own position when it is read;
* `rotation` ([D, D], empty unless the format is rotated, `kvq_ao.quant.rotation`): every stored
  vector, body and side, is x R; attention rotates the query by the keys' R and rotates its output
  back by the values' R^T, and `dequantize()` gives the unrotated vectors;
* `side`, `side_pos`: full-precision entries (sink tokens, recent window) and their positions;
* `body_end` (0-dim int64 tensor, or [q_len] in the view a chunk of queries attends: one per query)
  and `body_start` (int): body positions in [body_start, body_end) are read from the codes, every
  other valid position from `side`.

It is what the cache's `update()` returns; `attention(query, key, value, ...)` below hands the
fields of a key and a value `QuantizedKV` to `torch.ops.kvq.decode_attention` (one query token)
or `kvq.chunk_attention` by name, without materializing float K/V. Any other non-mutating op
dequantizes first (correct, slow). `copy_` is implemented (compiled in-place writes into a
subclass are silently lost otherwise); every other in-place op raises.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map_only

from kvq_ao._torchao import TorchAOBaseTensor
from kvq_ao.format import AXIS_CHANNEL, FLOAT_META, FLOAT_QUERY, OPERAND_INTS, OPERAND_TENSORS, Operand, is_float, is_int_query
from kvq_ao.kernels import gpu as gpu_kernels
from kvq_ao.ops import attention_arguments as op_arguments
from kvq_ao.quant import rotation

aten = torch.ops.aten


class QuantizedKV(TorchAOBaseTensor):
    # The operand's fields come from their one definition (kvq_ao.format); torchao's flatten and
    # unflatten pass the tensors, then the attributes, positionally in these orders.
    tensor_data_names = [*OPERAND_TENSORS, "side_pos", "body_end", "rope_inv_freq", "rotation"]
    tensor_attribute_names = [*OPERAND_INTS, "body_start", "logical_dtype", "rope_scale"]
    _DEFAULTS = {"rope_scale": 1.0, "query_bits": FLOAT_QUERY, "meta": FLOAT_META}

    @classmethod
    def _fields(cls, args: tuple, kwargs: dict) -> dict:
        names = cls.tensor_data_names + cls.tensor_attribute_names
        if len(args) > len(names):
            raise TypeError(f"QuantizedKV takes at most {len(names)} fields, got {len(args)}")
        fields = {**cls._DEFAULTS, **dict(zip(names, args)), **kwargs}
        missing = [n for n in names if n not in fields]
        if missing or len(fields) != len(names):
            raise TypeError(f"QuantizedKV needs the fields {names}; missing {missing}, unexpected {sorted(set(fields) - set(names))}")
        return fields

    def __new__(cls, *args, **kwargs):
        f = cls._fields(args, kwargs)
        b, h, t = f["codes"].shape[:3]
        shape = (b, h, t, f["side"].shape[-1])
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=f["logical_dtype"], device=f["codes"].device)

    def __init__(self, *args, **kwargs):
        for name, value in self._fields(args, kwargs).items():
            setattr(self, name, value)

    @property
    def pre_rope(self) -> bool:
        return self.rope_inv_freq.numel() > 0

    @property
    def rotated(self) -> bool:
        return self.rotation.numel() > 0

    def __repr__(self) -> str:
        fmt = "float" if is_float(self.bits) else f"{self.bits}-bit {'channel' if self.axis == AXIS_CHANNEL else 'token'} g{self.group}"
        if self.codebook.numel():
            fmt += " codebook"
        if self.out_val.shape[-1]:
            fmt += f" +{self.out_val.shape[-1]} outliers/vector"
        if self.pre_rope:
            fmt += " pre-RoPE"
        if is_int_query(self.query_bits):
            fmt += f" int{self.query_bits}-query scores"
        if self.rotated:
            fmt += " rotated"
        if self.meta != FLOAT_META:
            fmt += " 8-bit scale/zero"
        return f"QuantizedKV(shape={tuple(self.shape)}, {fmt}, side={self.side.shape[2]})"

    def body(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dequantized body over all T positions as stored (side entries not applied, pre-RoPE keys not rotated)."""
        dtype = dtype or self.logical_dtype
        return torch.ops.kvq.dequantize(*operand(self).lists(), dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The logical [B, H, T, D] tensor (post-RoPE keys, unrotated): body where it is read, side
        entries elsewhere.

        Positions the cache holds nowhere (beyond its length) are zero.
        """
        out = self.body(dtype)
        if self.pre_rope:
            out = self._rotate(out, torch.arange(out.shape[2], device=out.device))
        positions = torch.arange(out.shape[2], device=out.device)
        end = self.body_end.max()  # per-query body ends (a chunk's view): as the last query reads it
        in_body = (positions >= self.body_start) & (positions < end)
        out = out * in_body.view(1, 1, -1, 1).to(out.dtype)
        pos = self.side_pos
        use = (pos >= 0) & ((pos < self.body_start) | (pos >= end)) & (pos < out.shape[2])
        if bool(use.any()):
            side = self.side[:, :, use].to(out.dtype)
            if self.pre_rope:
                side = self._rotate(side, pos[use])
            out.index_copy_(2, pos[use], side)
        if self.rotated:
            out = rotation.unrotate(out, self.rotation)
        return out

    def _rotate(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        from kvq_ao.quant.rope import rotate

        return rotate(x.float(), positions, self.rope_inv_freq, self.rope_scale).to(x.dtype)

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
    if dst.rotated:
        src = rotation.rotate(src, dst.rotation)
    if dst.body_start or dst.pre_rope or dst.out_val.shape[-1]:
        raise ValueError("copy_ of a float tensor is only supported into a QuantizedKV without sink tokens, "
                         "outliers or pre-RoPE keys (write through the cache's update() instead)")  # fmt: skip
    if is_float(dst.bits):
        dst.codes.copy_(src)
    else:
        empty = src.new_zeros(0)
        op = gpu_kernels.quantize_op(src, dst.axis, dst.group, dst.scale.dtype)
        codes, scale, zero, *_ = op(src, operand(dst).lists()[1], dst.scale.dtype, dst.codebook, empty, empty, 0)
        dst.codes.copy_(codes)
        dst.scale.copy_(scale)
        dst.zero.copy_(zero)
    dst.side_pos.fill_(-1)
    dst.body_end.fill_(dst.shape[2])
    return dst


torch.serialization.add_safe_globals([QuantizedKV])


def _present(t: torch.Tensor) -> torch.Tensor | None:
    return t if t.numel() > 0 else None


def operand(x: QuantizedKV) -> Operand:
    """One of K or V as the attention ops take it; fields the format does not use are None (a float
    body has no scale, uniform levels no codebook, ...)."""
    has_outliers = x.out_val.shape[-1] > 0
    return Operand(**{name: getattr(x, name) for name in OPERAND_TENSORS + OPERAND_INTS}).replace(
        scale=_present(x.scale), zero=_present(x.zero), codebook=_present(x.codebook),
        out_val=x.out_val if has_outliers else None, out_idx=x.out_idx if has_outliers else None,
    )  # fmt: skip


def attention_arguments(query: torch.Tensor, key: QuantizedKV, value: QuantizedKV, mask: torch.Tensor,
                        scaling: float, softcap: float = 0.0) -> dict:  # fmt: skip
    """The named arguments of the attention ops for `query` over a layer's quantized keys and values."""
    return op_arguments(
        query, operand(key), operand(value), side_pos=key.side_pos, body_end=key.body_end, mask=mask,
        rope_inv_freq=_present(key.rope_inv_freq), body_start=key.body_start, scaling=float(scaling),
        rope_scale=float(key.rope_scale), softcap=float(softcap),
    )  # fmt: skip


def attention(query: torch.Tensor, key: QuantizedKV, value: QuantizedKV, mask: torch.Tensor, scaling: float,
              softcap: float = 0.0) -> torch.Tensor:  # fmt: skip
    """Attention of query [B, Hq, Tq, D] over quantized keys and values -> [B, Hq, Tq, Dv]:
    `kvq.decode_attention` for one query token (the native kernel on CPU), else `kvq.chunk_attention`;
    on CUDA, once triton is loaded, their Triton twins `kvq.triton_decode_attention` and
    `kvq.triton_chunk_attention` where their tiles take the head_dim and groups
    (`kvq_ao.kernels.gpu.attention_op`)."""
    op = gpu_kernels.attention_op(query, key, value)
    if key.rotated:  # (q R)(k R)^T = q k^T
        query = rotation.rotate(query, key.rotation)
    out = op(**attention_arguments(query, key, value, mask, scaling, softcap))
    return rotation.unrotate(out, value.rotation) if value.rotated else out  # (P V R) R^T = P V


__all__ = ["QuantizedKV", "attention", "attention_arguments", "operand"]
