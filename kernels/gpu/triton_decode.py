"""Triton decode attention over the packed cache, laid out for memory bandwidth (flash-decoding).

One query token attends a layer's cache straight from its packed codes; no float K/V is written.
Decode is bound by the bytes it reads, so the body loop is built to read each byte once and in wide
loads:

* `_decode_split`: program (b * Hkv + h, split) walks the body's blocks of BLOCK_T tokens split,
  split + S, split + 2S, ... (interleaved, so every split gets an equal share of however much of the
  capacity is filled: the filled length is a device tensor, never read on the host, so the launch
  needs no synchronization and CUDA graphs capture it). The number of splits comes from the SM count,
  several waves of programs at batch 1.
  - Codes: a block's codes are BLOCK_T consecutive packed rows, contiguous in memory. The planar
    layout (`kvq_ao.quant.packing`) stores channel c in plane c // PW at byte c % PW, so the bytes of
    a range of planes are read once, as contiguous rows the compiler turns into vector loads, and
    every plane is a shift and a mask of the same registers (3 bits: three byte planes make 24-bit
    words of eight 3-bit planes).
  - Scales and zeros: once per group, never per element: per-channel groups of G tokens load
    BLOCK_T / G rows of D and broadcast them over their tokens; per-token groups of G channels load
    D / G values a token and broadcast them over their channels; calibrated key ranges load one row.
  - All query heads of the kv head (GQA) are rows of one matrix, padded to the 16 rows a tensor-core
    `tl.dot` takes: scores are q x K^T and the weighted sum P x V, in the model's dtype with float32
    accumulation. One read of K/V serves the whole group.
  - Pre-RoPE keys are dequantized as two halves of head_dim and rotated at their positions
    (transformers' rotate_half pairs channel i with i + D/2, so the rotation is elementwise).
  The program writes its running max, sum of exponentials and weighted sum.
* `_decode_merge`: program (b * Hkv + h) merges the splits by log-sum-exp, attends the full-precision
  side store (sink and recent window), normalizes and writes the output in the model's dtype.

Shapes this layout needs: a power-of-two head_dim and power-of-two groups (`triton_blocks.supported`); other shapes
run `kvq.decode_attention`. The same sources run on CPU tensors in Triton's interpreter
(`triton_ops.interpreted`), which is how they are tested without a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvq_ao import format as fmt
from kvq_ao.kernels.gpu.triton_attention import (_allowed, _max, _query_halves, _rope, _scores, _side_keys, _softmax_step, _sum,
                                                 _tanh)
from kvq_ao.kernels.gpu.triton_blocks import _block_levels, _block_values, _int_query_scores, _levels, _token_meta

FLOAT_BITS = tl.constexpr(fmt.FLOAT_BITS)
AXIS_TOKEN = tl.constexpr(fmt.AXIS_TOKEN)


def block_tokens(head_dim: int, float32: bool = False, pre_rope: bool = False) -> int:
    """Body tokens per step of a split program: 8K elements of K (and of V) a step (128 tokens at
    head_dim 64, 64 at 128: what 8 warps hold in registers without spilling), a quarter for float32
    models (whose products run on FMA units, not tensor cores) and half for pre-RoPE keys (their
    rotation holds a cosine and a sine per element): no spills on sm_80/sm_90, triton 3.6 to 3.9."""
    return max(16, min(512, 8192 // head_dim // (4 if float32 else 1) // (2 if pre_rope else 1)))


@triton.jit
def _kv_head(HKV, N: tl.constexpr, ROWS: tl.constexpr):
    """This program's kv head (program 0 = b * HKV + h): its operand row, batch b, ROWS row indices
    for the N query heads that share it, which of them are real, and their query-head numbers."""
    pid = tl.program_id(0)
    heads = tl.arange(0, ROWS)
    return pid.to(tl.int64), pid // HKV, heads, heads < N, (pid % HKV) * N + heads


@triton.jit
def _decode_split(
    q, k_codes, k_scale, k_zero, k_table, k_codebook, k_out_val, k_out_idx,
    v_codes, v_scale, v_zero, v_table, v_codebook, v_out_val, v_out_idx,
    mask, inv_freq, body_end, part_m, part_l, part_acc,
    body_start, T, HKV, HQ, n_splits, scaling, rope_scale, softcap,
    N: tl.constexpr, NP: tl.constexpr, M: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, DV: tl.constexpr,
    MASK_HEADS: tl.constexpr, PRE_ROPE: tl.constexpr, SOFTCAP: tl.constexpr,
    K_BITS: tl.constexpr, K_AXIS: tl.constexpr, K_GROUP: tl.constexpr, K_CODEBOOK: tl.constexpr, K_OUT: tl.constexpr,
    V_BITS: tl.constexpr, V_AXIS: tl.constexpr, V_GROUP: tl.constexpr, V_CODEBOOK: tl.constexpr, V_OUT: tl.constexpr,
    BLOCK_T: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr, K_QUERY: tl.constexpr = 0,
    K_META: tl.constexpr = 0, V_META: tl.constexpr = 0,
):  # fmt: skip
    """Split `split` of kv head (program 0 = b * HKV + h): the N query heads sharing it as M >= 16
    matrix rows; writes the first NP rows' running max, sum and weighted sum. The products take
    q's dtype (float32 with DOT_F32: float32 models, and bfloat16 in Triton's interpreter, whose
    bfloat16 tl.dot is wrong)."""
    split = tl.program_id(1)
    row, b, heads, ok_h, qh = _kv_head(HKV, N, M)
    dh = tl.arange(0, HALF)
    q_at = q + (b * HQ + qh)[:, None] * D + dh[None, :]
    q1 = tl.load(q_at, mask=ok_h[:, None], other=0.0)  # [M, D/2]: halves, for keys rotated at their positions
    q2 = tl.load(q_at + HALF, mask=ok_h[:, None], other=0.0)
    qf = tl.load(q + (b * HQ + qh)[:, None] * D + tl.arange(0, D)[None, :], mask=ok_h[:, None], other=0.0)  # [M, D]
    if DOT_F32:
        q1, q2, qf = q1.to(tl.float32), q2.to(tl.float32), qf.to(tl.float32)
    k_levels = _levels(k_codebook, K_BITS, K_CODEBOOK)
    v_levels = _levels(v_codebook, V_BITS, V_CODEBOOK)
    end = tl.load(body_end)
    m = tl.full([M], float("-inf"), tl.float32)
    l = tl.full([M], 0.0, tl.float32)
    acc = tl.full([M, DV], 0.0, tl.float32)
    for blk in range(body_start // BLOCK_T + split, (end + BLOCK_T - 1) // BLOCK_T, n_splits):
        t0 = blk * BLOCK_T
        t = t0 + tl.arange(0, BLOCK_T)
        ok_t = (t >= body_start) & (t < end)
        if K_QUERY > 0:  # scored from the codes against the query rounded to K_QUERY steps (kvq_ao/format.py)
            s = _int_query_scores(qf.to(tl.float32), k_codes, k_scale, k_zero, row, t0, ok_t, T, BLOCK_T, D, K_BITS, K_GROUP,
                                  K_QUERY)  # fmt: skip
        elif PRE_ROPE:  # the halves [0, D/2) and [D/2, D), rotated at their positions
            k = _block_values(k_codes, k_scale, k_zero, k_table, k_levels, k_out_val, k_out_idx, row, t0, ok_t, T, BLOCK_T, D,
                              K_BITS, K_AXIS, K_GROUP, K_CODEBOOK, K_OUT, K_META)  # fmt: skip
            k1, k2 = tl.split(tl.permute(tl.reshape(k, [BLOCK_T, 2, HALF]), (0, 2, 1)))
            k1, k2 = _rope(k1, k2, t, inv_freq, dh, dh < HALF, rope_scale)
            s = tl.dot(q1, tl.trans(k1.to(q1.dtype)), input_precision=PRECISION)
            s = s + tl.dot(q2, tl.trans(k2.to(q1.dtype)), input_precision=PRECISION)
        else:
            k = _block_values(k_codes, k_scale, k_zero, k_table, k_levels, k_out_val, k_out_idx, row, t0, ok_t, T, BLOCK_T, D,
                              K_BITS, K_AXIS, K_GROUP, K_CODEBOOK, K_OUT, K_META)  # fmt: skip
            s = tl.dot(qf, tl.trans(k.to(qf.dtype)), input_precision=PRECISION)
        s = s * scaling
        if SOFTCAP:
            s = softcap * _tanh(s / softcap)
        allow = _allowed(mask, b, qh, ok_h, t, ok_t, T, HQ, MASK_HEADS)
        s = tl.where(allow, s, float("-inf"))
        m_new = tl.maximum(m, _max(s, 1))
        base = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: keep exp finite
        p = tl.exp(s - base[:, None])
        alpha = tl.exp(m - base)
        l = l * alpha + _sum(p, 1)
        if V_BITS != FLOAT_BITS and V_AXIS == AXIS_TOKEN and V_GROUP == DV and V_OUT == 0:
            # one scale and zero a value vector: P V = (P * scale) L + (P zero) 1^T, so the metadata is
            # two [BLOCK_T] vectors in P's layout instead of a [BLOCK_T, DV] broadcast
            tok = row * T + t
            v_s, v_z = _token_meta(v_scale, v_zero, v_table, tok, ok_t, V_META)
            v = _block_levels(v_codes, v_levels, row * T + t0, ok_t, BLOCK_T, DV, V_BITS, V_CODEBOOK)
            acc = acc * alpha[:, None] + tl.dot((p * v_s[None, :]).to(q1.dtype), v.to(q1.dtype), input_precision=PRECISION)
            acc = acc + _sum(p * v_z[None, :], 1)[:, None]
        else:
            v = _block_values(v_codes, v_scale, v_zero, v_table, v_levels, v_out_val, v_out_idx, row, t0, ok_t, T, BLOCK_T, DV,
                              V_BITS, V_AXIS, V_GROUP, V_CODEBOOK, V_OUT, V_META)  # fmt: skip
            acc = acc * alpha[:, None] + tl.dot(p.to(q1.dtype), v.to(q1.dtype), input_precision=PRECISION)
        m = m_new
    part = (row * n_splits + split) * NP + heads
    keep = heads < NP
    tl.store(part_m + part, m, mask=keep)
    tl.store(part_l + part, l, mask=keep)
    tl.store(part_acc + part[:, None] * DV + tl.arange(0, DV)[None, :], acc, mask=keep[:, None])


@triton.jit
def _decode_merge(
    q, side_k, side_v, side_pos, mask, inv_freq, body_end, part_m, part_l, part_acc, out,
    body_start, T, S, HKV, HQ, n_splits, scaling, rope_scale, softcap,
    N: tl.constexpr, NP: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr, DV: tl.constexpr,
    MASK_HEADS: tl.constexpr, PRE_ROPE: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_S: tl.constexpr,
):  # fmt: skip
    """Kv head (program 0 = b * HKV + h): merge the splits, attend the side store, write the output."""
    row, b, heads, ok_h, qh = _kv_head(HKV, N, NP)
    dh = tl.arange(0, HALF)
    ok_dh = dh < HALF
    dv = tl.arange(0, DV)
    m = tl.full([NP], float("-inf"), tl.float32)
    l = tl.full([NP], 0.0, tl.float32)
    acc = tl.full([NP, DV], 0.0, tl.float32)
    for split in range(0, n_splits):  # merge the body's splits by log-sum-exp
        part = (row * n_splits + split) * NP + heads
        m_s = tl.load(part_m + part)
        m_new = tl.maximum(m, m_s)
        base = tl.where(m_new == float("-inf"), 0.0, m_new)
        a, a_s = tl.exp(m - base), tl.exp(m_s - base)
        l = l * a + tl.load(part_l + part) * a_s
        acc = acc * a[:, None] + tl.load(part_acc + part[:, None] * DV + dv[None, :]) * a_s[:, None]
        m = m_new
    end = tl.load(body_end)
    q1, q2 = _query_halves(q, b, qh, ok_h, dh, ok_dh, HQ, D, HALF)
    for s0 in range(0, S, BLOCK_S):  # the side store: entries outside the body's readable range
        j = s0 + tl.arange(0, BLOCK_S)
        pos = tl.load(side_pos + j, mask=j < S, other=-1)
        ok = (pos >= 0) & ((pos < body_start) | (pos >= end))
        at = tl.maximum(pos, 0)  # an empty slot (-1) reads column 0, then is not allowed
        allow = _allowed(mask, b, qh, ok_h, at, ok, T, HQ, MASK_HEADS)
        vec = row * S + j
        k1, k2 = _side_keys(side_k, vec, ok, dh, ok_dh, at, inv_freq, rope_scale, D, HALF, PRE_ROPE)
        sc = _scores(q1, q2, k1, k2, allow, scaling, softcap, SOFTCAP)
        v = tl.load(side_v + vec[:, None] * DV + dv[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
        m, l, acc = _softmax_step(m, l, acc, sc, v)
    result = acc / tl.where(l > 0, l, 1.0)[:, None]  # a query that sees nothing gets zeros
    at = out + (b * HQ + qh)[:, None] * DV + dv[None, :]
    tl.store(at, result.to(out.dtype.element_ty), mask=ok_h[:, None])


__all__ = ["_decode_merge", "_decode_split", "block_tokens"]
