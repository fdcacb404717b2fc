"""The `kvq` torch.library ops, each with its fake (meta) kernel right below it.

Ops are functional (they never write their inputs): the cache appends their results into its
preallocated buffers with `index_copy_`, which compile, torch.export and ExecuTorch all handle.
The implementations live in `kvq_ao.kernels.composite` (core ATen only); fake kernels give
shapes and dtypes without touching data, so torch.compile and torch.export can trace the ops.
Every op validates its arguments in one shared helper so real and fake kernels reject the same
inputs with the same message.
"""

from __future__ import annotations

import torch

from kvq_ao.kernels import composite
from kvq_ao.quant.packing import SUPPORTED_BITS, packed_size
from kvq_ao.quant.uniform import AXIS_CHANNEL, AXIS_TOKEN, check_shape


def _check_format(bits: int, axis: int, group: int, allow_fp: bool = False) -> None:
    if not (bits in SUPPORTED_BITS or (allow_fp and bits == 0)):
        raise ValueError(f"kvq: bits must be one of {SUPPORTED_BITS}{' or 0 (float)' if allow_fp else ''}, got {bits}")
    if axis not in (AXIS_TOKEN, AXIS_CHANNEL):
        raise ValueError(f"kvq: axis must be {AXIS_TOKEN} (token) or {AXIS_CHANNEL} (channel), got {axis}")


def _meta_shapes(shape, bits: int, axis: int, group: int) -> tuple[list[int], list[int]]:
    """(codes shape, scale shape) of a [..., T, D] tensor in this format."""
    *lead, t, d = shape
    check_shape(t, d, axis, group)
    codes = [*lead, t, packed_size(d, bits)]
    scale = [*lead, t, d // group] if axis == AXIS_TOKEN else [*lead, t // group, d]
    return codes, scale


# --------------------------------------------------------------------------- quantize
@torch.library.custom_op("kvq::quantize", mutates_args=())
def quantize(
    x: torch.Tensor, bits: int, axis: int, group: int, scale_dtype: torch.dtype,
    codebook: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, n_outliers: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """x [B, H, T, D] float -> (codes, scale, zero, outlier values, outlier indices, clamped count).

    codebook: empty for the uniform grid, else 2**bits sorted levels in [0, 1]. n_outliers > 0
    keeps that many outliers per vector exact, judged by the channel ranges lo/hi [H, D], or,
    when lo and hi are empty, per vector (its entries furthest from its mean; per-token axis only).
    """
    _check_quantize(x, bits, axis, group, codebook, lo, hi, n_outliers)
    return composite.quantize(x, bits, axis, group, scale_dtype, codebook, lo, hi, n_outliers)


@quantize.register_fake
def _(x, bits, axis, group, scale_dtype, codebook, lo, hi, n_outliers):
    _check_quantize(x, bits, axis, group, codebook, lo, hi, n_outliers)
    codes, scale = _meta_shapes(x.shape, bits, axis, group)
    sparse = [*x.shape[:-1], n_outliers]
    return (
        x.new_empty(codes, dtype=torch.uint8),
        x.new_empty(scale, dtype=scale_dtype),
        x.new_empty(scale, dtype=scale_dtype),
        x.new_empty(sparse),
        x.new_empty(sparse, dtype=torch.uint8),
        x.new_empty([], dtype=torch.int64),
    )


def _check_quantize(x, bits, axis, group, codebook, lo, hi, n_outliers) -> None:
    _check_format(bits, axis, group)
    _meta_shapes(x.shape, bits, axis, group)
    _check_codebook_shape(codebook, bits)
    if n_outliers < 0 or n_outliers > x.shape[-1]:
        raise ValueError(f"kvq: n_outliers must be in [0, head_dim={x.shape[-1]}], got {n_outliers}")
    if n_outliers > 0:
        if x.dim() != 4:
            raise ValueError("kvq: outliers need x as [batch, heads, tokens, head_dim]")
        if x.shape[-1] >= 255:
            raise ValueError(f"kvq: outliers need head_dim < 255 (uint8 channel indices), got {x.shape[-1]}")
        if lo.numel() == 0 and hi.numel() == 0:
            if axis != AXIS_TOKEN:
                raise ValueError("kvq: per-vector outliers (empty lo/hi) need the per-token axis; per-channel groups need calibrated thresholds")
            return
        want = (x.shape[1], x.shape[-1])
        if tuple(lo.shape) != want or tuple(hi.shape) != want:
            raise ValueError(f"kvq: outlier thresholds must be [heads, head_dim] = {list(want)}, got {list(lo.shape)} and {list(hi.shape)}")


def _check_codebook_shape(codebook: torch.Tensor, bits: int) -> None:
    if codebook.numel() == 0:
        return
    if bits not in (2, 3, 4) or codebook.dim() != 1 or codebook.numel() != 2**bits:
        raise ValueError(f"kvq: a codebook must hold 2**bits levels for bits in (2, 3, 4); got {list(codebook.shape)} for {bits} bits")


# --------------------------------------------------------------------------- dequantize
@torch.library.custom_op("kvq::dequantize", mutates_args=())
def dequantize(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, codebook: torch.Tensor, out_val: torch.Tensor,
    out_idx: torch.Tensor, bits: int, axis: int, group: int, dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """Packed codes [..., T, D*bits/8] -> [..., T, D] in dtype (bits == 0: codes are already float)."""
    _check_format(bits, axis, group, allow_fp=True)
    _check_codebook_shape(codebook, bits)
    return composite.dequantize(codes, scale, zero, codebook, out_val, out_idx, bits, axis, group, dtype)


@dequantize.register_fake
def _(codes, scale, zero, codebook, out_val, out_idx, bits, axis, group, dtype):
    _check_format(bits, axis, group, allow_fp=True)
    _check_codebook_shape(codebook, bits)
    if bits == 0:
        return codes.new_empty(codes.shape, dtype=dtype)
    *lead, t, m = codes.shape
    return codes.new_empty([*lead, t, m * 8 // bits], dtype=dtype)


# --------------------------------------------------------------------------- attention
@torch.library.custom_op("kvq::attention", mutates_args=())
def attention(
    q: torch.Tensor,
    k_codes: torch.Tensor,
    k_scale: torch.Tensor,
    k_zero: torch.Tensor,
    k_codebook: torch.Tensor,
    k_out_val: torch.Tensor,
    k_out_idx: torch.Tensor,
    v_codes: torch.Tensor,
    v_scale: torch.Tensor,
    v_zero: torch.Tensor,
    v_codebook: torch.Tensor,
    v_out_val: torch.Tensor,
    v_out_idx: torch.Tensor,
    side_k: torch.Tensor,
    side_v: torch.Tensor,
    side_pos: torch.Tensor,
    body_end: torch.Tensor,
    mask: torch.Tensor,
    rope_inv_freq: torch.Tensor,
    body_start: int,
    scaling: float,
    rope_scale: float,
    k_bits: int,
    k_axis: int,
    k_group: int,
    v_bits: int,
    v_axis: int,
    v_group: int,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of q [B, Hq, Tq, D] over one layer's quantized cache; see kernels/composite.py.

    softcap > 0 caps the scaled logits as softcap * tanh(s / softcap) (Gemma-2); 0 leaves them."""
    _check_attention(q, k_codes, v_codes, side_k, side_v, side_pos, mask, k_bits, k_axis, k_group, v_bits, v_axis,
                     v_group, k_codebook, v_codebook, rope_inv_freq, softcap)  # fmt: skip
    return composite.attention(
        q, k_codes, k_scale, k_zero, k_codebook, k_out_val, k_out_idx, v_codes, v_scale, v_zero, v_codebook,
        v_out_val, v_out_idx, side_k, side_v, side_pos, body_end, mask, rope_inv_freq, body_start, scaling,
        rope_scale, k_bits, k_axis, k_group, v_bits, v_axis, v_group, softcap, target="eager",
    )  # fmt: skip


@attention.register_fake
def _(q, k_codes, k_scale, k_zero, k_codebook, k_out_val, k_out_idx, v_codes, v_scale, v_zero, v_codebook,
      v_out_val, v_out_idx, side_k, side_v, side_pos, body_end, mask, rope_inv_freq, body_start, scaling,
      rope_scale, k_bits, k_axis, k_group, v_bits, v_axis, v_group, softcap=0.0):  # fmt: skip
    _check_attention(q, k_codes, v_codes, side_k, side_v, side_pos, mask, k_bits, k_axis, k_group, v_bits, v_axis,
                     v_group, k_codebook, v_codebook, rope_inv_freq, softcap)  # fmt: skip
    return q.new_empty([*q.shape[:-1], side_v.shape[-1]])


def _check_attention(q, k_codes, v_codes, side_k, side_v, side_pos, mask, k_bits, k_axis, k_group, v_bits, v_axis,
                     v_group, k_codebook, v_codebook, rope_inv_freq, softcap):  # fmt: skip
    if not softcap >= 0.0:  # also rejects NaN
        raise ValueError(f"kvq.attention: softcap must be >= 0 (0 = no soft-capping), got {softcap}")
    _check_format(k_bits, k_axis, k_group, allow_fp=True)
    _check_format(v_bits, v_axis, v_group, allow_fp=True)
    _check_codebook_shape(k_codebook, k_bits)
    _check_codebook_shape(v_codebook, v_bits)
    if rope_inv_freq.numel() not in (0, side_k.shape[-1] // 2):
        raise ValueError(f"kvq.attention: rope_inv_freq must be empty or head_dim/2 = {side_k.shape[-1] // 2} long")
    if q.dim() != 4 or k_codes.dim() != 4 or v_codes.dim() != 4:
        raise ValueError("kvq.attention: q and the cache must be 4-D [batch, heads, tokens, head_dim]")
    hq, hkv = q.shape[1], k_codes.shape[1]
    if hq % hkv:
        raise ValueError(f"kvq.attention: {hq} query heads is not a multiple of {hkv} key/value heads")
    if q.shape[-1] != side_k.shape[-1]:
        raise ValueError(f"kvq.attention: query head_dim {q.shape[-1]} != key head_dim {side_k.shape[-1]}")
    if mask.dtype != torch.bool or mask.dim() != 4:
        raise ValueError("kvq.attention: mask must be a 4-D bool tensor [batch, 1 or heads, q_len, kv_len]")
    if mask.shape[-1] != k_codes.shape[2]:
        raise ValueError(f"kvq.attention: mask covers {mask.shape[-1]} positions but the cache holds {k_codes.shape[2]}")
    if side_pos.dim() != 1 or side_pos.shape[0] != side_k.shape[2] or side_pos.dtype != torch.int64:
        raise ValueError("kvq.attention: side_pos must be int64 [side_len] matching side_k's token axis")


# --------------------------------------------------------------------------- inductor fusion
_FUSION_ENABLED = False
_CACHE_ENTRY = "kvq_ao.kernels.composite"


def implementation_digest() -> str:
    """Hash of the sources inductor traces for the kvq ops: the composite kernels and every module
    of `kvq_ao.quant` (found by listing the package, so a new numerics module is never left out)."""
    import hashlib
    import importlib
    import inspect
    import pkgutil

    import kvq_ao.quant

    quant = [importlib.import_module(f"kvq_ao.quant.{m.name}") for m in pkgutil.iter_modules(kvq_ao.quant.__path__)]
    digest = hashlib.sha256()
    for module in [composite, *sorted(quant, key=lambda m: m.__name__)]:
        digest.update(inspect.getsource(module).encode())
    return digest.hexdigest()[:16]


def enable_inductor_fusion() -> None:
    """Let inductor trace the ops' composite implementations instead of calling them opaquely.

    A custom op with only a backend kernel stays an extern call under inductor (no fusion, eager
    speed). Registered as inductor decompositions, the composite code is traced and fused: decode
    attention becomes one loop over packed codes with no float [T, D] buffer. Done lazily (from
    `quantize_kv_`) because importing inductor costs seconds that `import kvq_ao` should not pay.
    """
    global _FUSION_ENABLED
    if _FUSION_ENABLED:
        return
    import torch._inductor.config as inductor_config
    from torch._inductor.decomposition import register_decomposition

    # Inductor's graph caches key a custom op by its name only, so code compiled from an older
    # composite would be reused after an upgrade (seen here: wrong attention after a packing
    # change). Every config value is part of the cache keys: keying this entry on the traced
    # sources makes a changed implementation miss the cache. (The entry names no function in any
    # graph, so it marks nothing cacheable that was not.)
    inductor_config.unsafe_marked_cacheable_functions = {
        **inductor_config.unsafe_marked_cacheable_functions,
        _CACHE_ENTRY: implementation_digest(),
    }

    register_decomposition(torch.ops.kvq.quantize.default)(composite.quantize)
    register_decomposition(torch.ops.kvq.dequantize.default)(composite.dequantize)
    register_decomposition(torch.ops.kvq.attention.default)(_attention_for_inductor)
    _FUSION_ENABLED = True


def _attention_for_inductor(*args):
    """The composite attention in its inductor form (buffers for q and the RoPE table, codebook
    levels by selects); same values, measured faster at long contexts."""
    return composite.attention(*args, target="inductor")


__all__ = ["attention", "dequantize", "enable_inductor_fusion", "quantize"]
