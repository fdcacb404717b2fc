"""Composite (core ATen only) implementations of the kvq ops.

These are the reference semantics of every op and what CPU runs today; they are written so
that inductor can fuse them and torch.export / ExecuTorch / ONNX can take them: no bit shifts,
no `torch.tensor` constants, no data-dependent Python control flow.

Cache layout read by `attention` (one layer, one of K or V):
* body: all positions [0, T) of the layer's capacity, as packed codes + scale + zero
  (a float format, `kvq_ao.format.is_float`, means the body is already floating point and
  scale/zero are empty); each of K and V is an `Operand` (`kvq_ao.format`);
  only positions in [body_start, body_end) are read from it. A non-empty `codebook` means
  non-uniform levels (`kvq_ao.quant.codebook`); `out_val`/`out_idx` [.., T, k] are the exact
  outliers of each vector (`kvq_ao.quant.outliers`; k = 0 when unused).
* keys may be stored before RoPE: a non-empty `rope_inv_freq` rotates them at their own
  positions after dequantization (`kvq_ao.quant.rope`).
* side: full-precision entries (sink tokens and the recent window) with their positions in
  `side_pos` (-1 = empty); an entry is read when its position is outside [body_start, body_end).
  For a chunk of queries body_end may be [Tq], one per query: each query then reads the cache as
  decoding at its position would (recent keys of the chunk and before it in full precision).
"""

from __future__ import annotations

import math

import torch

from kvq_ao import masks
from kvq_ao.quant.codebook import dequantize_codebook, nearest_level, quantize_codebook
from kvq_ao.quant.packing import pack, unpack_float
from kvq_ao.quant.outliers import apply_outliers, split_outliers, split_vector_outliers
from kvq_ao.quant.rope import cos_sin, rotate, rotate_with
from kvq_ao.format import AXIS_CHANNEL, Operand, format_of, is_float, is_one_row, query_levels, tokens_per_group
from kvq_ao.quant.uniform import dequantize_uniform, quantize_uniform


def quantize(x: torch.Tensor, format: list[int], scale_dtype: torch.dtype, codebook: torch.Tensor,
             lo: torch.Tensor, hi: torch.Tensor, n_outliers: int):  # fmt: skip
    """x in `format` (an operand's format numbers) -> (codes, scale, zero, out_val [.., T, k],
    out_idx [.., T, k] uint8, clamped int64 count).

    Outliers are judged by the channel ranges lo/hi, or per vector when lo/hi are empty.
    """
    bits, axis, group, _, meta = format_of(format)
    if n_outliers > 0 and lo.numel() == 0:
        dense, out_val, out_idx, _ = split_vector_outliers(x, n_outliers, group)
        clamped = x.new_zeros([], dtype=torch.int64)  # every vector keeps all k of its outliers
    elif n_outliers > 0:
        dense, out_val, out_idx, clamped = split_outliers(x, lo, hi, n_outliers)
    else:
        dense = x
        out_val = x.new_zeros([*x.shape[:-1], 0])
        out_idx = x.new_zeros([*x.shape[:-1], 0], dtype=torch.uint8)
        clamped = x.new_zeros([], dtype=torch.int64)
    if codebook.numel() > 0:
        codes, scale, zero = quantize_codebook(dense, codebook, bits, axis, group, scale_dtype, meta)
    else:
        codes, scale, zero = quantize_uniform(dense, bits, axis, group, scale_dtype, meta)
    return codes, scale, zero, out_val, out_idx, clamped


def quantize_fixed(x: torch.Tensor, bits: int, zero: torch.Tensor, scale: torch.Tensor, codebook: torch.Tensor,
                   lo: torch.Tensor, hi: torch.Tensor, n_outliers: int):  # fmt: skip
    """x [B, H, T, D] against fixed per-channel ranges -> (codes, out_val, out_idx, clamped).

    Each entry is clamped into its channel's [lo, hi] (the up to n_outliers per vector furthest
    outside it kept exact) and coded against zero/scale [H, D] (from `fixed_range(lo, hi)`), so a
    token needs no statistics of other tokens and no metadata of its own. clamped: entries outside
    their range that were not kept exact.
    """
    if n_outliers > 0:
        dense, out_val, out_idx, clamped = split_outliers(x, lo, hi, n_outliers)
    else:
        lo4, hi4 = lo.float()[None, :, None, :], hi.float()[None, :, None, :]
        xf = x.float()
        dense = torch.minimum(torch.maximum(xf, lo4), hi4)
        out_val = x.new_zeros([*x.shape[:-1], 0])
        out_idx = x.new_zeros([*x.shape[:-1], 0], dtype=torch.uint8)
        clamped = ((xf < lo4) | (xf > hi4)).sum()
    z, s = zero.float()[None, :, None, :], scale.float()[None, :, None, :]
    u = (dense - z) / torch.where(s > 0, s, torch.ones_like(s))
    if codebook.numel() > 0:
        codes = nearest_level(u, codebook)
    else:
        codes = torch.round(u).clamp(0.0, float(2**bits - 1))
    return pack(codes.to(torch.uint8), bits), out_val, out_idx, clamped


def dequantize_operand(o: Operand, dtype: torch.dtype, select_levels: bool = False) -> torch.Tensor:
    """One operand's body [B, H, T, D] in dtype (the side store is not read). An absent (None or
    empty) codebook means uniform levels, absent outliers none."""
    if is_float(o.bits):
        return o.codes.to(dtype)
    if o.codebook is not None and o.codebook.numel() > 0:
        x = dequantize_codebook(o.codes, o.scale, o.zero, o.codebook, o.bits, o.axis, o.group, torch.float32, select_levels, o.meta)
    else:
        x = dequantize_uniform(o.codes, o.scale, o.zero, o.bits, o.axis, o.group, torch.float32, o.meta)
    if o.out_val is not None:
        x = apply_outliers(x, o.out_val, o.out_idx)
    return x.to(dtype)


def dequantize(operand: list, format: list, dtype: torch.dtype) -> torch.Tensor:
    """`kvq.dequantize`: an operand's lists (`kvq_ao.format`) -> its body in dtype."""
    return dequantize_operand(Operand.from_lists(operand, format), dtype)


def int_query_scores(q: torch.Tensor, k: Operand) -> torch.Tensor:
    """Key scores of queries q [B, Hkv, n, Tq, D] over k's body in an integer-query format
    (`kvq_ao.format`, query_bits INT8_QUERY or INT16_QUERY) -> [B, Hkv, n, Tq, T] float32, unscaled.

    For each query and scale row r: qs = q * scale_r, rounded to L steps a side against its largest
    entry, then (m / L) * (qi . code) + q . zero_r, plus q_c * (exact - dense) for each exact outlier.
    An int16 query is taken as two int8 digits (qi = 256 hi + lo) whose dot products, integers below
    2^24 for D <= 512, are exact in float32; their sum is the int32 dot product rounded once, as the
    native kernels' conversion of it.
    """
    codes = unpack_float(k.codes, k.bits)  # [B, Hkv, T, D] integer levels
    b, h, t, d = codes.shape
    per_row = tokens_per_group(k.axis, k.group, t)
    rows = t // per_row
    levels = query_levels(k.query_bits)
    scale, zero = k.scale.float(), k.zero.float()  # [B, Hkv, rows, D]
    qs = q.unsqueeze(-2) * scale[:, :, None, None]  # [B, Hkv, n, Tq, rows, D]
    top = qs.abs().amax(-1, keepdim=True)
    qi = torch.where(top > 0, torch.round(qs * (levels / torch.where(top > 0, top, torch.ones_like(top)))), torch.zeros_like(qs))
    grouped = codes.reshape(b, h, rows, per_row, d)
    if levels > 127:  # two int8 digits: hi = floor((qi + 128) / 256), lo = qi - 256 hi
        hi = torch.floor((qi + 128.0) / 256.0)
        lo = qi - 256.0 * hi
        dots = torch.einsum("bhnqrd,bhrgd->bhnqrg", hi, grouped) * 256.0 + torch.einsum("bhnqrd,bhrgd->bhnqrg", lo, grouped)
    else:
        dots = torch.einsum("bhnqrd,bhrgd->bhnqrg", qi, grouped)
    bias = torch.einsum("bhnqd,bhrd->bhnqr", q, zero)
    scores = (dots * (top / levels) + bias.unsqueeze(-1)).flatten(-2)  # [B, Hkv, n, Tq, T]
    if k.out_val is not None and k.out_val.shape[-1] > 0:
        dense = dequantize_operand(k.replace(out_val=None, out_idx=None), torch.float32)
        delta = apply_outliers(dense, k.out_val, k.out_idx) - dense  # exact - dense where a slot holds a channel
        scores = scores + torch.einsum("bhnqd,bhtd->bhnqt", q, delta)
    return scores


TARGETS = ("eager", "export", "inductor")  # who runs `attention`'s graph (see there)


def _unchanged(x: torch.Tensor) -> torch.Tensor:
    return x


def _into_buffer(x: torch.Tensor) -> torch.Tensor:
    """Make inductor compute x into a buffer of its own (it would otherwise inline it into consumers)."""
    from torch._inductor import inductor_prims

    return inductor_prims.force_stride_order(x, x.stride())


def _scores(q: torch.Tensor, k: torch.Tensor, matmul: bool) -> torch.Tensor:
    """q [B, Hkv, n, D] . k [B, Hkv, T, D] -> [B, Hkv, n, T], as a matmul or as a broadcast
    product and a sum (see `attention`'s `target`)."""
    if matmul:
        return torch.einsum("bhnd,bhtd->bhnt", q, k)
    return (q.unsqueeze(3) * k.unsqueeze(2)).sum(-1)


def _weighted_sum(p: torch.Tensor, v: torch.Tensor, matmul: bool) -> torch.Tensor:
    """Weights p [B, Hkv, n, T] times values v [B, Hkv, T, D] -> [B, Hkv, n, D] (see `_scores`)."""
    if matmul:
        return torch.einsum("bhnt,bhtd->bhnd", p, v)
    return (p.unsqueeze(-1) * v.unsqueeze(2)).sum(-2)


def _capped(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """Gemma-2's logit soft-capping, softcap * tanh(s / softcap); softcap 0 leaves the scores."""
    if softcap <= 0:
        return scores
    return torch.tanh(scores / softcap) * softcap


def _masks(mask, side_pos, body_start: int, body_end, t: int):
    """Which body positions and side entries each query may read: ([B,h,Tq,T], [B,h,Tq,S]).
    body_end is 0-dim, or [Tq] (each query's own, see `kvq_ao.cache`)."""
    positions = torch.arange(t, device=mask.device)
    end = body_end.reshape(-1, 1)  # [1 or Tq, 1]
    body_ok = (positions >= body_start) & (positions < end)
    side_ok = (side_pos >= 0) & ((side_pos < body_start) | (side_pos >= end))
    side_cols = mask.index_select(-1, side_pos.clamp(min=0))
    return mask & body_ok, side_cols & side_ok


def attention(
    q: torch.Tensor,
    k: Operand,
    v: Operand,
    side_pos: torch.Tensor,
    body_end: torch.Tensor,
    mask: torch.Tensor,
    rope_inv_freq: torch.Tensor,
    body_start: int,
    scaling: float,
    rope_scale: float,
    softcap: float = 0.0,
    *,
    target: str = "export",
) -> torch.Tensor:
    """Attention of q [B, Hq, Tq, D] over a quantized cache -> [B, Hq, Tq, Dv] in q's dtype.

    GQA: Hq must be a multiple of the cache's Hkv. `mask` is bool [B, 1 or Hq, Tq, T] (True =
    may attend) over the body's T positions; side entries use the mask column of their position.
    Queries with nothing to attend to return zeros (left padding). `softcap` > 0 caps the scaled
    logits as softcap * tanh(s / softcap) before masking (Gemma-2's attention soft-capping).

    `target` says who runs the graph; it changes no value, only its form (each choice measured at
    8192 cached tokens):
    - "inductor" (the decomposition `kvq_ao.ops` registers): q, the cos/sin table and the rotated
      keys go into buffers of their own (inductor otherwise inlines them into the loop over
      cached tokens and recomputes them once per token and query head), codebook levels are
      looked up by selects (vectorizes; a gather does not), and a one-token query's scores and
      weighted sum are broadcast products and sums, which inductor fuses into one loop.
    - "eager" (the eager op): those scores and weighted sum as matmuls, since eager PyTorch
      materializes the products ([heads, T, D] floats): one SmolLM2-shaped layer (3 kv heads x 3
      queries, D 64), 2 threads, 10-22 ms -> 1.6-1.8 ms.
    - "export" (what torch.export traces): the plain products. This op on a batch of 2 such
      layers with 4-bit codes, exported alone, took 174 ms in ExecuTorch's portable kernels as
      products and 269 ms as matmuls (its portable bmm), and 49 vs 48 ms in onnxruntime
      (2026-12-01, 2 cores).
    """
    if target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, got {target!r}")
    if masks.is_bounds(mask):
        mask = masks.dense(mask, k.codes.shape[2])
    side_k, side_v = k.side, v.side
    for_inductor, matmul = target == "inductor", target == "eager"
    realize = _into_buffer if for_inductor else _unchanged
    q = realize(q)
    b, hq, tq, d = q.shape
    k_operand = k
    # integer-query keys (int8 or int16) are scored from their codes: their float body is never needed
    k = None if k_operand.int_query else dequantize_operand(k, torch.float32, for_inductor)
    v = dequantize_operand(v, torch.float32, for_inductor)
    hkv, t = k_operand.codes.shape[1], k_operand.codes.shape[2]
    sk, sv = side_k.float(), side_v.float()
    pre_rope = rope_inv_freq.numel() > 0  # keys stored before RoPE: rotate each at its own position
    if pre_rope:
        sk = rotate(sk, side_pos.clamp(min=0), rope_inv_freq, rope_scale)
    n = hq // hkv
    body_mask, side_mask = _masks(mask, side_pos, body_start, body_end, t)
    qf = q.float().reshape(b, hkv, n, tq, d)
    if tq == 1:
        # Pointwise + reductions: inductor fuses unpack, dequantize, scores, softmax and the
        # weighted sum into one loop without a [T, D] float buffer (SDPA would need one).
        qv = qf[:, :, :, 0, :]
        if pre_rope:
            # Rotated keys [B, Hkv, T, D], realized once per kv head (not per query head), from a
            # cos/sin table computed once per layer.
            cos, sin = cos_sin(torch.arange(t, device=k.device), rope_inv_freq)
            k = realize(rotate_with(k, realize(cos), realize(sin), rope_scale))
        if k_operand.int_query:
            s_body = _capped(int_query_scores(qv.unsqueeze(3), k_operand).squeeze(3) * scaling, softcap)
        else:
            s_body = _capped(_scores(qv, k, matmul) * scaling, softcap)  # [B, Hkv, n, T]
        s_side = _capped(_scores(qv, sk, matmul) * scaling, softcap)  # [B, Hkv, n, S]
        # mask heads: 1 (shared) or Hq -> broadcast against [B, Hkv, n, positions]
        heads = (hkv, n) if body_mask.shape[1] > 1 else (1, 1)
        s_body = s_body.masked_fill(~body_mask.reshape(b, *heads, t), float("-inf"))
        s_side = s_side.masked_fill(~side_mask.reshape(b, *heads, side_pos.shape[0]), float("-inf"))
        scores = torch.cat([s_body, s_side], dim=-1)
        top = scores.amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        p = torch.exp(scores - top)
        denom = p.sum(-1, keepdim=True)
        p_body, p_side = p[..., :t], p[..., t:]
        out = _weighted_sum(p_body, v, matmul) + _weighted_sum(p_side, sv, matmul)
        out = out / torch.where(denom > 0, denom, torch.ones_like(denom))  # normalize D outputs, not T weights
        return out.reshape(b, hq, 1, -1).to(q.dtype)
    if pre_rope:
        k = rotate(k, torch.arange(t, device=k.device), rope_inv_freq, rope_scale)
    keys = None if k is None else torch.cat([k, sk], dim=2)
    values = torch.cat([v, sv], dim=2)
    full_mask = torch.cat([body_mask, side_mask], dim=-1)
    if softcap > 0 or k_operand.int_query:  # SDPA cannot cap its logits or take scores: spell the softmax out
        if k_operand.int_query:
            s_body = int_query_scores(qf, k_operand)  # [B, Hkv, n, Tq, T]
            s_side = torch.einsum("bhnqd,bhsd->bhnqs", qf, sk)
            raw = torch.cat([s_body, s_side], dim=-1).reshape(b, hq, tq, -1)
        else:
            raw = torch.matmul(q.float(), keys.repeat_interleave(n, dim=1).transpose(-1, -2))
        scores = _capped(raw * scaling, softcap)
        scores = scores.masked_fill(~full_mask, float("-inf"))
        top = scores.amax(-1, keepdim=True)
        p = torch.exp(scores - torch.where(torch.isfinite(top), top, torch.zeros_like(top)))
        denom = p.sum(-1, keepdim=True)
        out = torch.matmul(p, values.repeat_interleave(n, dim=1)) / torch.where(denom > 0, denom, torch.ones_like(denom))
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            q.float(), keys, values, attn_mask=full_mask, scale=scaling, enable_gqa=True
        )
    any_key = full_mask.any(-1, keepdim=True)
    out = torch.where(any_key, out, torch.zeros_like(out))
    return out.to(q.dtype)


STREAM_SCORES = 2**22  # query rows x block positions of one block's scores (16 MiB of float32)
STREAM_BLOCK = (256, 8192)  # the range of body positions dequantized at once by `streaming_attention`


def body_slice(o: Operand, start: int, end: int) -> Operand:
    """Positions [start, end) of one operand's body (empty tensors as the reference takes them):
    start and end on its per-channel group grid, unless one row spans the body (calibrated ranges:
    the row is kept whole and serves the slice as it serves the body)."""
    cut = lambda t, a, b: t[:, :, a:b] if t.dim() == 4 else t  # noqa: E731  (empty placeholders stay)
    sliced = o.replace(codes=cut(o.codes, start, end), out_val=cut(o.out_val, start, end), out_idx=cut(o.out_idx, start, end))
    if is_one_row(o.axis, o.group):
        return sliced
    rows = (start // o.group, end // o.group) if o.axis == AXIS_CHANNEL and o.scale.numel() else (start, end)
    return sliced.replace(scale=cut(o.scale, *rows), zero=cut(o.zero, *rows))


def block_attention(q, k, v, ok, scaling: float, softcap: float, raw: torch.Tensor | None = None):
    """Softmax attention of queries q [B, H, R, D] over one block of keys/values [B, H, L, D]
    where `ok` [B, 1 or H, R, L] allows (None: everywhere) -> (out [B, H, R, Dv], logsumexp
    [B, H, R]); rows with nothing allowed get out 0 and logsumexp -inf. `raw` [B, H, R, L]: the
    unscaled scores, already computed (integer-query keys; k is then unused). On CPU without
    soft-capping or given scores this is ATen's flash attention kernel (it returns the logsumexp
    a split softmax needs); otherwise written out."""
    if ok is not None and bool(ok.all()):
        ok = None
    if q.device.type == "cpu" and softcap <= 0 and raw is None:
        mask = None if ok is None else torch.zeros(ok.shape, dtype=q.dtype, device=q.device).masked_fill_(~ok, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scaling)
    else:
        scores = _capped((torch.matmul(q, k.transpose(-1, -2)) if raw is None else raw) * scaling, softcap)
        scores = scores if ok is None else scores.masked_fill(~ok, float("-inf"))
        top = scores.amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        p = torch.exp(scores - top)
        total = p.sum(-1, keepdim=True)
        out = torch.matmul(p, v) / torch.where(total > 0, total, torch.ones_like(total))
        lse = (top + torch.log(total)).squeeze(-1)
    if ok is None:
        return out, lse
    anything = ok.any(-1)  # [B, 1 or Hkv, R]
    out = torch.where(anything.unsqueeze(-1), out, torch.zeros_like(out))
    return out, torch.where(anything, lse, torch.full_like(lse, float("-inf")))


STREAM_TILE = 512  # queries attended together (with all their query heads) by `streaming_attention`


def streaming_attention(
    q, k: Operand, v: Operand, side_pos, body_end, mask, rope_inv_freq, body_start: int, scaling: float,
    rope_scale: float, softcap: float = 0.0, block: int | None = None, tile: int = STREAM_TILE, position_offset: int = 0,
    with_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`attention` for any number of queries, computed block by block (eager only: Python loop).

    The readable body [body_start, body_end) is cut into blocks (`block` positions, by default as
    many as keep one tile's scores near STREAM_SCORES); each block is dequantized once (GQA: each kv
    head's float keys/values repeated for its query heads) and attended by each tile of `tile`
    queries that may read it, over the part of the block it may read; the results are merged by their log-sum-exp (split softmax). A
    tile that may read a whole block gets no mask, one that may read none of it skips it (a
    causal chunk's early queries skip its later blocks, a sliding window's queries the blocks
    before it, and with per-query body ends each query skips the body past its own end). The side
    store comes last, each tile reading only the entries it may see. Peak memory is one block's
    float K/V and one tile's scores, never the float cache; with a bounds mask (`kvq_ao.masks`)
    never a [Tq, T] mask either.

    For one shard of a longer sequence (context parallelism): body index i and side entry
    position p are the sequence positions `position_offset` + i (+ p) for RoPE (masks, body_start
    and body_end stay in the shard's own indices), and `with_lse` returns (out in float32, the
    log-sum-exp of each query's scaled scores [B, Hq, Tq], -inf where it read nothing): what
    merging shards exactly needs (`kvq_ao.parallel.merge_partials`).
    """
    b, hq, tq, d = q.shape
    hkv, t = k.codes.shape[1], k.codes.shape[2]
    side_k, side_v = k.side, v.side
    n = hq // hkv
    dv = side_v.shape[-1]
    bounded = masks.is_bounds(mask)
    pre_rope = rope_inv_freq.numel() > 0
    qf = q.float()
    acc = qf.new_zeros((b, hq, tq, dv))
    acc_lse = qf.new_full((b, hq, tq), float("-inf"))
    ends = body_end.reshape(-1).expand(tq)  # each query's own body end (or one for all)
    tiles = []  # (first, last query, what the tile may read: lo_min, lo_max, hi_min, hi_max, end_min, end_max)
    for i in range(0, tq, tile):
        j = min(i + tile, tq)
        lo_q, hi_q = (mask[:, :, i:j, 0], mask[:, :, i:j, 1]) if bounded else (None, None)
        reach = (int(lo_q.min()), int(lo_q.max()), int(hi_q.min()), int(hi_q.max())) if bounded else (0, t, 0, t)
        tiles.append((i, j, *reach, int(ends[i:j].min()), int(ends[i:j].max())))

    def per_head(x: torch.Tensor) -> torch.Tensor:
        """[B, Hkv, L, D] -> [B, Hq, L, D]: each kv head's keys (values) for its n query heads (GQA)."""
        return x if n == 1 else x.repeat_interleave(n, dim=1)

    def attend(i: int, j: int, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, ok=None, raw=None) -> None:
        """Merge queries [i, j)'s attention over keys/values [B, Hq, L, D] at `positions` where the
        mask and ok ([j - i, L] per query) allow; ok None: every query of the tile may read every key.
        raw: the tile's unscaled scores [B, Hq, j - i, L] (integer-query keys), else q . keys."""
        if positions.numel() == 0:  # nothing to read (ATen's flash kernel divides by the key count)
            return
        allow = None
        if ok is not None:
            m = masks.allowed(mask[:, :, i:j], positions) if bounded else mask[:, :, i:j].index_select(-1, positions)
            allow = m & ok.view(1, 1, -1, positions.numel())  # [B, 1 or Hq, j - i, L]: broadcast over heads
        out, lse = block_attention(qf[:, :, i:j], keys, values, allow, scaling, softcap, raw)
        old = acc_lse[:, :, i:j]
        total = torch.logaddexp(old, lse)
        base = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
        acc[:, :, i:j] = acc[:, :, i:j] * torch.exp(old - base).unsqueeze(-1) + out * torch.exp(lse - base).unsqueeze(-1)
        acc_lse[:, :, i:j] = total

    first = max(body_start, min(tl[2] for tl in tiles))
    last = min(max(min(tl[5], tl[7]) for tl in tiles), t)  # past every tile's causal bound and body end
    grid = math.lcm(*(o.group for o in (k, v) if not o.is_float and o.axis == AXIS_CHANNEL and not is_one_row(o.axis, o.group)))  # per-channel groups: slices start and end on their grid  # fmt: skip
    if block is None:
        block = min(max(STREAM_SCORES // (hq * min(tile, tq)), STREAM_BLOCK[0]), STREAM_BLOCK[1])
    step = max(grid, block // grid * grid)
    for start in range(first // grid * grid, last, step):
        end = min(start + step, t)
        readers = [tl for tl in tiles if start < min(tl[5], tl[7]) and end > max(tl[2], body_start)]
        if not readers:
            continue
        k_slice = body_slice(k, start, end)
        kb = dequantize_operand(k_slice, torch.float32)
        vb = dequantize_operand(body_slice(v, start, end), torch.float32)
        positions = torch.arange(start, end, device=q.device)
        if pre_rope:
            kb = rotate(kb, positions + position_offset, rope_inv_freq, rope_scale)
        kb, vb = per_head(kb), per_head(vb)
        for i, j, lo_min, lo_max, hi_min, hi_max, end_min, end_max in readers:
            a, z = max(start, lo_min, body_start), min(end, hi_max, end_max)  # the part of the block the tile may read
            kt, vt, pt = kb[:, :, a - start : z - start], vb[:, :, a - start : z - start], positions[a - start : z - start]
            raw = None
            if k.int_query:  # the tile's queries scored against the block's codes, then cut to [a, z)
                qt = qf[:, :, i:j].reshape(b, hkv, n, j - i, d)
                raw = int_query_scores(qt, k_slice)[..., a - start : z - start].reshape(b, hq, j - i, z - a)
            if bounded and a >= lo_max and z <= min(hi_min, end_min):
                attend(i, j, kt, vt, pt, raw=raw)  # every query of the tile may read all of it: no mask
            else:
                attend(i, j, kt, vt, pt, (pt >= body_start) & (pt < ends[i:j].view(-1, 1)), raw)
    if side_pos.numel():
        sk, sv = side_k.float(), side_v.float()
        if pre_rope:
            sk = rotate(sk, side_pos.clamp(min=0) + position_offset, rope_inv_freq, rope_scale)
        sk, sv = per_head(sk), per_head(sv)
        for i, j, lo_min, lo_max, hi_min, hi_max, end_min, end_max in tiles:
            pos = side_pos
            seen = (pos >= 0) & ((pos < body_start) | (pos >= end_min)) & (pos >= lo_min) & (pos < hi_max)
            pick = seen.nonzero().flatten()
            if pick.numel() == 0:
                continue
            p = pos.index_select(0, pick)
            attend(i, j, sk.index_select(2, pick), sv.index_select(2, pick), p, (p < body_start) | (p >= ends[i:j].view(-1, 1)))
    return (acc, acc_lse) if with_lse else acc.to(q.dtype)


__all__ = ["attention", "body_slice", "dequantize", "dequantize_operand", "int_query_scores", "quantize", "quantize_fixed", "streaming_attention", "STREAM_BLOCK", "STREAM_TILE", "TARGETS"]
