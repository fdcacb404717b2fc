"""Asymmetric uniform quantization of KV tensors along either axis, with groups.

A KV tensor is [..., T, D] (tokens, head_dim). Two groupings matter for KV caches:

* ``AXIS_TOKEN``: each token's D channels are split into groups of G channels, one
  (scale, min) per group -> metadata [..., T, D/G]. Streams token by token (values, KIVI).
* ``AXIS_CHANNEL``: each channel is quantized over a block of G consecutive tokens, one
  (scale, min) per channel per block -> metadata [..., T/G, D]. Keys have a few channels with
  large magnitude (KIVI, KVQuant); per-channel grouping keeps them from wasting everyone's range.

Convention: ``x ~= code * scale + zero`` with ``zero`` the group minimum (a float zero point,
as KIVI does), codes in [0, 2**bits). Scale and zero are stored in ``scale_dtype`` (float16
by default, as in KIVI); codes are computed against the stored (rounded) scale and zero, so
dequantization is exactly what attention will see.
"""

from __future__ import annotations

import torch

from kvq_ao.format import AXIS_CHANNEL, AXIS_TOKEN, FLOAT_META, ONE_ROW, PACKED_BITS, check_format, is_meta8, is_one_row, meta_exponent  # noqa: F401  (re-exported)
from kvq_ao.quant import metadata
from kvq_ao.quant.packing import pack, unpack_float


def _grouped(x: torch.Tensor, axis: int, group: int) -> torch.Tensor:
    """View [..., T, D] as groups: token axis -> [..., T, D/G, G]; channel -> [..., T/G, G, D]
    (one calibrated row for every position: [..., 1, T, D])."""
    *lead, t, d = x.shape
    if axis == AXIS_TOKEN:
        return x.reshape(*lead, t, d // group, group)
    if is_one_row(axis, group):
        return x.reshape(*lead, 1, t, d)
    return x.reshape(*lead, t // group, group, d)


def _reduce_dim(axis: int) -> int:
    return -1 if axis == AXIS_TOKEN else -2


def check_shape(t: int, d: int, axis: int, group: int) -> None:
    """Raise a clear error when a [.., t, d] tensor cannot be grouped as asked."""
    check_format(PACKED_BITS[0], axis, group)
    if is_one_row(axis, group):
        return
    if axis == AXIS_TOKEN and d % group:
        raise ValueError(f"per-token group size {group} does not divide head_dim {d}")
    if axis == AXIS_CHANNEL and t % group:
        raise ValueError(f"per-channel quantization needs whole blocks of {group} tokens, got {t} tokens")


def _step(xf: torch.Tensor, direction: float, dtype: torch.dtype) -> torch.Tensor:
    """float32 xf (a value of `dtype`) moved one or two ulps of `dtype` in `direction` (+1 / -1).

    Returned as float32 holding a `dtype` value. `torch.nextafter` would do, but it is not core
    ATen (ExecuTorch rejects it). |x| * eps is between one and two ulps of x, so the sum rounds
    to a neighbour strictly past x. Only multiply/add/max: a log2-based ulp exported to ONNX as
    Log/Div and moved by different amounts in onnxruntime, changing stored scales.
    """
    finfo = torch.finfo(dtype)
    delta = torch.clamp(xf.abs() * finfo.eps, min=finfo.smallest_normal * finfo.eps)
    return _rounded(xf + direction * delta, dtype)


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to `dtype`, kept in float32.

    Every select/compare on metadata runs on float32 tensors: onnxruntime's CPU provider has no
    float16 `Where`, wraps it in inserted casts and then drops the f32->f16->f32 pair, silently
    using the unrounded value (found comparing stored scales: 9% of groups differed).
    """
    return x.to(dtype).float()


def group_range(g: torch.Tensor, dim: int, levels: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(zero, scale) of each group of g along `dim` (kept), float32 holding `scale_dtype` values.

    Zero is the group minimum rounded down and scale is (max - zero) / levels rounded up, so
    every element stays inside the stored range [zero, zero + levels * scale] and the error
    bound is half a step of the *stored* scale, whatever scale_dtype is.
    """
    lo = g.amin(dim=dim, keepdim=True)
    hi = g.amax(dim=dim, keepdim=True)
    finfo = torch.finfo(scale_dtype)
    zero = _rounded(lo.clamp(finfo.min, finfo.max), scale_dtype)
    zero = torch.where(zero > lo, _step(zero, -1.0, scale_dtype), zero)
    scale = _rounded(((hi - zero) / levels).clamp(0.0, finfo.max), scale_dtype)
    # Checked in float64, where fp16/fp32 scale * levels + zero is exact: in float32 the result
    # depends on whether a runtime fuses the multiply-add (onnxruntime does), flipping the choice.
    too_small = scale.double() * levels + zero.double() < hi.double()
    scale = torch.where(too_small, _step(scale, 1.0, scale_dtype), scale)
    return zero, scale


def fixed_range(lo: torch.Tensor, hi: torch.Tensor, levels: int, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(zero, scale) in `scale_dtype` covering [lo, hi] elementwise with `levels` steps, rounded as
    `group_range` rounds a group's range (zero down, scale up), so every entry clamped into
    [lo, hi] lies inside the stored range. For ranges fixed ahead of time (calibrated keys)."""
    zero, scale = group_range(torch.stack([lo.float(), hi.float()], dim=-2), -2, levels, scale_dtype)
    return zero.squeeze(-2).to(scale_dtype), scale.squeeze(-2).to(scale_dtype)


def stored_range(g: torch.Tensor, dim: int, levels: int, scale_dtype: torch.dtype, meta: int = FLOAT_META):
    """(zero, scale) float32 each group of g along `dim` (kept) is coded against, and (scale, zero)
    as stored: in `scale_dtype`, or as uint8 codes with 8-bit metadata (`meta`, per-token groups;
    `kvq_ao.quant.metadata`)."""
    if is_meta8(meta):
        check_format(PACKED_BITS[0], AXIS_TOKEN if dim == -1 else AXIS_CHANNEL, 1, meta=meta)
        zero, scale, z, s = metadata.group_range8(g, dim, levels, meta_exponent(meta))
        return zero, scale, s.squeeze(dim), z.squeeze(dim)
    zero, scale = group_range(g, dim, levels, scale_dtype)
    return zero, scale, scale.squeeze(dim).to(scale_dtype), zero.squeeze(dim).to(scale_dtype)


def read_range(scale: torch.Tensor, zero: torch.Tensor, levels: int, meta: int = FLOAT_META) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, zero) float32 of stored metadata (floats, or 8-bit codes decoded)."""
    if is_meta8(meta):
        return metadata.decode(scale, zero, levels, meta_exponent(meta))
    return scale.float(), zero.float()


def quantize_uniform(
    x: torch.Tensor, bits: int, axis: int, group: int, scale_dtype: torch.dtype = torch.float16, meta: int = FLOAT_META
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Quantize x [..., T, D] -> (packed uint8 [..., T, D*bits/8], scale, zero).

    Constant groups (zero range) get scale 0 and reproduce their value exactly as `zero` (with
    float metadata; 8-bit metadata codes them against its smallest scale).
    """
    *_, t, d = x.shape
    check_shape(t, d, axis, group)
    levels = 2**bits - 1
    g = _grouped(x.float(), axis, group)
    dim = _reduce_dim(axis)
    zero, scale, scale_out, zero_out = stored_range(g, dim, levels, scale_dtype, meta)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((g - zero) / safe).clamp(0.0, float(levels))
    codes = codes.reshape(x.shape).to(torch.uint8)
    return pack(codes, bits), scale_out, zero_out


def dequantize_uniform(
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    bits: int,
    axis: int,
    group: int,
    out_dtype: torch.dtype = torch.float32,
    meta: int = FLOAT_META,
) -> torch.Tensor:
    """Inverse of `quantize_uniform`: -> [..., T, D] in out_dtype."""
    codes = unpack_float(packed, bits)
    g = _grouped(codes, axis, group)
    dim = _reduce_dim(axis)
    scale, zero = read_range(scale, zero, 2**bits - 1, meta)
    x = g * scale.unsqueeze(dim) + zero.unsqueeze(dim)
    return x.reshape(codes.shape).to(out_dtype)


__all__ = ["ONE_ROW", "check_shape", "dequantize_uniform", "fixed_range", "group_range", "quantize_uniform", "read_range", "stored_range",
           "AXIS_CHANNEL", "AXIS_TOKEN"]
