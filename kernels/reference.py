"""Composite (core ATen only) implementations of the kvq ops.

These are the reference semantics of every op and what CPU runs today; they are written so
that inductor can fuse them and torch.export / ExecuTorch / ONNX can take them: no bit shifts,
no `torch.tensor` constants, no data-dependent Python control flow.

Cache layout read by `attention` (one layer, one of K or V):
* body: all positions [0, T) of the layer's capacity, as packed codes + scale + zero
  (`bits == 0` means the body is already floating point and scale/zero are empty);
  only positions in [body_start, body_end) are read from it. A non-empty `codebook` means
  non-uniform levels (`kvq_ao.quant.codebook`); `out_val`/`out_idx` [.., T, k] are the exact
  outliers of each vector (`kvq_ao.quant.outliers`; k = 0 when unused).
* keys may be stored before RoPE: a non-empty `rope_inv_freq` rotates them at their own
  positions after dequantization (`kvq_ao.quant.rope`).
* side: full-precision entries (sink tokens and the recent window) with their positions in
  `side_pos` (-1 = empty); an entry is read when its position is outside [body_start, body_end).
"""

from __future__ import annotations

import math

import torch

from kvq_ao import masks
from kvq_ao.quant.codebook import dequantize_codebook, quantize_codebook
from kvq_ao.quant.outliers import apply_outliers, split_outliers, split_vector_outliers
from kvq_ao.quant.rope import cos_sin, rotate, rotate_with
from kvq_ao.quant.uniform import dequantize_uniform, quantize_uniform


def quantize(x: torch.Tensor, bits: int, axis: int, group: int, scale_dtype: torch.dtype, codebook: torch.Tensor,
             lo: torch.Tensor, hi: torch.Tensor, n_outliers: int):  # fmt: skip
    """-> (codes, scale, zero, out_val [.., T, k], out_idx [.., T, k] uint8, clamped int64 count).

    Outliers are judged by the channel ranges lo/hi, or per vector when lo/hi are empty.
    """
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
        codes, scale, zero = quantize_codebook(dense, codebook, bits, axis, group, scale_dtype)
    else:
        codes, scale, zero = quantize_uniform(dense, bits, axis, group, scale_dtype)
    return codes, scale, zero, out_val, out_idx, clamped


def dequantize(codes, scale, zero, codebook, out_val, out_idx, bits: int, axis: int, group: int,
               dtype: torch.dtype, select_levels: bool = False) -> torch.Tensor:  # fmt: skip
    if bits == 0:
        return codes.to(dtype)
    if codebook.numel() > 0:
        x = dequantize_codebook(codes, scale, zero, codebook, bits, axis, group, torch.float32, select_levels)
    else:
        x = dequantize_uniform(codes, scale, zero, bits, axis, group, torch.float32)
    return apply_outliers(x, out_val, out_idx).to(dtype)


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
    """Which body positions and side entries each query may read: ([B,h,Tq,T], [B,h,Tq,S])."""
    positions = torch.arange(t, device=mask.device)
    body_ok = (positions >= body_start) & (positions < body_end)
    side_ok = (side_pos >= 0) & ((side_pos < body_start) | (side_pos >= body_end))
    side_cols = mask.index_select(-1, side_pos.clamp(min=0))
    return mask & body_ok, side_cols & side_ok


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
        mask = masks.dense(mask, k_codes.shape[2])
    for_inductor, matmul = target == "inductor", target == "eager"
    realize = _into_buffer if for_inductor else _unchanged
    q = realize(q)
    b, hq, tq, d = q.shape
    k = dequantize(k_codes, k_scale, k_zero, k_codebook, k_out_val, k_out_idx, k_bits, k_axis, k_group, torch.float32,
                   for_inductor)  # fmt: skip
    v = dequantize(v_codes, v_scale, v_zero, v_codebook, v_out_val, v_out_idx, v_bits, v_axis, v_group, torch.float32,
                   for_inductor)  # fmt: skip
    hkv, t = k.shape[1], k.shape[2]
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
    keys = torch.cat([k, sk], dim=2)
    values = torch.cat([v, sv], dim=2)
    full_mask = torch.cat([body_mask, side_mask], dim=-1)
    if softcap > 0:  # SDPA cannot cap its logits: spell the softmax out
        kq = keys.repeat_interleave(n, dim=1)
        scores = _capped(torch.matmul(q.float(), kq.transpose(-1, -2)) * scaling, softcap)
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


def _body_slice(codes, scale, zero, out_val, out_idx, axis: int, group: int, start: int, end: int):
    """Positions [start, end) of one operand's body (start and end on its per-channel group grid)."""
    rows = (start // group, end // group) if axis == 1 and scale.numel() else (start, end)
    cut = lambda t, a, b: t[:, :, a:b] if t.dim() == 4 else t  # noqa: E731  (empty placeholders stay)
    return cut(codes, start, end), cut(scale, *rows), cut(zero, *rows), cut(out_val, start, end), cut(out_idx, start, end)


def _block_attention(q, k, v, ok, scaling: float, softcap: float):
    """Softmax attention of query rows q [B, Hkv, R, D] over one block of keys/values [B, Hkv, L, D]
    where `ok` [B, 1 or Hkv, R, L] allows -> (out [B, Hkv, R, Dv], logsumexp [B, Hkv, R]); rows with
    nothing allowed get out 0 and logsumexp -inf. On CPU without soft-capping this is ATen's flash
    attention kernel (it returns the logsumexp a split softmax needs); otherwise written out."""
    anything = ok.any(-1)  # [B, 1 or Hkv, R]
    if q.device.type == "cpu" and softcap <= 0:
        mask = None if bool(ok.all()) else torch.zeros(ok.shape, dtype=q.dtype, device=q.device).masked_fill_(~ok, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask, scale=scaling)
    else:
        scores = _capped(torch.matmul(q, k.transpose(-1, -2)) * scaling, softcap).masked_fill(~ok, float("-inf"))
        top = scores.amax(-1, keepdim=True)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        p = torch.exp(scores - top)
        total = p.sum(-1, keepdim=True)
        out = torch.matmul(p, v) / torch.where(total > 0, total, torch.ones_like(total))
        lse = (top + torch.log(total)).squeeze(-1)
    out = torch.where(anything.unsqueeze(-1), out, torch.zeros_like(out))
    return out, torch.where(anything, lse, torch.full_like(lse, float("-inf")))


def streaming_attention(
    q, k_codes, k_scale, k_zero, k_codebook, k_out_val, k_out_idx, v_codes, v_scale, v_zero, v_codebook, v_out_val,
    v_out_idx, side_k, side_v, side_pos, body_end, mask, rope_inv_freq, body_start: int, scaling: float,
    rope_scale: float, k_bits: int, k_axis: int, k_group: int, v_bits: int, v_axis: int, v_group: int,
    softcap: float = 0.0, block: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """`attention` for any number of queries, computed block by block (eager only: Python loop).

    The readable body [body_start, body_end) is cut into blocks (`block` positions, by default as
    many as keep one block's scores near STREAM_SCORES); each block is dequantized once per kv head
    (GQA: all its query heads are rows of one attention), attended by every query under its mask,
    and the blocks' results are merged by their log-sum-exp (split softmax); the side store is one
    more block. Blocks no query may read (past the last query's causal bound, before the first
    one's sliding window) are skipped, and a block every query may read wholly gets no mask. Peak
    memory is one block's float K/V and scores, never the float cache; with a bounds mask
    (`kvq_ao.masks`) never a [Tq, T] mask either.
    """
    b, hq, tq, d = q.shape
    hkv, t = k_codes.shape[1], k_codes.shape[2]
    n = hq // hkv
    dv = side_v.shape[-1]
    bounded = masks.is_bounds(mask)
    pre_rope = rope_inv_freq.numel() > 0
    rows = n * tq
    qg = q.float().reshape(b, hkv, rows, d)  # kv head h's query heads, each with its tq queries

    def readable(positions: torch.Tensor) -> torch.Tensor:
        """bool [B, 1 or Hkv, n * Tq, L]: which (query head, query) may read which of `positions`."""
        m = masks.allowed(mask, positions) if bounded else mask.index_select(-1, positions)
        heads = m.shape[1] // n if m.shape[1] > 1 else 1  # mask heads: 1 (shared) or Hq
        return m.reshape(b, heads, -1, tq, positions.numel()).expand(b, heads, n, tq, -1).reshape(b, heads, rows, -1)

    acc = qg.new_zeros((b, hkv, rows, dv))
    acc_lse = qg.new_full((b, hkv, rows), float("-inf"))

    def merge(keys: torch.Tensor, values: torch.Tensor, ok: torch.Tensor) -> None:
        nonlocal acc, acc_lse
        out, lse = _block_attention(qg, keys, values, ok, scaling, softcap)
        total = torch.logaddexp(acc_lse, lse)
        base = torch.where(torch.isfinite(total), total, torch.zeros_like(total))
        acc = acc * torch.exp(acc_lse - base).unsqueeze(-1) + out * torch.exp(lse - base).unsqueeze(-1)
        acc_lse = total

    lo, hi = body_start, int(body_end)
    if bounded:  # only blocks some query may read
        lo, hi = max(lo, int(mask[..., 0].min())), min(hi, int(mask[..., 1].max()))
    grid = math.lcm(*(group for axis, group, bits in ((k_axis, k_group, k_bits), (v_axis, v_group, v_bits))
                      if bits and axis == 1))  # per-channel groups: slices start and end on their grid  # fmt: skip
    if block is None:
        block = min(max(STREAM_SCORES // rows, STREAM_BLOCK[0]), STREAM_BLOCK[1])
    step = max(grid, block // grid * grid)
    for start in range(lo // grid * grid, hi, step):
        end = min(start + step, t)
        kc, ks, kz, kov, koi = _body_slice(k_codes, k_scale, k_zero, k_out_val, k_out_idx, k_axis, k_group, start, end)
        vc, vs, vz, vov, voi = _body_slice(v_codes, v_scale, v_zero, v_out_val, v_out_idx, v_axis, v_group, start, end)
        k = dequantize(kc, ks, kz, k_codebook, kov, koi, k_bits, k_axis, k_group, torch.float32)
        v = dequantize(vc, vs, vz, v_codebook, vov, voi, v_bits, v_axis, v_group, torch.float32)
        positions = torch.arange(start, end, device=q.device)
        if pre_rope:
            k = rotate(k, positions, rope_inv_freq, rope_scale)
        in_body = ((positions >= body_start) & (positions < body_end)).view(1, 1, 1, -1)
        merge(k, v, readable(positions) & in_body)
    if side_pos.numel():
        sk, sv = side_k.float(), side_v.float()
        if pre_rope:
            sk = rotate(sk, side_pos.clamp(min=0), rope_inv_freq, rope_scale)
        side_ok = ((side_pos >= 0) & ((side_pos < body_start) | (side_pos >= body_end))).view(1, 1, 1, -1)
        merge(sk, sv, readable(side_pos.clamp(min=0)) & side_ok)
    return acc.reshape(b, hq, tq, dv).to(q.dtype)


__all__ = ["attention", "dequantize", "quantize", "streaming_attention", "STREAM_BLOCK", "TARGETS"]
