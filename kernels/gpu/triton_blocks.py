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
# 1.5 * 2**23: (x + M) - M rounds a float32 |x| < 2**22 half to even. A constexpr: compiled Triton
# refuses plain module globals inside @jit (its interpreter does not).
ROUND_MAGIC = tl.constexpr(12582912.0)
INV_ZERO_STEPS = tl.constexpr(1.0 / fmt.ZERO_STEPS)  # an exact power of two


def supported(head_dim: int, k, v) -> bool:
    """Whether the block tiles take queries of `head_dim` over operands k and v (anything with
    `group`, `bits`, `query_bits`, `out_val` and a `side` store [..., Dv]: a `kvq_ao.format.Operand`
    or a QuantizedKV): power-of-two head_dims (>= 32, keys and values) and power-of-two groups. Keys
    scored against an integer query (`kvq_ao.format.is_int_query`) also need groups of >= 16 tokens
    (each group's tokens are one batch of a tl.dot, which takes >= 16) and no exact outliers; the kvq
    ops serve the rest."""
    pow2 = lambda n: n > 0 and n & (n - 1) == 0  # noqa: E731
    groups = all(pow2(o.group) or o.group == fmt.ONE_ROW or o.bits == fmt.FLOAT_BITS for o in (k, v))
    int_query = fmt.is_int_query(k.query_bits)
    no_outliers = k.out_val is None or k.out_val.shape[-1] == 0
    scores = not int_query or ((k.group >= 16 or k.group == fmt.ONE_ROW) and no_outliers)
    return all(pow2(d) and d >= 32 for d in (head_dim, v.side.shape[-1])) and groups and scores


def chunk_key_block(block: int, k) -> int:
    """The chunk kernel's body tokens per step for keys k: `block`, or for integer-query keys in
    per-channel groups at most one group (its 64 query rows rounded for several scale rows at once
    did not compile within the registers; decode's 16 rows take a whole block)."""
    return min(block, k.group) if fmt.is_int_query(k.query_bits) and k.group != fmt.ONE_ROW else block


def meta_levels(o) -> int:
    """The kernels' K_META / V_META: L of an operand with 8-bit scale and zero (`kvq_ao.format`,
    the range in units of its scale), 0 for float metadata."""
    return fmt.range_levels(o.bits, o.codebook is not None) if o.meta8 else 0


def query_levels(k) -> int:
    """The kernels' K_QUERY: an integer query's steps a side, 0 for float key scores."""
    return fmt.query_levels(k.query_bits) if fmt.is_int_query(k.query_bits) else 0


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
def _token_meta(scale, zero, table, at, ok, META: tl.constexpr):
    """Float32 scale and zero of the per-token groups at indices `at`: stored floats (META 0), or
    8-bit codes decoded as kvq_ao/format.py defines them, scale = table[s] (the 256 scales) and
    zero = -(scale * float(META * z)) * 2**-8 with META = L, the same float32 steps as every kernel."""
    if META > 0:
        s = tl.load(table + tl.load(scale + at, mask=ok, other=0).to(tl.int32))
        z = -(s * (tl.load(zero + at, mask=ok, other=0).to(tl.int32) * META).to(tl.float32)) * INV_ZERO_STEPS
    else:
        s = tl.load(scale + at, mask=ok, other=0.0).to(tl.float32)
        z = tl.load(zero + at, mask=ok, other=0.0).to(tl.float32)
    return s, z


@triton.jit
def _block_values(codes, scale, zero, table, levels, out_val, out_idx, row, t0, ok_t, T, BT: tl.constexpr, D: tl.constexpr,
                  BITS: tl.constexpr, AXIS: tl.constexpr, GROUP: tl.constexpr, CODEBOOK: tl.constexpr, N_OUT: tl.constexpr,
                  META: tl.constexpr):  # fmt: skip
    """Float32 values [BT, D] at body positions t0 + [0, BT) of operand row `row` (= batch * heads
    + head), scales and zeros loaded once per group (8-bit ones decoded there, `_token_meta`);
    `levels`: the codebook's 2**BITS values (a register tensor, `_levels`) when CODEBOOK."""
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
            s, z = _token_meta(scale, zero, table, meta, ok_t[:, None], META)
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


@triton.jit
def _last_max(x):
    """The largest entry along x's last axis, NaN where it holds one (max drops NaN).
    Reductions by tl.reduce: the interpreter refuses tl.max / tl.sum called from a helper."""
    top = tl.reduce(x, -1, tl.standard._elementwise_max)
    nan = tl.reduce(tl.where(x != x, 1.0, 0.0), -1, tl.standard._sum_combine) > 0
    return tl.where(nan, float("nan"), top)


@triton.jit
def _round_even(x):
    """x rounded to the nearest integer, ties to even (|x| < 2^22): adding and taking off 1.5 * 2^23
    leaves no fraction bits. The bitcast round trip keeps the compiler from fusing x's product into
    the addition (an FMA would round the product's exact value, not the float32 product the format
    rounds)."""
    x = x.to(tl.int32, bitcast=True).to(tl.float32, bitcast=True)
    return (x + ROUND_MAGIC) - ROUND_MAGIC


@triton.jit
def _int_dots(qs, code, LEVELS: tl.constexpr):
    """(m / LEVELS) (qi . code) for query rows qs [..., M, D] (q times a scale row) and codes
    [..., D, G], 2-D or a batch: each row rounded to qi = rint(qs * (LEVELS / m)), m = max |qs|
    (IEEE divisions, as the format's float32 ops). An int16 query (LEVELS > 127) goes as two int8
    digits, qi = 256 hi + lo, each a float16 tensor-core dot exact in its float32 accumulator."""
    m = _last_max(tl.abs(qs))
    levels = tl.full([1], LEVELS, tl.float32)
    inv = tl.math.div_rn(levels, tl.where(m > 0, m, 1.0))
    qi = tl.where(tl.expand_dims(m, -1) > 0, _round_even(qs * tl.expand_dims(inv, -1)), 0.0)
    if LEVELS > 127:
        hi = tl.floor((qi + 128.0) * (1.0 / 256.0))
        lo = qi - 256.0 * hi
        dots = tl.dot(hi.to(tl.float16), code) * 256.0 + tl.dot(lo.to(tl.float16), code)
    else:
        dots = tl.dot(qi.to(tl.float16), code)
    return dots * tl.expand_dims(tl.math.div_rn(m, levels), -1)


@triton.jit
def _int_query_scores(qf, codes, scale, zero, row, t0, ok_t, T, BT: tl.constexpr, D: tl.constexpr, BITS: tl.constexpr,
                      GROUP: tl.constexpr, LEVELS: tl.constexpr):  # fmt: skip
    """Unscaled key scores [M, BT] of queries qf [M, D] (float32) over the BT keys at body positions
    t0 + [0, BT) of operand row `row`, in the integer-query format (kvq_ao/format.py): per query row
    and scale row qs = q * scale, m = max |qs|, qi = rint(qs * (LEVELS / m)), score =
    (m / LEVELS) (qi . code) + q . zero. A block of several scale rows (groups of GROUP tokens) is a
    batch of them: every query row is rounded once per scale row. The dot products are tensor-core
    ones of float16 integers (codes and int8 digits are exact in float16; products and sums, below
    2^24, exact in their float32 accumulators). An int16 query (LEVELS > 127) goes as two digits,
    qi = 256 hi + lo, and their sum is the int32 dot product rounded once, as the CPU kernels'."""
    NT: tl.constexpr = BT // GROUP if GROUP != ONE_ROW and BT > GROUP else 1  # scale rows in the block
    M: tl.constexpr = qf.shape[0]
    code = _plane_codes(codes, row * T + t0, ok_t, BT, D, BITS).to(tl.float16)  # [BT, D]
    ch = tl.arange(0, D)
    if GROUP == ONE_ROW:  # calibrated ranges: one row for every position
        meta = (row * D + ch)[None, :]
    else:  # each scale row's first token in the block
        start = t0 + tl.arange(0, NT) * (BT // NT)
        meta = (row * (T // GROUP) + start // GROUP)[:, None] * D + ch[None, :]
    s = tl.load(scale + meta).to(tl.float32)  # [NT, D]
    z = tl.load(zero + meta).to(tl.float32)
    if NT == 1:  # one scale row: 2-D tiles (triton 3.6 spills the 3-D form in the chunk kernel's 64 rows)
        bias = tl.reduce(qf * z, 1, tl.standard._sum_combine)
        return _int_dots(qf * s, tl.trans(code), LEVELS) + bias[:, None]
    else:  # NT scale rows as a batch [NT, M, .]
        code = tl.permute(tl.reshape(code, [NT, BT // NT, D]), (0, 2, 1))  # [NT, D, G]
        bias = tl.reduce(qf[None, :, :] * z[:, None, :], 2, tl.standard._sum_combine)  # [NT, M]
        out = _int_dots(qf[None, :, :] * s[:, None, :], code, LEVELS) + bias[:, :, None]  # [NT, M, G]
        return tl.reshape(tl.permute(out, (1, 0, 2)), [M, BT])


__all__ = ["_block_levels", "_block_values", "_token_meta", "meta_levels", "_int_query_scores", "_levels", "_plane_codes", "chunk_key_block", "query_levels", "supported"]
