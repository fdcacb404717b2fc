"""Random cases of the kvq attention ops (named arguments) and their float64 reference, shared by
the op, native-kernel, Triton, compile and KVQuant tests."""

import torch
try:  # the random cases' strategies; benchmarks/gpu.py imports the fixed cases on GPU images without hypothesis
    from hypothesis import strategies as st
except ImportError:
    st = None

from kvq_ao import masks
from kvq_ao.format import AXIS_CHANNEL, AXIS_TOKEN, FLOAT_META, ONE_ROW, Operand, default_meta_exponent, format_ints, meta_ints
from kvq_ao.kernels.reference import dequantize_operand
from kvq_ao.ops import ATTENTION_FIELDS, attention_arguments, reference_arguments
from kvq_ao.quant.codebook import nf_codebook
from kvq_ao.quant.uniform import fixed_range

# A case is a dict of the attention ops' arguments by name with K and V as `Operand`s (the form
# `kvq_ao.ops.named_arguments` gives); `op_args` turns it into what the ops take.


def op_args(named: dict) -> dict:
    """The case as the attention ops' named arguments (each operand as its two lists)."""
    rest = {n: v for n, v in named.items() if n not in ("q", "k", "v")}
    return attention_arguments(named["q"], named["k"], named["v"], **rest)


def attend(named: dict, op=None) -> torch.Tensor:
    """The attention op for the case's query length (or `op`), called with the case's arguments."""
    op = op or (torch.ops.kvq.decode_attention if named["q"].shape[2] == 1 else torch.ops.kvq.chunk_attention)
    return op(**op_args(named))


def positional(named: dict) -> tuple:
    """The arguments in schema order (for opcheck and torch.compile'd lambdas)."""
    args = op_args(named)
    return tuple(args[n] for n in ATTENTION_FIELDS)


def dequantize(dtype, *, codes, bits, axis, group, scale=None, zero=None, codebook=None, out_val=None, out_idx=None):
    """`kvq.dequantize` of one body given by field name (an empty codebook or outlier slots count as absent)."""
    body = Operand(codes=codes, scale=scale, zero=zero, codebook=codebook, out_val=out_val, out_idx=out_idx, side=None,
                   bits=bits, axis=axis, group=group)  # fmt: skip
    return torch.ops.kvq.dequantize(*body.lists(), dtype)


def map_tensors(named: dict, fn) -> dict:
    """The case with fn applied to every tensor, inside the operands too (e.g. fake tensors)."""
    apply = lambda v: fn(v) if isinstance(v, torch.Tensor) else v  # noqa: E731
    return {n: (v.replace(**{f: apply(x) for f, x in v.fields().items()}) if isinstance(v, Operand) else apply(v))
            for n, v in named.items()}  # fmt: skip


def with_operand(named: dict, which: str, /, **changes) -> dict:
    """The case with fields of one operand ("k" or "v") replaced."""
    return dict(named, **{which: named[which].replace(**changes)})


FIXED = ONE_ROW  # the `group` of calibrated per-channel ranges: one scale/zero row for every position


def _fixed_ranges(x, bits, cb, outliers):
    """x in the calibrated-ranges format (`kvq.quantize_fixed`), read as one per-channel scale/zero row
    for all T positions (group ONE_ROW): per-channel ranges of +-(1.5 .. 2.5), so some entries fall outside them."""
    b, h, t, d = x.shape
    spread = torch.linspace(1.5, 2.5, h * d).reshape(h, d)
    lo, hi = -spread, spread
    zero, scale = fixed_range(lo, hi, 1 if cb is not None else 2**bits - 1, torch.float16)
    codes, out_val, out_idx, _ = torch.ops.kvq.quantize_fixed(x, bits, zero, scale, cb if cb is not None else torch.zeros(0),
                                                              lo, hi, outliers)  # fmt: skip
    row = lambda m: m[None, :, None, :].expand(b, h, 1, d).contiguous()  # noqa: E731
    return codes, row(scale), row(zero), out_val, out_idx, ONE_ROW


def operand(x, side, bits, axis, group, codebook=False, outliers=0, query_bits=0, meta8=False, dtype=torch.float32) -> Operand:
    """K or V of x [B, H, T, D] (float32) in a format with side entries `side`, as an attention
    operand (bits 0: a float body; group FIXED with the channel axis: calibrated ranges;
    query_bits 8 / 16: keys scored against an int8 / int16 query; meta8: 8-bit scale and zero,
    per-token groups, at the format's default exponent).
    Outlier thresholds of +-1.5 make a few entries per vector outliers; model-dtype fields (a float
    body, outlier values) are in `dtype`."""
    fixed = group == FIXED and axis == AXIS_CHANNEL and bits
    group = 16 if group == FIXED and not fixed else group
    meta = meta_ints(default_meta_exponent(bits, codebook and bits <= 4)) if meta8 else FLOAT_META
    fields = dict(bits=bits, axis=axis, group=group, query_bits=query_bits, meta=meta, codes=x.to(dtype), scale=None, zero=None,
                  codebook=None, out_val=None, out_idx=None, side=side.to(dtype))  # fmt: skip
    if bits:
        cb = nf_codebook(bits) if codebook and bits <= 4 else None
        h, d = x.shape[1], x.shape[-1]
        lo, hi = (-1.5 * torch.ones(h, d), 1.5 * torch.ones(h, d)) if outliers else (torch.zeros(0), torch.zeros(0))
        if fixed:
            codes, scale, zero, out_val, out_idx, fields["group"] = _fixed_ranges(x, bits, cb, outliers)
        else:
            codes, scale, zero, out_val, out_idx, _ = torch.ops.kvq.quantize(
                x, format_ints(bits, axis, group, 0, meta), torch.float16, cb if cb is not None else torch.zeros(0), lo, hi, outliers
            )
        fields.update(codes=codes, scale=scale, zero=zero, codebook=cb)
        if outliers:
            fields.update(out_val=out_val.to(dtype), out_idx=out_idx)
    return Operand(**fields)


def attention_case(seed, tq, bits_k=4, bits_v=4, k_axis=AXIS_CHANNEL, v_axis=AXIS_TOKEN, hq=6, hkv=2, t=64, d=32, n_side=5,
          body_start=1, body_end=40, head_mask=False, codebook=False, outliers=0, pre_rope=False, softcap=0.0):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, hq, tq, d, generator=g)
    k = torch.randn(2, hkv, t, d, generator=g) * 2
    v = torch.randn(2, hkv, t, d, generator=g)
    side_k = torch.randn(2, hkv, n_side, d, generator=g)
    side_v = torch.randn(2, hkv, n_side, d, generator=g)
    # sink at position 0, window positions 40..42, one empty slot
    side_pos = torch.tensor([0, 40, 41, 42, -1])
    total = 43
    q_pos = torch.arange(total - tq, total)
    mask = (torch.arange(t)[None, :] <= q_pos[:, None]).expand(2, hq if head_mask else 1, tq, t).clone()
    if head_mask:
        mask[:, 1, :, 5:9] = False
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)) if pre_rope else None
    named = dict(q=q, side_pos=side_pos, body_end=torch.tensor(body_end), mask=mask,
                 rope_inv_freq=inv_freq, body_start=body_start, scaling=d**-0.5, rope_scale=1.25 if pre_rope else 1.0,
                 softcap=softcap)  # fmt: skip
    named["k"] = operand(k, side_k, bits_k, k_axis, 16, codebook, outliers)
    named["v"] = operand(v, side_v, bits_v, v_axis, 16, codebook, outliers)
    return named


def _rotate64(x, positions, inv_freq, scale):
    """RoPE in float64, written out as the rotation of channel pairs (i, i + D/2)."""
    half = x.shape[-1] // 2
    ang = positions.double()[:, None] * inv_freq.double()[None, :]
    c, s = torch.cos(ang) * scale, torch.sin(ang) * scale
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


QUERY_STEPS = {8: 127, 16: 127 * 256}  # the integer query's steps a side, by query_bits (kvq_ao/format.py's docstring)


def int_scores64(q, k: Operand):
    """The integer-query key scores (`kvq_ao.format`) of q [B, Hq, Tq, D] over k's body [B, Hkv, T, D],
    written out independently of the kernels: the query's rounding in float32 as the format fixes
    it, everything after it in float64 -> [B, Hq, Tq, T]."""
    steps = QUERY_STEPS[k.query_bits]
    levels = dequantize_operand(k.replace(scale=torch.ones_like(k.scale), zero=torch.zeros_like(k.zero), out_val=None, out_idx=None),
                                torch.float64)  # the integer codes  # fmt: skip
    dense = dequantize_operand(k.replace(out_val=None, out_idx=None), torch.float64)
    exact = dequantize_operand(k, torch.float64)
    b, hkv, t, d = levels.shape
    n = q.shape[1] // hkv
    per_row = t if k.group == ONE_ROW else k.group
    out = torch.zeros(b, q.shape[1], q.shape[2], t, dtype=torch.float64)
    for r in range(t // per_row):
        tok = slice(r * per_row, (r + 1) * per_row)
        sc = k.scale[:, :, r].float().repeat_interleave(n, 1)[:, :, None]  # [B, Hq, 1, D]
        zc = k.zero[:, :, r].double().repeat_interleave(n, 1)[:, :, None]
        qs = q.float() * sc
        top = qs.abs().amax(-1, keepdim=True)
        inv = torch.where(top > 0, torch.tensor(float(steps)) / top, torch.zeros_like(top))  # float32, as the format says
        qi = torch.round(qs * inv).double()
        lv = levels[:, :, tok].repeat_interleave(n, 1)
        corr = (exact - dense)[:, :, tok].repeat_interleave(n, 1)
        out[..., tok] = (top.double() / steps) * (qi @ lv.transpose(-1, -2)) + (q.double() * zc).sum(-1, keepdim=True) \
            + q.double() @ corr.transpose(-1, -2)
    return out


def reference_attention(named, position_offset: int = 0, with_lse: bool = False):
    """float64: build logical K/V (body in [start, end), side elsewhere) and do softmax attention.

    position_offset shifts the RoPE positions (a shard of a longer sequence); with_lse also returns
    each query's log-sum-exp of its scaled scores [B, Hq, Tq] (-inf where it sees nothing)."""
    a = reference_arguments(named)
    k = dequantize_operand(a["k"], torch.float64)
    v = dequantize_operand(a["v"], torch.float64)
    side_k, side_v, side_pos = a["k"].side.double(), a["v"].side.double(), a["side_pos"]
    t = k.shape[2]
    if a["rope_inv_freq"].numel():  # keys stored pre-RoPE: rotate every key at its own position
        k = _rotate64(k, torch.arange(t) + position_offset, a["rope_inv_freq"], a["rope_scale"])
        side_k = _rotate64(side_k, side_pos.clamp(min=0) + position_offset, a["rope_inv_freq"], a["rope_scale"])
    body_start, q = a["body_start"], a["q"]
    ends = a["body_end"].reshape(-1).tolist()  # one body end for all queries, or one per query
    outs, lses = [], []
    for i in range(q.shape[2]):  # each query reads the logical K/V of its own body end
        body_end = ends[i if len(ends) > 1 else 0]
        ki, vi = k.clone(), v.clone()
        valid = torch.zeros(t, dtype=torch.bool)
        valid[body_start:body_end] = True
        for j, p in enumerate(side_pos.tolist()):
            if p >= 0 and not (body_start <= p < body_end):
                ki[:, :, p], vi[:, :, p] = side_k[:, :, j], side_v[:, :, j]
                valid[p] = True
        n = q.shape[1] // k.shape[1]
        ki, vi = ki.repeat_interleave(n, 1), vi.repeat_interleave(n, 1)
        scores = q[:, :, i : i + 1].double() @ ki.transpose(-1, -2)
        if a["k"].int_query:  # body positions the query reads from the body: scored from the codes
            in_body = torch.zeros(t, dtype=torch.bool)
            in_body[body_start:body_end] = True
            scores = torch.where(in_body, int_scores64(q[:, :, i : i + 1], a["k"]), scores)
        scores = scores * a["scaling"]
        if a["softcap"]:  # Gemma-2's attention logit soft-capping
            scores = a["softcap"] * torch.tanh(scores / a["softcap"])
        scores = scores.masked_fill(~(a["mask"][:, :, i : i + 1] & valid), float("-inf"))
        outs.append(torch.softmax(scores, -1).nan_to_num(0.0) @ vi)  # a query that sees nothing gets zeros
        lses.append(torch.logsumexp(scores, -1))
    out = torch.cat(outs, dim=2)
    return (out, torch.cat(lses, dim=2)) if with_lse else out


TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def native_case(seed, *, k_fmt=(4, AXIS_CHANNEL, 16, False, 0), v_fmt=(4, AXIS_TOKEN, 16, False, 0), hkv=2, ratio=3,
                d=64, blocks=5, body_end=None, side="some", batch=2, left_pad=0, window=0, head_mask=False,
                pre_rope=False, softcap=0.0, dtype=torch.float32):  # fmt: skip
    """Named decode-attention arguments; the cache holds `blocks` blocks of 16 tokens."""
    g = torch.Generator().manual_seed(seed)
    t = 16 * blocks
    hq = hkv * ratio
    length = t if body_end is None else body_end + 3  # the query's position + 1
    body_end = t - 5 if body_end is None else body_end
    k = torch.randn(batch, hkv, t, d, generator=g) * 2
    v = torch.randn(batch, hkv, t, d, generator=g)
    named = {"q": torch.randn(batch, hq, 1, d, generator=g).to(dtype)}
    positions = {"empty": [], "some": [0, *range(body_end, min(length, t))], "full": list(range(t))}[side]
    n_side = max(len(positions), 1) + 1
    side_pos = torch.full((n_side,), -1, dtype=torch.int64)
    side_pos[: len(positions)] = torch.tensor(positions, dtype=torch.int64)
    side_k = torch.randn(batch, hkv, n_side, d, generator=g)
    side_v = torch.randn(batch, hkv, n_side, d, generator=g)
    named["k"] = operand(k, side_k, *k_fmt, dtype=dtype)
    named["v"] = operand(v, side_v, *v_fmt, dtype=dtype)
    named["side_pos"] = side_pos
    named["body_end"] = torch.tensor(body_end)
    pos = torch.arange(t)
    mask = (pos < length).expand(batch, hq if head_mask else 1, 1, t).clone()
    for b in range(batch):  # left padding grows with the batch row
        mask[b, :, :, : left_pad * b] = False
    if window:
        mask &= pos > length - 1 - window
    if head_mask:
        mask[:, 1::2, :, 3:20] = False
    named["mask"] = mask
    named["rope_inv_freq"] = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float32) / d)) if pre_rope else None
    named.update(body_start=1, scaling=d**-0.5, rope_scale=1.25 if pre_rope else 1.0, softcap=softcap)
    return named


FORMATS = st and st.tuples(
    st.sampled_from([0, 2, 3, 4, 8]),  # bits (0: a float body)
    st.sampled_from([AXIS_TOKEN, AXIS_CHANNEL]),
    st.sampled_from([8, 16, FIXED]),  # group (FIXED: calibrated per-channel ranges)
    st.booleans(),  # codebook levels (2-4 bits)
    st.sampled_from([0, 0, 1, 2]),  # outlier slots per vector
)


STREAM_FORMATS = [  # (bits, axis, codebook, outliers[, group: 16 unless given])
    (0, AXIS_TOKEN, False, 0),
    (2, AXIS_CHANNEL, False, 0),
    (3, AXIS_CHANNEL, True, 1),
    (4, AXIS_TOKEN, False, 0),
    (2, AXIS_TOKEN, True, 2),
    (8, AXIS_CHANNEL, False, 0),
    (4, AXIS_CHANNEL, False, 1),
    (3, AXIS_CHANNEL, True, 1, FIXED),
    (2, AXIS_CHANNEL, False, 0, FIXED),
]


def bounds_for(batch: int, q_pos: torch.Tensor, pad: list[int], window: int | None) -> torch.Tensor:
    lo = torch.tensor(pad).view(-1, 1).expand(batch, q_pos.numel())
    if window:
        lo = torch.maximum(lo, q_pos.view(1, -1) - window + 1)
    hi = (q_pos + 1).view(1, -1).expand(batch, -1)
    return torch.stack([torch.minimum(lo, hi), hi], -1).unsqueeze(1)


def streaming_case(seed, tq, k_fmt, v_fmt, hq=6, hkv=2, d=32, window=None, pad=(0, 0), pre_rope=False, softcap=0.0,
                   length=None, sink=1, residual=7, per_query=False, k_query_bits=0, meta8=False):  # fmt: skip
    """A layer's cache of `length` tokens (capacity rounded up to 16s) with `tq` queries at its end:
    sink position 0 and the last `residual`-ish positions in the side store, the rest in the body.
    per_query: each query has its own body end (as the cache gives a prefill chunk), and the side
    store holds everything from the first query's body end on. k_query_bits 8 / 16: keys scored
    against an int8 / int16 query. meta8: per-token groups store 8-bit scale and zero."""
    g = torch.Generator().manual_seed(seed)
    length = length or max(tq, 1) + 40
    t = -(-length // 16) * 16 + 16
    q_pos = torch.arange(length - tq, length)
    ends = torch.clamp(q_pos + 1 - residual, min=0) // 16 * 16
    body_end = int(ends[0]) if per_query else max((length - residual) // 16 * 16, 0)
    side = [0] + list(range(max(body_end, 1), length)) if sink else list(range(body_end, length))
    side_pos = torch.tensor(side + [-1])  # one empty slot
    q = torch.randn(2, hq, tq, d, generator=g)
    sides = {"k": torch.randn(2, hkv, len(side_pos), d, generator=g), "v": torch.randn(2, hkv, len(side_pos), d, generator=g)}
    named = dict(q=q, side_pos=side_pos,
                 body_end=ends if per_query else torch.tensor(body_end), body_start=sink, scaling=d**-0.5, softcap=softcap,
                 rope_inv_freq=(1.0 / 10000.0 ** (torch.arange(0, d, 2).float() / d)) if pre_rope else None,
                 rope_scale=1.25 if pre_rope else 1.0)  # fmt: skip
    for prefix, (bits, axis, codebook, outliers, *group), scale in (("k", k_fmt, 2.0), ("v", v_fmt, 1.0)):
        x = torch.randn(2, hkv, t, d, generator=g) * scale
        named[prefix] = operand(x, sides[prefix], bits, axis, group[0] if group else 16, codebook,
                                outliers if axis == AXIS_CHANNEL or bits else 0, meta8=meta8 and bits > 0 and axis == AXIS_TOKEN)  # fmt: skip
    named["k"] = named["k"].replace(query_bits=k_query_bits)
    named["mask"] = bounds_for(2, torch.arange(length - tq, length), list(pad), window)
    return named


def expected_streaming(named: dict) -> torch.Tensor:
    """The float64 reference of a streaming case (its bounds mask made dense)."""
    dense = dict(named, mask=masks.dense(named["mask"], named["k"].codes.shape[2]))
    return reference_attention(dense)


def quantize_case(seed, bits, axis, group, codebook, outliers, dtype=torch.float32, t=48):
    """Arguments of kvq.quantize (scale dtype left out: x, format, codebook, lo, hi, k) for
    outliers "none", "channel" (thresholds +-1.5) or "vector" (judged per vector)."""
    from kvq_ao.quant.codebook import nf_codebook

    x = (torch.randn(2, 3, t, 64, generator=torch.Generator().manual_seed(seed)) * 2).to(dtype)
    lo = hi = torch.zeros(0)
    if outliers == "channel":
        lo, hi = -1.5 * torch.ones(3, 64), 1.5 * torch.ones(3, 64)
    k = {"none": 0, "channel": 2, "vector": 2}[outliers]
    return x, format_ints(bits, axis, group), nf_codebook(bits) if codebook else torch.zeros(0), lo, hi, k


# ------------------------------------------------------------------- the conformance suite's cases
# (tests/kernels/test_conformance.py runs them on every backend here; benchmarks/gpu.py on CUDA)
K4, V4 = (4, AXIS_CHANNEL, 16, False, 0), (4, AXIS_TOKEN, 16, False, 0)
DECODE_CASES = {  # id -> native_case keywords: every format, then shapes, masks, softcap, dtypes
    **{f"k{b}v{b}-{'codebook' if cb else 'uniform'}": dict(k_fmt=(b, AXIS_CHANNEL, 16, cb, 0), v_fmt=(b, AXIS_TOKEN, 16, cb, 0))
       for b in (2, 3, 4, 8) for cb in ((False, True) if b <= 4 else (False,))},
    "float-bodies": dict(k_fmt=(0, AXIS_TOKEN, 16, False, 0), v_fmt=(0, AXIS_TOKEN, 16, False, 0)),
    "calibrated-key-rows": dict(k_fmt=(3, AXIS_CHANNEL, FIXED, True, 1), v_fmt=(3, AXIS_TOKEN, 64, False, 1), pre_rope=True),
    "calibrated-key-rows-uniform": dict(k_fmt=(2, AXIS_CHANNEL, FIXED, False, 0), blocks=9),
    "outlier-slots": dict(k_fmt=(4, AXIS_CHANNEL, 16, False, 2), v_fmt=(4, AXIS_TOKEN, 16, False, 1)),
    "per-token-keys-per-channel-values": dict(k_fmt=(4, AXIS_TOKEN, 16, False, 1), v_fmt=(4, AXIS_CHANNEL, 16, False, 0)),
    "k8v2-g32": dict(k_fmt=(8, AXIS_CHANNEL, 32, False, 0), v_fmt=(2, AXIS_TOKEN, 32, False, 0), blocks=4),
    "k2v8-g32": dict(k_fmt=(2, AXIS_CHANNEL, 32, False, 0), v_fmt=(8, AXIS_TOKEN, 32, False, 0), blocks=6),
    "pre-rope-codebook-outliers": dict(k_fmt=(3, AXIS_CHANNEL, 16, True, 2), v_fmt=(3, AXIS_TOKEN, 16, True, 1), pre_rope=True),
    **{f"pre-rope-k{b}-{'codebook' if cb else 'uniform'}-outliers": dict(  # scale rows change mid-tile, a tile cut short
        k_fmt=(b, AXIS_CHANNEL, 16, cb, 2 if cb else 3), v_fmt=(b, AXIS_TOKEN, 8, cb, 1), pre_rope=True, blocks=9,
        body_end=16 * 9 - 5, head_mask=True, d=128 if b == 8 else 64) for b in (2, 3, 4, 8) for cb in (False, True)},
    # 2- and 3-bit pre-RoPE keys scored with a lane a token (AVX-512 VBMI): uniform levels, scale rows
    # every 8 tokens (blocks cut short), passes of 4 + 1 heads; no outlier slots over many tiles; two
    # slots, one head; 2-bit codebooks with one slot (kvquant-2-1pct's keys)
    "pre-rope-k3-lanes-uniform-g8-gqa5": dict(k_fmt=(3, AXIS_CHANNEL, 8, False, 1), v_fmt=(3, AXIS_TOKEN, 16, False, 0), pre_rope=True,
                                              ratio=5, hkv=1, blocks=9, body_end=16 * 9 - 5, head_mask=True),
    "pre-rope-k3-lanes-no-slots-many-tiles": dict(k_fmt=(3, AXIS_CHANNEL, 32, True, 0), pre_rope=True, ratio=2, blocks=20, window=150),
    "pre-rope-k3-lanes-two-slots-gqa1": dict(k_fmt=(3, AXIS_CHANNEL, 16, False, 2), pre_rope=True, ratio=1, blocks=7, left_pad=9),
    "pre-rope-k2-lanes-codebook-calibrated-rows": dict(k_fmt=(2, AXIS_CHANNEL, FIXED, True, 1), v_fmt=(2, AXIS_TOKEN, 64, True, 0),
                                                       pre_rope=True, blocks=9, head_mask=True),
    "pre-rope-k2-lanes-uniform-g8-gqa5-many-tiles": dict(k_fmt=(2, AXIS_CHANNEL, 8, False, 2), pre_rope=True, ratio=5, hkv=1,
                                                         blocks=20, body_end=16 * 20 - 7, window=200),
    "values-one-group-a-vector": dict(k_fmt=(3, AXIS_CHANNEL, FIXED, True, 1), v_fmt=(3, AXIS_TOKEN, 64, True, 0), pre_rope=True,
                                      blocks=9),  # kvquant-3-1pct's formats: value scales folded into P
    "values-one-group-a-vector-uniform-fp16": dict(k_fmt=K4, v_fmt=(2, AXIS_TOKEN, 64, False, 0), dtype=torch.float16),
    "values-one-group-a-vector-d128": dict(ratio=1, d=128, k_fmt=K4, v_fmt=(4, AXIS_TOKEN, 128, False, 0)),
    "gqa1-d128": dict(ratio=1, d=128, k_fmt=K4, v_fmt=V4),
    "gqa3-d128-many-blocks": dict(hkv=1, batch=1, ratio=3, d=128, blocks=52, k_fmt=(2, AXIS_CHANNEL, 16, False, 0),
                                  v_fmt=(2, AXIS_TOKEN, 16, False, 0)),
    "gqa8-d64": dict(ratio=8, hkv=1, k_fmt=K4, v_fmt=V4),
    "gqa3-d256": dict(ratio=3, hkv=1, d=256, k_fmt=(2, AXIS_CHANNEL, 16, False, 0), v_fmt=(2, AXIS_TOKEN, 16, False, 0)),
    "many-tiles": dict(hkv=2, ratio=3, blocks=74, k_fmt=(2, AXIS_CHANNEL, 16, False, 0), v_fmt=(2, AXIS_TOKEN, 16, False, 0)),
    "left-padding-window-head-mask": dict(left_pad=21, window=40, head_mask=True),
    "side-empty": dict(side="empty"),
    "side-full": dict(side="full"),
    "softcap": dict(softcap=2.5, pre_rope=True),
    "float16": dict(dtype=torch.float16, head_mask=True),
    "bfloat16": dict(dtype=torch.bfloat16, pre_rope=True, k_fmt=(3, AXIS_CHANNEL, 16, True, 2), v_fmt=(4, AXIS_TOKEN, 16, False, 1)),
    # keys scored against an int8 query (k_fmt's 6th field: query_bits): 16-row blocks of 2 and 4 bits
    # at head_dim 64 (AVX-512 VNNI), the portable loop for the rest, outliers, calibrated rows
    "int8-query-k4": dict(k_fmt=(4, AXIS_CHANNEL, 16, False, 0, 8), blocks=7),
    "int8-query-k2-g32-outliers": dict(k_fmt=(2, AXIS_CHANNEL, 32, False, 2, 8), v_fmt=(2, AXIS_TOKEN, 32, False, 0), blocks=8,
                                       head_mask=True),
    "int8-query-k3-g8-bf16": dict(k_fmt=(3, AXIS_CHANNEL, 8, False, 1, 8), dtype=torch.bfloat16, window=40),
    "int8-query-k8-calibrated-rows-softcap": dict(k_fmt=(8, AXIS_CHANNEL, FIXED, False, 1, 8), blocks=9, softcap=2.5),
    "int8-query-k4-gqa8-d128": dict(k_fmt=(4, AXIS_CHANNEL, 16, False, 0, 8), ratio=8, hkv=1, d=128, blocks=6),
    # ... and against an int16 query (query_bits 16: two int8 digits on AVX-512 VNNI / AVX2), the same shapes
    "int16-query-k4": dict(k_fmt=(4, AXIS_CHANNEL, 16, False, 0, 16), blocks=7),
    "int16-query-k2-g32-outliers": dict(k_fmt=(2, AXIS_CHANNEL, 32, False, 2, 16), v_fmt=(2, AXIS_TOKEN, 32, False, 0), blocks=8,
                                        head_mask=True),
    "int16-query-k3-g8-bf16": dict(k_fmt=(3, AXIS_CHANNEL, 8, False, 1, 16), dtype=torch.bfloat16, window=40),
    "int16-query-k8-calibrated-rows-softcap": dict(k_fmt=(8, AXIS_CHANNEL, FIXED, False, 1, 16), blocks=9, softcap=2.5),
    "int16-query-k2-gqa8-d128": dict(k_fmt=(2, AXIS_CHANNEL, 16, False, 0, 16), ratio=8, hkv=1, d=128, blocks=6),
    # 8-bit scale and zero (k_fmt's 7th field) in per-token groups: a group a vector (rotated formats),
    # two a vector, codebooks, outliers, pre-RoPE keys, float16
    **{f"meta8-k{b}v{b}-{'codebook' if cb else 'uniform'}": dict(k_fmt=(b, AXIS_TOKEN, 64, cb, 0, 0, True),
                                                                v_fmt=(b, AXIS_TOKEN, 64, cb, 0, 0, True))
       for b in (2, 3, 4, 8) for cb in ((False, True) if b <= 4 else (False,))},
    "meta8-g32-outliers": dict(k_fmt=(4, AXIS_TOKEN, 32, False, 1, 0, True), v_fmt=(3, AXIS_TOKEN, 32, True, 1, 0, True), blocks=9,
                               head_mask=True),
    "meta8-pre-rope-keys-g16": dict(k_fmt=(3, AXIS_TOKEN, 16, True, 0, 0, True), v_fmt=(2, AXIS_TOKEN, 16, False, 0, 0, True),
                                    pre_rope=True, blocks=9, body_end=16 * 9 - 5),
    "meta8-values-calibrated-key-rows-pre-rope": dict(k_fmt=(3, AXIS_CHANNEL, FIXED, True, 1), v_fmt=(2, AXIS_TOKEN, 64, False, 0, 0, True),
                                                      pre_rope=True, blocks=9),
    # keys in per-token groups of one group a vector (the rotated presets' layout), scored from their codes:
    # float16 metadata with outliers and codebooks, the 2-bit token-lane path over many tiles, 3-bit
    # plane pairs, and passes of 4 + 1 heads at head_dim 128
    "vector-keys-codebook-outliers": dict(k_fmt=(4, AXIS_TOKEN, 64, True, 2), v_fmt=(3, AXIS_TOKEN, 64, True, 0), blocks=9,
                                          head_mask=True),
    "vector-keys-k2-many-tiles": dict(hkv=1, batch=1, blocks=74, k_fmt=(2, AXIS_TOKEN, 64, False, 0), v_fmt=(2, AXIS_TOKEN, 64, False, 0)),
    "vector-keys-k3-outliers-bf16": dict(k_fmt=(3, AXIS_TOKEN, 64, True, 1), dtype=torch.bfloat16, window=40),
    "vector-keys-k8-gqa5-d128": dict(k_fmt=(8, AXIS_TOKEN, 128, False, 1), ratio=5, hkv=1, d=128, blocks=6),
    # two groups a vector (the rotated presets at head_dim 128): dequantized into a tile and scored there
    "vector-keys-two-groups-d128": dict(k_fmt=(4, AXIS_TOKEN, 64, True, 2), ratio=3, hkv=2, d=128, blocks=9, head_mask=True),
    "vector-keys-two-groups-k2-meta8": dict(k_fmt=(2, AXIS_TOKEN, 32, False, 0, 0, True), v_fmt=(2, AXIS_TOKEN, 32, False, 0, 0, True),
                                            blocks=9),
    "meta8-float16-d128": dict(ratio=1, d=128, k_fmt=(4, AXIS_TOKEN, 128, False, 0, 0, True), v_fmt=(4, AXIS_TOKEN, 128, False, 0, 0, True),
                               dtype=torch.float16),
}


def decode_case(case_id: str) -> dict:
    return native_case(sum(map(ord, case_id)) % 1000, **DECODE_CASES[case_id])


CHUNK_CASES = {  # id -> streaming_case arguments (tq, k format, v format, keywords)
    "causal-k2-v4": (5, STREAM_FORMATS[1], STREAM_FORMATS[3], {}),
    "per-query-ends-pre-rope": (33, STREAM_FORMATS[2], STREAM_FORMATS[3], dict(per_query=True, pre_rope=True)),
    "window-padding-softcap": (16, STREAM_FORMATS[6], STREAM_FORMATS[4], dict(window=9, pad=(0, 3), softcap=5.0)),
    "calibrated-key-rows": (21, STREAM_FORMATS[7], STREAM_FORMATS[3], dict(length=200, pre_rope=True, per_query=True)),
    "calibrated-key-rows-uniform": (5, STREAM_FORMATS[8], STREAM_FORMATS[4], {}),
    "float-bodies-gqa8": (5, STREAM_FORMATS[0], STREAM_FORMATS[0], dict(hq=8, hkv=1)),
    "k8-gqa1": (2, STREAM_FORMATS[5], STREAM_FORMATS[3], dict(hq=2, hkv=2, pad=(20, 0))),
    "many-blocks": (40, STREAM_FORMATS[2], STREAM_FORMATS[3], dict(length=300, pre_rope=True, per_query=True)),
    "int8-query-k4-outliers": (9, STREAM_FORMATS[6], STREAM_FORMATS[3], dict(k_query_bits=8, per_query=True, length=150)),
    "int8-query-calibrated-rows": (5, STREAM_FORMATS[8], STREAM_FORMATS[4], dict(k_query_bits=8, window=30)),
    "int16-query-k4-outliers": (9, STREAM_FORMATS[6], STREAM_FORMATS[3], dict(k_query_bits=16, per_query=True, length=150)),
    "int16-query-k2-per-query-ends": (17, STREAM_FORMATS[1], STREAM_FORMATS[4], dict(k_query_bits=16, per_query=True, length=120)),
    "meta8-values-per-query-ends-pre-rope": (33, STREAM_FORMATS[2], STREAM_FORMATS[4], dict(meta8=True, per_query=True, pre_rope=True)),
    "meta8-token-keys-and-values": (9, (3, AXIS_TOKEN, True, 1, 32), STREAM_FORMATS[3], dict(meta8=True, window=20, length=150)),
}


def chunk_case(case_id: str) -> dict:
    tq, k_fmt, v_fmt, kw = CHUNK_CASES[case_id]
    return streaming_case(sum(map(ord, case_id)) % 1000, tq, k_fmt, v_fmt, **kw)


