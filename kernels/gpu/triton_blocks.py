"""Reading a block of the packed cache in Triton: BLOCK consecutive vectors of one operand row,
dequantized in registers, each byte read once in wide loads, scales and zeros once per group.

A block's packed vectors are contiguous in memory. The planar layout (`kvq_ao.quant.packing`)
stores channel c in plane c // PW at byte c % PW, so a vector's bytes are loaded as 32-bit words of
contiguous rows (at 3 bits: the rows of its three byte planes) and every plane is a shift and a mask
of them. Per-channel key groups load one scale/zero row per group of tokens, per-token groups one
per token and channel group, calibrated ranges one row; a codebook is a register table. The tiles
need a power-of-two head_dim and power-of-two groups (`supported`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvq_ao import format as fmt

FLOAT_BITS = tl.constexpr(fmt.FLOAT_BITS)
AXIS_TOKEN = tl.constexpr(fmt.AXIS_TOKEN)
ONE_ROW = tl.constexpr(fmt.ONE_ROW)


def supported(head_dim: int, k, v) -> bool:
    """Whether the block tiles take queries of `head_dim` over operands k and v (anything with
    `group`, `bits` and a `side` store [..., Dv]: a `kvq_ao.format.Operand` or a QuantizedKV):
    power-of-two head_dims (>= 32, keys and values) and power-of-two groups, keys scored in float
    (the int8-query format, `kvq_ao.format.INT8_QUERY`, is not built here: the kvq ops serve it)."""
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    groups = all(pow2(o.group) or o.group == fmt.ONE_ROW or o.bits == fmt.FLOAT_BITS for o in (k, v))
    float_scores = k.query_bits == fmt.FLOAT_QUERY
    return all(pow2(d) and d >= 32 for d in (head_dim, v.side.shape[-1])) and groups and float_scores


@triton.jit
def _plane_codes(codes, first, ok_t, BT: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr):
    """Integer codes [BT, D] of the BT consecutive packed vectors from vector index `first` (ok_t
    [BT]: which to read). Each vector's bytes are read once, in contiguous rows (vector loads), and
    every code is one shift and mask of its word: channel c sits in plane c // PW at byte c % PW,
    planes BITS bits apart (3 bits: three byte planes make 24-bit words of eight 3-bit planes)."""
    ROW: tl.constexpr = D * BITS // 8  # bytes a vector
    PW: tl.constexpr = D // 8 if BITS == 3 else ROW  # channels a plane (= bytes a byte plane)
    NPL: tl.constexpr = D // PW  # planes
    W: tl.constexpr = PW // 4  # 32-bit words a byte plane
    tok = first + tl.arange(0, BT)
    ok = ok_t[:, None]
    if BITS == 3:  # three byte planes, each PW contiguous bytes a vector (one 64/128-bit load): their
        # bytes side by side are 24-bit words holding eight 3-bit planes
        at = codes + tok[:, None] * ROW + tl.arange(0, PW)[None, :]
        word = tl.load(at, mask=ok, other=0).to(tl.int32)
        word = word | (tl.load(at + PW, mask=ok, other=0).to(tl.int32) << 8)
        word = word | (tl.load(at + 2 * PW, mask=ok, other=0).to(tl.int32) << 16)
        shift = BITS * tl.arange(0, NPL)[None, :, None]
        code = (word[:, None, :] >> shift) & ((1 << BITS) - 1)  # [BT, NPL, PW]: channel p * PW + c
    else:  # the vector's bytes as 32-bit words
        at = codes.to(tl.pointer_type(tl.int32)) + tok[:, None] * (ROW // 4) + tl.arange(0, W)[None, :]
        byte = 8 * tl.arange(0, 4)[None, None, None, :]  # byte j of a word: bits [8j, 8j + 8)
        word = tl.load(at, mask=ok, other=0)[:, None, :, None]  # [BT, 1, W, 1]
        shift = byte + BITS * tl.arange(0, NPL)[None, :, None, None]
        code = (word >> shift) & ((1 << BITS) - 1)  # [BT, NPL, W, 4]: channel p * PW + 4 w + j
    return tl.reshape(code, [BT, D])


@triton.jit
def _levels(codebook, BITS: tl.constexpr, CODEBOOK: tl.constexpr):
    """The codebook's levels as a register tensor, loaded once a program (a placeholder without one)."""
    if CODEBOOK:
        levels = tl.load(codebook + tl.arange(0, 1 << BITS))
    else:
        levels = tl.full([2], 0.0, tl.float32)
    return levels


@triton.jit
def _block_levels(codes, levels, first, ok_t, BT: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr, CODEBOOK: tl.constexpr):
    """Float32 levels [BT, D] of the BT packed vectors from vector index `first`: the codes, or the
    codebook's values at them (`levels`: the codebook in registers, looked up by tl.gather)."""
    code = _plane_codes(codes, first, ok_t, BT, D, BITS)
    if CODEBOOK:
        level = tl.reshape(tl.gather(tl.broadcast_to(levels[None, :], [BT * D // (1 << BITS), 1 << BITS]),
                                     tl.reshape(code, [BT * D // (1 << BITS), 1 << BITS]), 1), [BT, D])
    else:
        level = code.to(tl.float32)
    return level


@triton.jit
def _block_values(codes, scale, zero, levels, out_val, out_idx, row, t0, ok_t, T, BT: tl.constexpr, D: tl.constexpr,
                  BITS: tl.constexpr, AXIS: tl.constexpr, GROUP: tl.constexpr, CODEBOOK: tl.constexpr, N_OUT: tl.constexpr):  # fmt: skip
    """Float32 values [BT, D] at body positions t0 + [0, BT) of operand row `row` (= batch * heads
    + head), scales and zeros loaded once per group; `levels`: the codebook's 2**BITS values (a
    register tensor, `_levels`) when CODEBOOK."""
    first = row * T + t0  # int64 vector index of the block's first token
    ch = tl.arange(0, D)
    tok = first + tl.arange(0, BT)
    if BITS == FLOAT_BITS:  # a float body
        x = tl.load(codes + tok[:, None] * D + ch[None, :], mask=ok_t[:, None], other=0.0).to(tl.float32)
    else:
        level = _block_levels(codes, levels, first, ok_t, BT, D, BITS, CODEBOOK)
        if AXIS == AXIS_TOKEN:  # per-token groups of GROUP channels: metadata [.., T, D / GROUP]
            NG: tl.constexpr = D // GROUP
            meta = tok[:, None] * NG + tl.arange(0, NG)[None, :]
            s = tl.load(scale + meta, mask=ok_t[:, None], other=0.0).to(tl.float32)
            z = tl.load(zero + meta, mask=ok_t[:, None], other=0.0).to(tl.float32)
            x = tl.reshape(tl.reshape(level, [BT, NG, GROUP]) * s[:, :, None] + z[:, :, None], [BT, D])
        elif GROUP == ONE_ROW:  # calibrated ranges: one row [.., 1, D] for every position
            s = tl.load(scale + row * D + ch).to(tl.float32)
            z = tl.load(zero + row * D + ch).to(tl.float32)
            x = level * s[None, :] + z[None, :]
        else:  # per-channel groups of GROUP tokens: metadata [.., T / GROUP, D]
            NT: tl.constexpr = BT // GROUP if BT > GROUP else 1  # groups in the block
            start = t0 + tl.arange(0, NT) * (BT // NT)  # each group's first token in the block
            meta = (row * (T // GROUP) + start // GROUP)[:, None] * D + ch[None, :]
            s = tl.load(scale + meta, mask=(start < T)[:, None], other=0.0).to(tl.float32)
            z = tl.load(zero + meta, mask=(start < T)[:, None], other=0.0).to(tl.float32)
            x = tl.reshape(tl.reshape(level, [NT, BT // NT, D]) * s[:, None, :] + z[:, None, :], [BT, D])
    for j in tl.static_range(N_OUT):  # exact outliers replace their channel
        idx = tl.load(out_idx + tok * N_OUT + j, mask=ok_t, other=D).to(tl.int32)  # D: no channel
        val = tl.load(out_val + tok * N_OUT + j, mask=ok_t, other=0.0).to(tl.float32)
        x = tl.where(ch[None, :] == idx[:, None], val[:, None], x)
    return x


__all__ = ["_block_levels", "_block_values", "_levels", "_plane_codes", "supported"]
