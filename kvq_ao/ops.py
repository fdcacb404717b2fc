"""The `kvq` torch.library ops, each with its fake (meta) kernel right below it.

Ops are functional (they never write their inputs): the cache appends their results into its
preallocated buffers with `index_copy_`, which compile, torch.export and ExecuTorch all handle.
The reference implementations live in `kvq_ao.kernels.reference` (core ATen only; the native
CPU kernel of decode attention in `kvq_ao.kernels.cpu` replaces it on CPU); fake kernels give
shapes and dtypes without touching data, so torch.compile and torch.export can trace the ops.
Every op validates its arguments in one shared helper so real and fake kernels reject the same
inputs with the same message.
"""

from __future__ import annotations

import re

import torch

from kvq_ao import format as fmt
from kvq_ao.format import AXIS_CHANNEL, AXIS_TOKEN, OPERAND_INTS, OPERAND_TENSORS, Operand
from kvq_ao.kernels import reference
from kvq_ao.quant.packing import packed_size
from kvq_ao.quant.uniform import check_shape


def _check_format(bits: int, axis: int, group: int, allow_fp: bool = False, query_bits: int = fmt.FLOAT_QUERY,
                  meta: int = fmt.FLOAT_META) -> None:  # fmt: skip
    fmt.check_format(bits, axis, group, allow_float=allow_fp, query_bits=query_bits, meta=meta)


def _meta_shapes(shape, bits: int, axis: int, group: int) -> tuple[list[int], list[int]]:
    """(codes shape, scale shape) of a [..., T, D] tensor in this format."""
    *lead, t, d = shape
    check_shape(t, d, axis, group)
    codes = [*lead, t, packed_size(d, bits)]
    scale = [*lead, t, d // group] if axis == AXIS_TOKEN else [*lead, t // fmt.tokens_per_group(axis, group, t), d]
    return codes, scale


# --------------------------------------------------------------------------- quantize
@torch.library.custom_op("kvq::quantize", mutates_args=())
def quantize(
    x: torch.Tensor, format: list[int], scale_dtype: torch.dtype,
    codebook: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, n_outliers: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """x [B, H, T, D] float in `format` (an operand's format numbers, `kvq_ao.format.format_ints`)
    -> (codes, scale, zero, outlier values, outlier indices, clamped count).

    codebook: empty for the uniform grid, else 2**bits sorted levels in [0, 1]. n_outliers > 0
    keeps that many outliers per vector exact, judged by the channel ranges lo/hi [H, D], or,
    when lo and hi are empty, per vector (its entries furthest from its mean; per-token axis only).
    """
    _check_quantize(x, format, codebook, lo, hi, n_outliers, scale_dtype)
    return reference.quantize(x, format, scale_dtype, codebook, lo, hi, n_outliers)


@quantize.register_fake
def _(x, format, scale_dtype, codebook, lo, hi, n_outliers):
    bits, axis, group = _check_quantize(x, format, codebook, lo, hi, n_outliers, scale_dtype)
    codes, scale = _meta_shapes(x.shape, bits, axis, group)
    sparse = [*x.shape[:-1], n_outliers]
    stored = torch.uint8 if fmt.is_meta8(fmt.format_of(format)[4]) else scale_dtype
    return (
        x.new_empty(codes, dtype=torch.uint8),
        x.new_empty(scale, dtype=stored),
        x.new_empty(scale, dtype=stored),
        x.new_empty(sparse),
        x.new_empty(sparse, dtype=torch.uint8),
        x.new_empty([], dtype=torch.int64),
    )


SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # what kvq.quantize stores float scales and zeros in


def _check_quantize(x, format, codebook, lo, hi, n_outliers, scale_dtype=torch.float16) -> tuple[int, int, int]:
    """Validate kvq.quantize's arguments; returns the format's (bits, axis, group)."""
    if scale_dtype not in SCALE_DTYPES:
        raise ValueError(f"kvq: scale_dtype must be float16, bfloat16 or float32, got {scale_dtype}")
    bits, axis, group, query_bits, meta = fmt.format_of(format)
    _check_format(bits, axis, group, query_bits=query_bits, meta=meta)
    _check_quantize_format(x, bits, axis, group, codebook, lo, hi, n_outliers)
    return bits, axis, group


def _check_quantize_format(x, bits, axis, group, codebook, lo, hi, n_outliers) -> None:
    _check_format(bits, axis, group)
    _meta_shapes(x.shape, bits, axis, group)
    _check_codebook_shape(codebook, bits)
    if n_outliers < 0 or n_outliers > x.shape[-1]:
        raise ValueError(f"kvq: n_outliers must be in [0, head_dim={x.shape[-1]}], got {n_outliers}")
    if n_outliers > 0:
        if x.dim() != 4:
            raise ValueError("kvq: outliers need x as [batch, heads, tokens, head_dim]")
        if x.shape[-1] > fmt.MAX_OUTLIER_HEAD_DIM:
            raise ValueError(f"kvq: outliers need head_dim <= {fmt.MAX_OUTLIER_HEAD_DIM} (uint8 channel indices), got {x.shape[-1]}")
        if lo.numel() == 0 and hi.numel() == 0:
            if axis != AXIS_TOKEN:
                raise ValueError("kvq: per-vector outliers (empty lo/hi) need the per-token axis; per-channel groups need calibrated thresholds")
            return
        want = (x.shape[1], x.shape[-1])
        if tuple(lo.shape) != want or tuple(hi.shape) != want:
            raise ValueError(f"kvq: outlier thresholds must be [heads, head_dim] = {list(want)}, got {list(lo.shape)} and {list(hi.shape)}")


@torch.library.custom_op("kvq::quantize_fixed", mutates_args=())
def quantize_fixed(
    x: torch.Tensor, bits: int, zero: torch.Tensor, scale: torch.Tensor, codebook: torch.Tensor, lo: torch.Tensor,
    hi: torch.Tensor, n_outliers: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """x [B, H, T, D] float against fixed per-channel ranges -> (codes, outlier values, outlier
    indices, clamped count).

    lo/hi [H, D]: each channel's calibrated range (entries outside it are outliers, up to n_outliers
    per vector kept exact, the rest clamped); zero/scale [H, D]: the stored range that covers it
    (`kvq_ao.quant.uniform.fixed_range`). The codes read as the per-channel format with one
    scale/zero row for every position (`kvq.dequantize` with group `kvq_ao.format.ONE_ROW`).
    """
    _check_quantize_fixed(x, bits, zero, scale, codebook, lo, hi, n_outliers)
    return reference.quantize_fixed(x, bits, zero, scale, codebook, lo, hi, n_outliers)


@quantize_fixed.register_fake
def _(x, bits, zero, scale, codebook, lo, hi, n_outliers):
    _check_quantize_fixed(x, bits, zero, scale, codebook, lo, hi, n_outliers)
    sparse = [*x.shape[:-1], n_outliers]
    return (
        x.new_empty([*x.shape[:-1], packed_size(x.shape[-1], bits)], dtype=torch.uint8),
        x.new_empty(sparse),
        x.new_empty(sparse, dtype=torch.uint8),
        x.new_empty([], dtype=torch.int64),
    )


def _check_quantize_fixed(x, bits, zero, scale, codebook, lo, hi, n_outliers) -> None:
    _check_format(bits, AXIS_CHANNEL, 1)
    _check_codebook_shape(codebook, bits)
    if x.dim() != 4:
        raise ValueError(f"kvq: quantize_fixed takes x as [batch, heads, tokens, head_dim], got {list(x.shape)}")
    packed_size(x.shape[-1], bits)
    want = (x.shape[1], x.shape[-1])
    for name, t in (("zero", zero), ("scale", scale), ("lo", lo), ("hi", hi)):
        if tuple(t.shape) != want:
            raise ValueError(f"kvq: fixed ranges need {name} as [heads, head_dim] = {list(want)}, got {list(t.shape)}")
    if n_outliers < 0 or n_outliers > x.shape[-1] or (n_outliers and x.shape[-1] > fmt.MAX_OUTLIER_HEAD_DIM):
        raise ValueError(f"kvq: n_outliers must be in [0, head_dim={x.shape[-1]}] with head_dim <= {fmt.MAX_OUTLIER_HEAD_DIM}, "
                         f"got {n_outliers}")  # fmt: skip


def _check_codebook_shape(codebook: torch.Tensor, bits: int) -> None:
    if codebook.numel() == 0:
        return
    if bits not in (2, 3, 4) or codebook.dim() != 1 or codebook.numel() != 2**bits:
        raise ValueError(f"kvq: a codebook must hold 2**bits levels for bits in (2, 3, 4); got {list(codebook.shape)} for {bits} bits")


# --------------------------------------------------------------------------- dequantize
@torch.library.custom_op("kvq::dequantize", mutates_args=(), schema="(Tensor?[] operand, int[] format, ScalarType dtype) -> Tensor")
def dequantize(operand, format, dtype) -> torch.Tensor:
    """One operand's body (its lists, `kvq_ao.format`; the side entry is not read): packed codes
    [..., T, D*bits/8] -> [..., T, D] in dtype (a float format: codes are the values)."""
    o = _check_dequantize(operand, format)
    x = reference.dequantize_operand(o, dtype)
    return x.clone() if x is o.codes else x  # a float body in its own dtype: an op's output may not alias its input


@dequantize.register_fake
def _(operand, format, dtype):
    o = _check_dequantize(operand, format)
    if o.is_float:
        return o.codes.new_empty(o.codes.shape, dtype=dtype)
    *lead, t, m = o.codes.shape
    return o.codes.new_empty([*lead, t, m * 8 // o.bits], dtype=dtype)


def _check_dequantize(operand, format) -> Operand:
    o = Operand.from_lists(operand, format)
    _check_format(o.bits, o.axis, o.group, allow_fp=True, query_bits=o.query_bits, meta=o.meta)
    _check_metadata_dtypes(o, "kvq.dequantize: the operand")
    _check_codebook_shape(o.codebook if o.codebook is not None else o.codes.new_zeros(0), o.bits)
    if (o.out_val is None) != (o.out_idx is None):
        raise ValueError("kvq.dequantize: out_val and out_idx come together (both or neither)")
    return o


# --------------------------------------------------------------------------- attention
# The attention ops' signature, built from the operand definition in `kvq_ao.format`: each of K
# and V is one `Tensor?[]` (OPERAND_TENSORS, absent ones None) and one `int[]` (OPERAND_INTS), so
# the per-operand fields and their order exist only there. Callers build the lists with
# `attention_arguments` (or `Operand.lists()`) and pass everything by name.
ATTENTION_SCHEMA = (
    "(Tensor q, Tensor?[] k, int[] k_format, Tensor?[] v, int[] v_format, Tensor side_pos, Tensor body_end, "
    "Tensor mask, Tensor? rope_inv_freq, int body_start, float scaling, float rope_scale, float softcap=0.0) -> Tensor"
)
ATTENTION_FIELDS: tuple[str, ...] = tuple(re.findall(r"(\w+)(?:=[^,)]*)?[,)]", ATTENTION_SCHEMA.split("->")[0]))


def attention_arguments(q: torch.Tensor, k: Operand, v: Operand, **rest) -> dict:
    """The attention ops' named arguments for q over operands k and v (`rest`: the shared fields)."""
    (k_tensors, k_format), (v_tensors, v_format) = k.lists(), v.lists()
    return dict(q=q, k=k_tensors, k_format=k_format, v=v_tensors, v_format=v_format, **rest)


def named_arguments(args: tuple, kwargs: dict) -> dict:
    """The attention ops' arguments by name, however they were passed, with K and V as `Operand`s."""
    named = dict(zip(ATTENTION_FIELDS, args), **kwargs)
    named.setdefault("softcap", 0.0)
    for side in ("k", "v"):
        named[side] = Operand.from_lists(named[side], named.pop(f"{side}_format"), name=side)
    return named


def filled(o: Operand, like: torch.Tensor) -> Operand:
    """The operand with every absent tensor as the empty tensor the reference kernels expect."""
    empty = lambda dtype: like.new_zeros(0, dtype=dtype)  # noqa: E731
    sparse = lambda dtype: o.codes.new_zeros([*o.codes.shape[:-1], 0], dtype=dtype)  # noqa: E731
    return o.replace(
        scale=o.scale if o.scale is not None else empty(torch.float16),
        zero=o.zero if o.zero is not None else empty(torch.float16),
        codebook=o.codebook if o.codebook is not None else empty(torch.float32),
        out_val=o.out_val if o.out_val is not None else sparse(o.side.dtype),
        out_idx=o.out_idx if o.out_idx is not None else sparse(torch.uint8),
    )


def reference_arguments(named: dict) -> dict:
    """Named arguments (from `named_arguments`) as the reference kernels take them: absent tensors empty."""
    out = dict(named)
    out["k"], out["v"] = filled(named["k"], named["q"]), filled(named["v"], named["q"])
    if out["rope_inv_freq"] is None:
        out["rope_inv_freq"] = named["q"].new_zeros(0, dtype=torch.float32)
    return out


def run_reference(args: tuple, kwargs: dict, target: str = "export") -> torch.Tensor:
    """The reference attention (either op) on arguments passed either way, in `target`'s form."""
    return reference.attention(**reference_arguments(named_arguments(args, kwargs)), target=target)


@torch.library.custom_op("kvq::decode_attention", mutates_args=(), schema=ATTENTION_SCHEMA)
def decode_attention(*args, **kwargs) -> torch.Tensor:
    """Attention of one query token q [B, Hq, 1, D] over one layer's quantized cache -> [B, Hq, 1, Dv].

    The decode hot path: CPU runs the native kernel (kernels/cpu) when it is built, every other
    device the reference (kernels/reference.py). softcap > 0 caps the scaled logits as
    softcap * tanh(s / softcap) (Gemma-2); 0 leaves them."""
    _check_attention(named_arguments(args, kwargs), decode=True)
    return run_reference(args, kwargs, target="eager")


@torch.library.custom_op("kvq::chunk_attention", mutates_args=(), schema=ATTENTION_SCHEMA)
def chunk_attention(*args, **kwargs) -> torch.Tensor:
    """Attention of a chunk of queries q [B, Hq, Tq, D] (prefill, speculative or batched steps) over
    one layer's quantized cache -> [B, Hq, Tq, Dv].

    Streams: blocks of the body are dequantized one at a time and merged with an online softmax
    (kernels/reference.py, `streaming_attention`), so neither the float cache nor, with an int64
    bounds mask [B, 1, Tq, 2] (`kvq_ao.masks`), a [Tq, T] mask is ever held."""
    named = _check_attention(named_arguments(args, kwargs), decode=False)
    return reference.streaming_attention(**reference_arguments(named))


def _attention_fake(decode: bool):
    """The fake kernel of either attention op: the same checks, an output shaped like q with Dv channels."""

    def fake(*args, **kwargs):
        named = _check_attention(named_arguments(args, kwargs), decode=decode)
        return named["q"].new_empty([*named["q"].shape[:-1], named["v"].side.shape[-1]])

    return fake


decode_attention.register_fake(_attention_fake(decode=True))
chunk_attention.register_fake(_attention_fake(decode=False))

# Partial attention over one shard of a sequence (context parallelism): the attention ops'
# arguments plus the shard's first sequence position, returning what an exact merge of shards
# needs: (out float32 [B, Hq, Tq, Dv], log-sum-exp of the scaled scores float32 [B, Hq, Tq]).
PARTIAL_SCHEMA = ATTENTION_SCHEMA.replace("float softcap=0.0) -> Tensor", "float softcap=0.0, int position_offset=0) -> (Tensor, Tensor)")


def _partial_arguments(args: tuple, kwargs: dict, decode: bool) -> tuple[dict, int]:
    kwargs = dict(kwargs)
    if len(args) > len(ATTENTION_FIELDS):  # position_offset passed positionally
        args, kwargs["position_offset"] = args[: len(ATTENTION_FIELDS)], args[len(ATTENTION_FIELDS)]
    offset = int(kwargs.pop("position_offset", 0))
    if offset < 0:
        raise ValueError(f"kvq partial attention: position_offset must be >= 0, got {offset}")
    return _check_attention(named_arguments(args, kwargs), decode=decode), offset


def _partial_reference(args: tuple, kwargs: dict, decode: bool) -> tuple[torch.Tensor, torch.Tensor]:
    named, offset = _partial_arguments(args, kwargs, decode)
    return reference.streaming_attention(**reference_arguments(named), position_offset=offset, with_lse=True)


@torch.library.custom_op("kvq::decode_attention_partial", mutates_args=(), schema=PARTIAL_SCHEMA)
def decode_attention_partial(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """`decode_attention` over a shard whose body index 0 is sequence position `position_offset`
    -> (out float32 [B, Hq, 1, Dv], lse float32 [B, Hq, 1]; -inf where nothing was read).

    CPU runs the native kernel when it is built (the decode kernel's own split-softmax state),
    every other device the streaming reference."""
    return _partial_reference(args, kwargs, decode=True)


@torch.library.custom_op("kvq::chunk_attention_partial", mutates_args=(), schema=PARTIAL_SCHEMA)
def chunk_attention_partial(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """`chunk_attention` over a shard (see `decode_attention_partial`) -> (out, lse) in float32."""
    return _partial_reference(args, kwargs, decode=False)


def _partial_fake(decode: bool):
    def fake(*args, **kwargs):
        named, _ = _partial_arguments(args, kwargs, decode)
        q = named["q"]
        return q.new_empty([*q.shape[:-1], named["v"].side.shape[-1]], dtype=torch.float32), q.new_empty(q.shape[:-1], dtype=torch.float32)

    return fake


decode_attention_partial.register_fake(_partial_fake(decode=True))
chunk_attention_partial.register_fake(_partial_fake(decode=False))

# The out variant that ExecuTorch programs call (exported with native kvq kernels, the ExecuTorch
# kernel library in kernels/cpu/executorch_ops.cpp implements it); in PyTorch it is the
# functional op written into `out`.
ATTENTION_OUT_SCHEMA = ATTENTION_SCHEMA.replace(") -> Tensor", ", *, Tensor(a!) out) -> Tensor(a!)")
_LIB = torch.library.Library("kvq", "FRAGMENT")  # noqa: TOR901  (an overload of an op custom_op defined)
_LIB.define("decode_attention.out" + ATTENTION_OUT_SCHEMA)


@torch.library.impl(_LIB, "decode_attention.out", "CompositeExplicitAutograd")
def _decode_attention_out(*args, out: torch.Tensor, **kwargs) -> torch.Tensor:
    return out.copy_(torch.ops.kvq.decode_attention.default(*args, **kwargs))


@torch.library.register_fake("kvq::decode_attention.out", lib=_LIB)
def _decode_attention_out_fake(*args, out: torch.Tensor, **kwargs) -> torch.Tensor:
    _check_attention(named_arguments(args, kwargs), decode=True)
    return out


# The append's out variant, for the same programs: kvq::quantize's arguments (as custom_op typed
# them: ExecuTorch pairs the two by signature), then its six outputs.
_LIB.define(
    "quantize.out(Tensor x, SymInt[] format, ScalarType scale_dtype, Tensor codebook, Tensor lo, Tensor hi, SymInt n_outliers, *, "
    "Tensor(a!) codes, Tensor(b!) scale, Tensor(c!) zero, Tensor(d!) out_val, Tensor(e!) out_idx, Tensor(f!) clamped) "
    "-> (Tensor(a!), Tensor(b!), Tensor(c!), Tensor(d!), Tensor(e!), Tensor(f!))"
)


@torch.library.impl(_LIB, "quantize.out", "CompositeExplicitAutograd")
def _quantize_out(x, format, scale_dtype, codebook, lo, hi, n_outliers, *, codes, scale, zero, out_val, out_idx, clamped):
    outs = (codes, scale, zero, out_val, out_idx, clamped)
    for out, value in zip(outs, torch.ops.kvq.quantize.default(x, format, scale_dtype, codebook, lo, hi, n_outliers)):
        out.copy_(value)
    return outs


@torch.library.register_fake("kvq::quantize.out", lib=_LIB)
def _quantize_out_fake(x, format, scale_dtype, codebook, lo, hi, n_outliers, *, codes, scale, zero, out_val, out_idx, clamped):
    _check_quantize(x, format, codebook, lo, hi, n_outliers, scale_dtype)
    return codes, scale, zero, out_val, out_idx, clamped


# The calibrated-range append's out variant (KVQuant's per-channel keys), likewise.
_LIB.define(
    "quantize_fixed.out(Tensor x, SymInt bits, Tensor zero, Tensor scale, Tensor codebook, Tensor lo, Tensor hi, SymInt n_outliers, "
    "*, Tensor(a!) codes, Tensor(b!) out_val, Tensor(c!) out_idx, Tensor(d!) clamped) "
    "-> (Tensor(a!), Tensor(b!), Tensor(c!), Tensor(d!))"
)


@torch.library.impl(_LIB, "quantize_fixed.out", "CompositeExplicitAutograd")
def _quantize_fixed_out(x, bits, zero, scale, codebook, lo, hi, n_outliers, *, codes, out_val, out_idx, clamped):
    outs = (codes, out_val, out_idx, clamped)
    for out, value in zip(outs, torch.ops.kvq.quantize_fixed.default(x, bits, zero, scale, codebook, lo, hi, n_outliers)):
        out.copy_(value)
    return outs


@torch.library.register_fake("kvq::quantize_fixed.out", lib=_LIB)
def _quantize_fixed_out_fake(x, bits, zero, scale, codebook, lo, hi, n_outliers, *, codes, out_val, out_idx, clamped):
    _check_quantize_fixed(x, bits, zero, scale, codebook, lo, hi, n_outliers)
    return codes, out_val, out_idx, clamped


def _check_metadata_dtypes(o: Operand, name: str) -> None:
    """uint8 scale and zero with 8-bit metadata, float ones otherwise (a clear error naming the operand)."""
    if o.is_float or o.scale is None or o.zero is None:
        return
    coded = [t.dtype == torch.uint8 for t in (o.scale, o.zero)]
    if o.meta8 and not all(coded):
        raise ValueError(f"{name}'s 8-bit metadata (meta {o.meta}) needs uint8 scale and zero, got {o.scale.dtype} and {o.zero.dtype}")
    if not o.meta8 and not all(t.is_floating_point() for t in (o.scale, o.zero)):
        raise ValueError(f"{name}'s float metadata (meta {fmt.FLOAT_META}) needs float scale and zero, got {o.scale.dtype} and "
                         f"{o.zero.dtype}")  # fmt: skip


def _check_operand(o: Operand, name: str) -> None:
    _check_format(o.bits, o.axis, o.group, allow_fp=True, query_bits=o.query_bits, meta=o.meta)
    _check_metadata_dtypes(o, f"kvq attention: {name}")
    if o.int_query and (name != "k" or o.codebook is not None):
        raise ValueError(f"kvq attention: an integer query (query_bits {o.query_bits}) scores keys with uniform codes; {name} has "
                         + ("a codebook" if name == "k" else "it (values take query_bits 0)"))  # fmt: skip
    for field in ("codes", "side"):
        if not isinstance(getattr(o, field), torch.Tensor):
            raise ValueError(f"kvq attention: {name}'s {field} must be a tensor, got {type(getattr(o, field)).__name__}")
    if o.is_float:
        if o.scale is not None or o.zero is not None or o.codebook is not None:
            raise ValueError(f"kvq attention: a float {name} body takes no scale, zero or codebook (None in {name})")
    elif o.scale is None or o.zero is None:
        raise ValueError(f"kvq attention: {o.bits}-bit {name} codes need a scale and a zero")
    elif o.codes.dtype != torch.uint8:
        raise ValueError(f"kvq attention: {o.bits}-bit {name} codes must be uint8, got {o.codes.dtype}")
    val, idx = o.out_val, o.out_idx
    if (val is None) != (idx is None):
        raise ValueError(f"kvq attention: {name}'s out_val and out_idx come together (both or neither)")
    if val is not None and (val.shape != idx.shape or tuple(val.shape[:-1]) != tuple(o.codes.shape[:-1]) or idx.dtype != torch.uint8):
        raise ValueError(f"kvq attention: {name} outliers must be [batch, heads, tokens, k] values and uint8 indices")
    cb = o.codebook
    if cb is not None and cb.numel() == 0:
        raise ValueError(f"kvq attention: pass None as {name}'s codebook for uniform levels, not an empty tensor")
    _check_codebook_shape(cb if cb is not None else o.codes.new_zeros(0), o.bits)


def _check_attention(a: dict, decode: bool) -> dict:
    """Validate named attention arguments (from `named_arguments`; shared by real and fake kernels); returns them."""
    q, k, v = a["q"], a["k"], a["v"]
    side_pos, mask, rope, softcap = a["side_pos"], a["mask"], a["rope_inv_freq"], a["softcap"]
    if not softcap >= 0.0:  # also rejects NaN
        raise ValueError(f"kvq attention: softcap must be >= 0 (0 = no soft-capping), got {softcap}")
    _check_operand(k, "k")
    _check_operand(v, "v")
    if q.dim() != 4 or k.codes.dim() != 4 or v.codes.dim() != 4:
        raise ValueError("kvq attention: q and the cache must be 4-D [batch, heads, tokens, head_dim]")
    if decode and q.shape[2] != 1:
        raise ValueError(f"kvq.decode_attention takes one query token, got {q.shape[2]}: use kvq.chunk_attention")
    if rope is not None and (rope.dim() != 1 or rope.numel() != k.side.shape[-1] // 2):
        raise ValueError(f"kvq attention: rope_inv_freq must be None (post-RoPE keys) or head_dim/2 = {k.side.shape[-1] // 2} long")
    if rope is not None and k.int_query:
        raise ValueError(f"kvq attention: an integer query (query_bits {k.query_bits}) needs post-RoPE keys (rope_inv_freq None): "
                         "pre-RoPE keys are rotated per position after dequantization")  # fmt: skip
    hq, hkv = q.shape[1], k.codes.shape[1]
    if hq % hkv:
        raise ValueError(f"kvq attention: {hq} query heads is not a multiple of {hkv} key/value heads")
    if q.shape[-1] != k.side.shape[-1]:
        raise ValueError(f"kvq attention: query head_dim {q.shape[-1]} != key head_dim {k.side.shape[-1]}")
    if v.side.shape[:3] != k.side.shape[:3] or v.codes.shape[:3] != k.codes.shape[:3]:
        raise ValueError("kvq attention: keys and values must cover the same batch, heads and tokens")
    if mask.dtype == torch.int64 and not decode:  # key-position bounds (kvq_ao.masks)
        if list(mask.shape) != [q.shape[0], 1, q.shape[2], 2]:
            raise ValueError(f"kvq attention: int64 mask bounds must be [batch, 1, q_len, 2] = {[q.shape[0], 1, q.shape[2], 2]}, "
                             f"got {list(mask.shape)}")  # fmt: skip
    elif mask.dtype != torch.bool or mask.dim() != 4 or mask.shape[1] not in (1, hq) or mask.shape[2] != q.shape[2]:
        raise ValueError("kvq attention: mask must be a 4-D bool tensor [batch, 1 or heads, q_len, kv_len]"
                         + ("" if decode else " or int64 key-position bounds [batch, 1, q_len, 2]"))  # fmt: skip
    elif mask.shape[-1] != k.codes.shape[2]:
        raise ValueError(f"kvq attention: mask covers {mask.shape[-1]} positions but the cache holds {k.codes.shape[2]}")
    if side_pos.dim() != 1 or side_pos.shape[0] != k.side.shape[2] or side_pos.dtype != torch.int64:
        raise ValueError("kvq attention: side_pos must be int64 [side_len] matching the side entries' token axis")
    body_end = a["body_end"]
    per_query = not decode and body_end.dim() == 1 and body_end.shape[0] == q.shape[2]
    if body_end.dtype != torch.int64 or not (body_end.dim() == 0 or per_query):
        raise ValueError("kvq attention: body_end must be a 0-dim int64 tensor"
                         + ("" if decode else f", or int64 [q_len] = [{q.shape[2]}] (one per query)"))  # fmt: skip
    return a


# --------------------------------------------------------------------------- inductor fusion
_FUSION_ENABLED = False
_CACHE_ENTRY = "kvq_ao.kernels.reference"


def implementation_digest() -> str:
    """Hash of the sources inductor traces for the kvq ops: the reference kernels, this module (it
    chooses between native op and decomposition) and every module of `kvq_ao.quant` (found by
    listing the package, so a new numerics module is never left out)."""
    import hashlib
    import importlib
    import inspect
    import pkgutil
    import sys

    import kvq_ao.quant

    quant = [importlib.import_module(f"kvq_ao.quant.{m.name}") for m in pkgutil.iter_modules(kvq_ao.quant.__path__)]
    digest = hashlib.sha256()
    for module in [reference, sys.modules[__name__], *sorted(quant, key=lambda m: m.__name__)]:
        digest.update(inspect.getsource(module).encode())
    return digest.hexdigest()[:16]


def enable_inductor_fusion() -> None:
    """Let inductor trace the reference kernels wherever no native kernel serves the device.

    A custom op with only a Python kernel stays an extern call under inductor (no fusion, eager
    speed). Registered as inductor decompositions, the reference code is traced and fused: decode
    attention becomes one loop over packed codes with no float [T, D] buffer. Where a native
    kernel serves the device (decode attention on CPU, `kvq_ao.kernels.cpu`) the decomposition
    declines and the compiled graph calls the native op. Done lazily (from `quantize_kv_`) because
    importing inductor costs seconds that `import kvq_ao` should not pay.
    """
    global _FUSION_ENABLED
    if _FUSION_ENABLED:
        return
    import torch._inductor.config as inductor_config
    from torch._inductor.decomposition import register_decomposition

    # Inductor's graph caches key a custom op by its name only, so code compiled from an older
    # reference would be reused after an upgrade (seen here: wrong attention after a packing
    # change). Every config value is part of the cache keys: keying this entry on the traced
    # sources makes a changed implementation miss the cache. (The entry names no function in any
    # graph, so it marks nothing cacheable that was not.)
    inductor_config.unsafe_marked_cacheable_functions = {
        **inductor_config.unsafe_marked_cacheable_functions,
        _CACHE_ENTRY: implementation_digest(),
    }

    # Stored scales and zeros are rounded to their dtype (float16) before codes are computed against
    # them (`kvq_ao.quant.uniform`). By default inductor drops a float32 -> float16 -> float32 round
    # trip inside a fused kernel, so compiled code stored other bytes than eager (codes computed
    # against the unrounded scale; benchmarks/soak.py found it). This makes inductor round as eager
    # does: in float32 models only kvq's casts change; in bf16/fp16 models compiled intermediates
    # are rounded to their dtype as eager rounds them.
    inductor_config.emulate_precision_casts = True
    for op, decomposition in decompositions("inductor").items():
        register_decomposition(op)(decomposition)
    # Where the decomposition declines (a native kernel serves the device) the op reaches inductor's
    # lowering as itself; inductor refuses an implicit fallback for an op that has a decomposition,
    # so the fallback (an extern call of the op) is registered explicitly.
    from torch._inductor.lowering import make_fallback

    make_fallback(torch.ops.kvq.decode_attention.default, warn=False, override_decomp=True)
    _FUSION_ENABLED = True


def decompositions(target: str) -> dict:
    """The one table of the kvq ops' decompositions into their reference implementations.

    target "inductor": what `enable_inductor_fusion` registers (decode attention declines where a
    native kernel serves the device); "export": what exported programs lower to (core ATen on
    every device; `kvq_ao.export.decoder` drops decode attention from it for runtimes with the kvq
    kernel library)."""
    if target not in ("inductor", "export"):
        raise ValueError(f"target must be 'inductor' or 'export', got {target!r}")
    inductor = target == "inductor"
    kvq = torch.ops.kvq
    return {
        kvq.quantize.default: reference.quantize,
        kvq.quantize_fixed.default: reference.quantize_fixed,
        kvq.dequantize.default: reference.dequantize,
        kvq.decode_attention.default: _decode_attention_for_inductor if inductor else _for_export,
        kvq.chunk_attention.default: _chunk_attention_for_inductor if inductor else _for_export,
    }


def _for_export(*args, **kwargs):
    """Either attention op in the form torch.export traces (core ATen)."""
    return run_reference(args, kwargs, target="export")


def _decode_attention_for_inductor(*args, **kwargs):
    """The reference decode attention in its inductor form, unless a native kernel serves q's device
    (then NotImplemented: the op stays in the graph and calls that kernel)."""
    from kvq_ao.kernels import native_device

    if native_device(named_arguments(args, kwargs)["q"].device):
        return NotImplemented
    return run_reference(args, kwargs, target="inductor")


def _chunk_attention_for_inductor(*args, **kwargs):
    """The reference chunk attention in its inductor form (buffers for q and the RoPE table, codebook
    levels by selects); same values, measured faster at long contexts."""
    return run_reference(args, kwargs, target="inductor")


__all__ = ["ATTENTION_FIELDS", "ATTENTION_SCHEMA", "OPERAND_INTS", "OPERAND_TENSORS", "PARTIAL_SCHEMA", "attention_arguments", "chunk_attention", "chunk_attention_partial",
           "decode_attention", "decode_attention_partial", "decompositions", "dequantize",
           "enable_inductor_fusion", "named_arguments", "quantize", "quantize_fixed", "reference_arguments", "run_reference"]  # fmt: skip
