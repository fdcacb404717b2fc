"""Triton chunk attention over the packed cache, and the helpers the decode kernels share.

`_chunk_attention` serves several query tokens at once (a prefill chunk, speculative or batched
steps): program (b * Hkv + h, tile) holds BLOCK_Q queries of each of the N query heads sharing the
kv head as the rows of one matrix, streams the body block by block (read by `triton_blocks`: each
packed byte once in wide loads, scales once per group, dequantized in registers; pre-RoPE keys
rotated at their positions) with an online softmax whose products are tensor-core `tl.dot`s, then
the side store. Power-of-two head_dim and groups (`triton_blocks.supported`). Masks are key-position bounds [lo, hi) per query or dense. The decode kernels
(`triton_decode.py`) share the small helpers below.

Keys are handled as two halves of head_dim, [0, D/2) and [D/2, D): RoPE rotates channel i with
channel i + D/2 (transformers' `rotate_half`), so with halves the rotation is elementwise.

The same kernel sources run on CPU tensors in Triton's interpreter (`triton_ops.interpreted`), which
is how they are tested on machines without a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvq_ao import format as fmt
from kvq_ao.kernels.gpu.triton_blocks import _block_values, _int_query_scores, _levels

# The format constants the kernels compare against, from their one definition (kvq_ao.format);
# tl.constexpr, since a jit function may read only constexpr globals on a GPU.
AXIS_TOKEN = tl.constexpr(fmt.AXIS_TOKEN)


# Triton's standard library (tl.sum, tl.max, tl.zeros, tl.cdiv) is itself jit functions, which the
# interpreter can call only when triton was imported with TRITON_INTERPRET=1 (and then torch.compile
# could not trace our kernels). These kernels therefore use only builtins: reductions are tl.reduce
# with the standard library's own combine functions, which the interpreter runs as numpy reductions.
@triton.jit
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _max(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_max)


@triton.jit
def _min(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._elementwise_min)


@triton.jit
def _tanh(x):
    # tl has no tanh that the interpreter also runs; exact at both ends (exp overflows to inf -> -1)
    return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0


@triton.jit
def _rope(x1, x2, pos, inv_freq, dh, ok_dh, rope_scale):
    """Rotate key halves x1, x2 [n, DH] at positions pos [n] (transformers' apply_rotary_pos_emb)."""
    freq = tl.load(inv_freq + dh, mask=ok_dh, other=0.0)
    angle = pos.to(tl.float32)[:, None] * freq[None, :]
    c = tl.cos(angle) * rope_scale
    s = tl.sin(angle) * rope_scale
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _softmax_step(m, l, acc, scores, v):
    """One online-softmax step: running max m [NP], sum l [NP], weighted sum acc [NP, DV] updated
    with scores [NP, n] (-inf = not allowed) over values v [n, DV]."""
    m_new = tl.maximum(m, _max(scores, axis=1))
    base = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: keep exp finite
    p = tl.exp(scores - base[:, None])
    alpha = tl.exp(m - base)
    l = l * alpha + _sum(p, axis=1)
    acc = acc * alpha[:, None] + _sum(p[:, :, None] * v[None, :, :], axis=1)
    return m_new, l, acc


@triton.jit
def _scores(q1, q2, k1, k2, allow, scaling, softcap, SOFTCAP: tl.constexpr):
    """Scaled (and soft-capped) scores [NP, n] of query halves [NP, DH] against key halves [n, DH]."""
    s = _sum(q1[:, None, :] * k1[None, :, :], axis=2) + _sum(q2[:, None, :] * k2[None, :, :], axis=2)
    s = s * scaling
    if SOFTCAP:
        s = softcap * _tanh(s / softcap)
    return tl.where(allow, s, float("-inf"))


@triton.jit
def _dot_scores(q1, q2, k1, k2, allow, scaling, softcap, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
    """`_scores` for many query rows, as matrix products (tensor cores on a GPU)."""
    s = tl.dot(q1, tl.trans(k1), input_precision=PRECISION) + tl.dot(q2, tl.trans(k2), input_precision=PRECISION)
    s = s * scaling
    if SOFTCAP:
        s = softcap * _tanh(s / softcap)
    return tl.where(allow, s, float("-inf"))


@triton.jit
def _side_keys(side_k, vec, ok, dh, ok_dh, pos, inv_freq, rope_scale, D: tl.constexpr, HALF: tl.constexpr,
               PRE_ROPE: tl.constexpr):  # fmt: skip
    """Key halves [n, DH] of side-store entries vec [n] (ok: filled), rotated at pos when pre-RoPE."""
    at = side_k + vec[:, None] * D + dh[None, :]
    k_ok = ok[:, None] & ok_dh[None, :]
    k1 = tl.load(at, mask=k_ok, other=0.0).to(tl.float32)
    k2 = tl.load(at + HALF, mask=k_ok, other=0.0).to(tl.float32)
    if PRE_ROPE:
        k1, k2 = _rope(k1, k2, pos, inv_freq, dh, ok_dh, rope_scale)
    return k1, k2


@triton.jit
def _allowed(mask, b, qh, ok_h, pos, ok, T, HQ, MASK_HEADS: tl.constexpr):
    """The bool mask [B, 1 or Hq, 1, T] at positions pos [n] for query heads qh [NP] -> [NP, n]."""
    if MASK_HEADS == 1:
        m = tl.load(mask + b * T + pos, mask=ok, other=0) != 0
        return ok_h[:, None] & (ok & m)[None, :]
    m = tl.load(mask + (b * HQ + qh)[:, None] * T + pos[None, :], mask=ok_h[:, None] & ok[None, :], other=0) != 0
    return m & ok[None, :]


@triton.jit
def _query_halves(q, b, qh, ok_h, dh, ok_dh, HQ, D: tl.constexpr, HALF: tl.constexpr):
    at = q + (b * HQ + qh)[:, None] * D + dh[None, :]
    ok = ok_h[:, None] & ok_dh[None, :]
    return tl.load(at, mask=ok, other=0.0).to(tl.float32), tl.load(at + HALF, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _softmax_step_dot(m, l, acc, scores, v, PRECISION: tl.constexpr):
    """`_softmax_step` for many rows: the weighted sum as a matrix product (tensor cores on a GPU)."""
    m_new = tl.maximum(m, _max(scores, 1))
    base = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - base[:, None])
    alpha = tl.exp(m - base)
    l = l * alpha + _sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
    return m_new, l, acc


@triton.jit
def _chunk_attention(
    q, k_codes, k_scale, k_zero, k_table, k_codebook, k_out_val, k_out_idx,
    v_codes, v_scale, v_zero, v_table, v_codebook, v_out_val, v_out_idx,
    side_k, side_v, side_pos, mask, inv_freq, body_end, out,
    body_start, T, S, TQ, HKV, HQ, scaling, rope_scale, softcap,
    N: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, DH: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr,
    BOUNDS: tl.constexpr, MASK_HEADS: tl.constexpr, PER_QUERY_END: tl.constexpr, PRE_ROPE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    K_BITS: tl.constexpr, K_AXIS: tl.constexpr, K_GROUP: tl.constexpr, K_CODEBOOK: tl.constexpr, K_OUT: tl.constexpr,
    V_BITS: tl.constexpr, V_AXIS: tl.constexpr, V_GROUP: tl.constexpr, V_CODEBOOK: tl.constexpr, V_OUT: tl.constexpr,
    BLOCK_Q: tl.constexpr, M: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr, PRECISION: tl.constexpr,
    K_QUERY: tl.constexpr = 0, K_META: tl.constexpr = 0, V_META: tl.constexpr = 0,
):  # fmt: skip
    """Queries [tile * BLOCK_Q, + BLOCK_Q) of all N query heads of kv head (program 0 = b * HKV + h),
    as M rows (head-major), over the body blocks any row may read and then the side store, with an
    online softmax. Each row reads body positions [max(body_start, lo), min(its body end, hi)) where
    the mask (int64 bounds [B, 1, TQ, 2] = lo, hi, or bool [B, 1 or HQ, TQ, T]) allows, and side entries
    outside [body_start, its body end)."""
    pid = tl.program_id(0)
    tile = tl.program_id(1)
    row = pid.to(tl.int64)
    b = pid // HKV
    r = tl.arange(0, M)
    head = r // BLOCK_Q
    qi = tile * BLOCK_Q + r % BLOCK_Q
    ok_r = (head < N) & (qi < TQ)
    qh = (pid % HKV) * N + head
    dh = tl.arange(0, DH)
    ok_dh = dh < HALF
    dv = tl.arange(0, BDV)
    ok_dv = dv < DV
    q_at = q + ((b * HQ + qh).to(tl.int64) * TQ + qi)[:, None] * D + dh[None, :]
    q_ok = ok_r[:, None] & ok_dh[None, :]
    q1 = tl.load(q_at, mask=q_ok, other=0.0).to(tl.float32)
    q2 = tl.load(q_at + HALF, mask=q_ok, other=0.0).to(tl.float32)
    qf = tl.load(q + ((b * HQ + qh).to(tl.int64) * TQ + qi)[:, None] * D + tl.arange(0, D)[None, :], mask=ok_r[:, None],
                 other=0.0).to(tl.float32)  # fmt: skip
    k_levels = _levels(k_codebook, K_BITS, K_CODEBOOK)
    v_levels = _levels(v_codebook, V_BITS, V_CODEBOOK)
    if PER_QUERY_END:
        end = tl.load(body_end + qi, mask=ok_r, other=0)
    else:
        end = tl.load(body_end) + qi * 0
    if BOUNDS:
        lo = tl.load(mask + (b * TQ + qi) * 2, mask=ok_r, other=0)
        hi = tl.load(mask + (b * TQ + qi) * 2 + 1, mask=ok_r, other=0)
    else:
        lo = qi * 0
        hi = qi * 0 + T
    if MASK_HEADS == 1:  # dense masks only: the row of each query's mask
        mask_row = (b.to(tl.int64) * TQ + qi) * T
    else:
        mask_row = ((b * HQ + qh).to(tl.int64) * TQ + qi) * T
    first = _min(tl.where(ok_r, tl.maximum(lo, body_start), T), 0)
    last = _max(tl.where(ok_r, tl.minimum(end, hi), 0), 0)
    m = tl.full([M], float("-inf"), tl.float32)
    l = tl.full([M], 0.0, tl.float32)
    acc = tl.full([M, BDV], 0.0, tl.float32)
    for blk in range(first // BLOCK_T, (last + BLOCK_T - 1) // BLOCK_T):
        t = blk * BLOCK_T + tl.arange(0, BLOCK_T)
        ok_t = t < T
        allow = ok_r[:, None] & ok_t[None, :] & (t[None, :] >= body_start) & (t[None, :] < end[:, None])
        allow = allow & (t[None, :] >= lo[:, None]) & (t[None, :] < hi[:, None])
        if BOUNDS == 0:
            allow = allow & (tl.load(mask + mask_row[:, None] + t[None, :], mask=allow, other=0) != 0)
        if K_QUERY > 0:  # scored from the codes against the query rounded to K_QUERY steps (kvq_ao/format.py)
            s = _int_query_scores(qf, k_codes, k_scale, k_zero, row, blk * BLOCK_T, ok_t, T, BLOCK_T, D, K_BITS, K_GROUP,
                                  K_QUERY) * scaling  # fmt: skip
            if SOFTCAP:
                s = softcap * _tanh(s / softcap)
            s = tl.where(allow, s, float("-inf"))
        elif PRE_ROPE:  # the halves [0, D/2) and [D/2, D), rotated at their positions
            k = _block_values(k_codes, k_scale, k_zero, k_table, k_levels, k_out_val, k_out_idx, row, blk * BLOCK_T, ok_t, T,
                              BLOCK_T, D, K_BITS, K_AXIS, K_GROUP, K_CODEBOOK, K_OUT, K_META)  # fmt: skip
            k1, k2 = tl.split(tl.permute(tl.reshape(k, [BLOCK_T, 2, HALF]), (0, 2, 1)))
            k1, k2 = _rope(k1, k2, t, inv_freq, dh, ok_dh, rope_scale)
            s = _dot_scores(q1, q2, k1, k2, allow, scaling, softcap, SOFTCAP, PRECISION)
        else:
            k = _block_values(k_codes, k_scale, k_zero, k_table, k_levels, k_out_val, k_out_idx, row, blk * BLOCK_T, ok_t, T,
                              BLOCK_T, D, K_BITS, K_AXIS, K_GROUP, K_CODEBOOK, K_OUT, K_META)  # fmt: skip
            s = tl.dot(qf, tl.trans(k), input_precision=PRECISION) * scaling
            if SOFTCAP:
                s = softcap * _tanh(s / softcap)
            s = tl.where(allow, s, float("-inf"))
        v = _block_values(v_codes, v_scale, v_zero, v_table, v_levels, v_out_val, v_out_idx, row, blk * BLOCK_T, ok_t, T,
                          BLOCK_T, DV, V_BITS, V_AXIS, V_GROUP, V_CODEBOOK, V_OUT, V_META)  # fmt: skip
        m, l, acc = _softmax_step_dot(m, l, acc, s, v, PRECISION)
    for s0 in range(0, S, BLOCK_S):  # the side store: each row reads the entries outside its body range
        j = s0 + tl.arange(0, BLOCK_S)
        pos = tl.load(side_pos + j, mask=j < S, other=-1)
        at = tl.maximum(pos, 0)
        allow = ok_r[:, None] & (pos >= 0)[None, :] & ((pos[None, :] < body_start) | (pos[None, :] >= end[:, None]))
        allow = allow & (pos[None, :] >= lo[:, None]) & (pos[None, :] < hi[:, None])
        if BOUNDS == 0:
            allow = allow & (tl.load(mask + mask_row[:, None] + at[None, :], mask=allow, other=0) != 0)
        ok_j = pos >= 0
        vec = row * S + j
        k1, k2 = _side_keys(side_k, vec, ok_j, dh, ok_dh, at, inv_freq, rope_scale, D, HALF, PRE_ROPE)
        sc = _dot_scores(q1, q2, k1, k2, allow, scaling, softcap, SOFTCAP, PRECISION)
        v = tl.load(side_v + vec[:, None] * DV + dv[None, :], mask=ok_j[:, None] & ok_dv[None, :], other=0.0).to(tl.float32)
        m, l, acc = _softmax_step_dot(m, l, acc, sc, v, PRECISION)
    result = acc / tl.where(l > 0, l, 1.0)[:, None]
    o_at = out + ((b * HQ + qh).to(tl.int64) * TQ + qi)[:, None] * DV + dv[None, :]
    tl.store(o_at, result.to(out.dtype.element_ty), mask=ok_r[:, None] & ok_dv[None, :])


__all__ = ["_chunk_attention"]
