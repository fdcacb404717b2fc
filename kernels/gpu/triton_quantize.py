"""Triton kernel of `kvq::quantize`: float K/V -> packed codes, scale, zero and outlier slots in one
pass, bit-identical to the reference (kernels/reference.py) so a cache filled on a GPU holds what a
CPU would write.

One program quantizes a tile of [ROWS, D] entries: ROWS vectors for per-token groups (groups of
GROUP channels along D), or one block of GROUP tokens for per-channel groups (each channel reduced
over the block). In order: outliers (per-channel thresholds, or per vector: the K entries furthest
from the vector's mean) are taken out and the rest clamped; each group's stored range (zero rounded
down and scale rounded up to the scale dtype, checked in float64, as `group_range`); codes by
round-half-to-even (uniform) or by counting midpoints passed (codebook); planar packing
(`kvq_ao.quant.packing`). With FIXED the same program serves `kvq::quantize_fixed`: rows coded
against calibrated per-channel ranges, nothing reduced over tokens.

Exactness notes: rounding to bfloat16 is done on the bits (the interpreter's float conversion
truncates); divisions are `div_rn` (IEEE, as torch divides); round-half-to-even is the 1.5 * 2^23
trick, exact for the code range. Head dims and group sizes must be powers of two (reshapes).
8-bit scale and zero (`meta`) are coded by kvq_ao/format.py's rule with float32 multiplies and
compares only, against a table of the 256 scales the host computes as the reference does.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvq_ao.kernels.gpu.triton_attention import AXIS_TOKEN, _max, _min, _sum
from kvq_ao.kernels.gpu.triton_blocks import ROUND_MAGIC


@triton.jit
def _to_scale_dtype(x, SCALE: tl.constexpr):
    """float32 x rounded (to nearest even) to the scale dtype (0 float16, 1 bfloat16, 2 float32), as float32."""
    if SCALE == 0:
        return x.to(tl.float16).to(tl.float32)
    elif SCALE == 1:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        return bits.to(tl.float32, bitcast=True)
    else:
        return x


@triton.jit
def _step(x, direction, eps, tiny, SCALE: tl.constexpr):
    """x moved one or two ulps of the scale dtype in `direction` (`uniform._step`)."""
    return _to_scale_dtype(x + direction * tl.maximum(tl.abs(x) * eps, tiny), SCALE)


@triton.jit
def _group_range(lo, hi, levels, fmax, eps, tiny, SCALE: tl.constexpr):
    """(zero, scale) of groups with minimum lo and maximum hi (`uniform.group_range`)."""
    zero = _to_scale_dtype(tl.minimum(tl.maximum(lo, -fmax), fmax), SCALE)
    zero = tl.where(zero > lo, _step(zero, -1.0, eps, tiny, SCALE), zero)
    scale = _to_scale_dtype(tl.minimum(tl.maximum(tl.math.div_rn(hi - zero, levels), 0.0), fmax), SCALE)
    too_small = scale.to(tl.float64) * levels + zero.to(tl.float64) < hi.to(tl.float64)
    scale = tl.where(too_small, _step(scale, 1.0, eps, tiny, SCALE), scale)
    return zero, scale


@triton.jit
def _zero_of(scale, z, levels):
    """An 8-bit zero code's value: -(scale * float(L * z)) * 2**-8 (kvq_ao/format.py)."""
    return -(scale * (z.to(tl.float32) * levels)) * 0.00390625


@triton.jit
def _group_range8(lo, hi, levels, table):
    """(scale code, zero code, zero, scale) of groups [A, B] with minimum lo and maximum hi, by
    kvq_ao/format.py's rule for 8-bit metadata (`metadata.encode_range`); table: the 256 scales
    S[c] of the format's exponent (float32, from the host)."""
    lo = tl.minimum(lo, 0.0)
    hi = tl.maximum(hi, 0.0)
    c_all = tl.arange(0, 256)
    scaled = tl.load(table + c_all) * levels  # fl(S[c] * L)
    c0 = _sum((scaled[None, None, :] < (hi - lo)[:, :, None]).to(tl.int32), 2)
    steps = c_all.to(tl.float32) * levels  # L * z, exact
    best_c = tl.minimum(c0 + 2, 255)  # the last try, kept unless an earlier one covers
    best_z = best_c * 0
    for step in tl.static_range(2, -1, -1):  # the first covering of c0, c0 + 1, c0 + 2 wins: tried from the top down
        c = tl.minimum(c0 + step, 255)
        s = tl.load(table + c)
        candidates = -(s[:, :, None] * steps[None, None, :]) * 0.00390625
        z = tl.minimum(_sum((candidates > lo[:, :, None]).to(tl.int32), 2), 255)
        zero = _zero_of(s, z, levels)
        covers = (zero <= lo) & (zero + s * levels >= hi)
        if step == 2:
            best_z = z
        else:
            best_c = tl.where(covers, c, best_c)
            best_z = tl.where(covers, z, best_z)
    scale = tl.load(table + best_c)
    return best_c, best_z, _zero_of(scale, best_z, levels), scale


@triton.jit
def _quantize(
    x, lo_t, hi_t, mids, codes, scale_out, zero_out, out_val, out_idx, clamped, table,
    R, T, H, levels, fmax, eps, tiny,
    D: tl.constexpr, BITS: tl.constexpr, AXIS: tl.constexpr, GROUP: tl.constexpr, CODEBOOK: tl.constexpr,
    K: tl.constexpr, VECTOR_OUTLIERS: tl.constexpr, SCALE: tl.constexpr, ROWS: tl.constexpr, FIXED: tl.constexpr = False,
    META8: tl.constexpr = False,
):  # fmt: skip
    """FIXED (`kvq::quantize_fixed`): per-token rows coded against the fixed ranges zero/scale [H, D]
    read from zero_out/scale_out (not written); entries outside lo/hi [H, D] are outliers (K slots per
    vector) or clamped, and counted, also when K is 0. META8 (per-token groups): scale and zero are
    written as 8-bit codes (`_group_range8`, table: the format's 256 scales)."""
    pid = tl.program_id(0)
    r = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)  # vector index b * H * T + h * T + t
    d = tl.arange(0, D)
    ok = r < R  # a per-token tile may run past the last vector
    okd = ok[:, None] & (d[None, :] < D)
    x_raw = tl.load(x + r[:, None] * D + d[None, :], mask=okd, other=0.0)
    xf = x_raw.to(tl.float32)
    dense = xf
    if K > 0 or FIXED:
        if VECTOR_OUTLIERS:  # the K entries furthest from the vector's mean (`split_vector_outliers`)
            mean = _sum(xf, 1) / D
            dist = tl.abs(xf - mean[:, None])
            taken = tl.full([ROWS, D], 0, tl.int1)
            for j in tl.static_range(K):
                best = _max(dist, 1)
                idx = _min(tl.where(dist == best[:, None], d[None, :], D), 1)
                pick = d[None, :] == idx[:, None]
                val = _sum(tl.where(pick, x_raw.to(tl.float32), 0.0), 1)
                tl.store(out_val + r * K + j, val.to(out_val.dtype.element_ty), mask=ok)
                tl.store(out_idx + r * K + j, idx.to(tl.uint8), mask=ok)
                taken = taken | pick
                dist = tl.where(pick, -1.0, dist)
            g3 = tl.reshape(xf, [ROWS, D // GROUP, GROUP])
            m3 = tl.reshape(taken, [ROWS, D // GROUP, GROUP])
            all_out = _min(m3.to(tl.int32), 2) == 1
            big = 3.4028234663852886e38
            g_lo = tl.where(all_out, _min(g3, 2), _min(tl.where(m3, big, g3), 2))
            g_hi = tl.where(all_out, _max(g3, 2), _max(tl.where(m3, -big, g3), 2))
            dense = tl.reshape(tl.minimum(tl.maximum(g3, g_lo[:, :, None]), g_hi[:, :, None]), [ROWS, D])
        else:  # per-channel thresholds lo/hi [H, D] (`split_outliers`)
            head = (r // T) % H
            lo = tl.load(lo_t + head[:, None] * D + d[None, :], mask=okd, other=0.0).to(tl.float32)
            hi = tl.load(hi_t + head[:, None] * D + d[None, :], mask=okd, other=0.0).to(tl.float32)
            width = tl.maximum(hi - lo, 1.1754943508222875e-38)
            excess = tl.math.div_rn(tl.maximum(xf - hi, 0.0) + tl.maximum(lo - xf, 0.0), width)
            dense = tl.minimum(tl.maximum(xf, lo), hi)
            if K > 0:  # `split_outliers` judges by the excess; with no slots, `quantize_fixed` compares
                n_out = _sum(((excess > 0) & okd).to(tl.int32), 1)
            else:
                n_out = _sum((((xf < lo) | (xf > hi)) & okd).to(tl.int32), 1)
            n_kept = n_out * 0
            for j in tl.static_range(K):
                best = _max(excess, 1)
                idx = _min(tl.where(excess == best[:, None], d[None, :], D), 1)
                pick = d[None, :] == idx[:, None]
                kept = (best > 0) & ok  # an outlier; a free slot takes the lowest other channel, exact
                val = _sum(tl.where(pick, x_raw.to(tl.float32), 0.0), 1)
                tl.store(out_val + r * K + j, val.to(out_val.dtype.element_ty), mask=ok)
                tl.store(out_idx + r * K + j, idx.to(tl.uint8), mask=ok)
                n_kept += kept.to(tl.int32)
                excess = tl.where(pick, -1.0, excess)
            tl.store(clamped + pid, _sum(n_out - n_kept, 0).to(tl.int64))
    if FIXED:  # one calibrated range per head and channel
        head = (r // T) % H
        zero = tl.load(zero_out + head[:, None] * D + d[None, :], mask=okd, other=0.0).to(tl.float32)
        scale = tl.load(scale_out + head[:, None] * D + d[None, :], mask=okd, other=1.0).to(tl.float32)
        u = tl.math.div_rn(dense - zero, tl.where(scale > 0, scale, 1.0))
    elif AXIS == AXIS_TOKEN:  # per-token groups: [ROWS, D / GROUP] ranges
        g3 = tl.reshape(dense, [ROWS, D // GROUP, GROUP])
        meta = r[:, None] * (D // GROUP) + tl.arange(0, D // GROUP)[None, :]
        if META8:
            s_code, z_code, zero, scale = _group_range8(_min(g3, 2), _max(g3, 2), levels, table)
            tl.store(scale_out + meta, s_code.to(tl.uint8), mask=ok[:, None])
            tl.store(zero_out + meta, z_code.to(tl.uint8), mask=ok[:, None])
        else:
            zero, scale = _group_range(_min(g3, 2), _max(g3, 2), levels, fmax, eps, tiny, SCALE)
            tl.store(scale_out + meta, scale.to(scale_out.dtype.element_ty), mask=ok[:, None])
            tl.store(zero_out + meta, zero.to(zero_out.dtype.element_ty), mask=ok[:, None])
        safe = tl.where(scale > 0, scale, 1.0)
        u = tl.reshape(tl.math.div_rn(g3 - zero[:, :, None], safe[:, :, None]), [ROWS, D])
    else:  # per-channel groups: this tile is one block of GROUP tokens, [D] ranges
        zero, scale = _group_range(_min(dense, 0), _max(dense, 0), levels, fmax, eps, tiny, SCALE)
        tl.store(scale_out + pid.to(tl.int64) * D + d, scale.to(scale_out.dtype.element_ty))
        tl.store(zero_out + pid.to(tl.int64) * D + d, zero.to(zero_out.dtype.element_ty))
        safe = tl.where(scale > 0, scale, 1.0)
        u = tl.math.div_rn(dense - zero[None, :], safe[None, :])
    if CODEBOOK:  # the number of level midpoints u lies above
        code = tl.full([ROWS, D], 0, tl.int32)
        for i in tl.static_range((1 << BITS) - 1):
            code += (u > tl.load(mids + i)).to(tl.int32)
    else:
        code = ((u + ROUND_MAGIC) - ROUND_MAGIC).to(tl.int32)
        code = tl.minimum(tl.maximum(code, 0), (1 << BITS) - 1)
    if BITS == 8:
        tl.store(codes + r[:, None] * D + d[None, :], code.to(tl.uint8), mask=okd)
    elif BITS == 3:  # 24-bit words of 8 planes, stored as three byte planes
        P3: tl.constexpr = D // 8
        planes = tl.reshape(code, [ROWS, 8, P3])
        word = _sum(planes << (tl.arange(0, 8) * 3)[None, :, None], 1)
        at = codes + r[:, None] * (3 * P3) + tl.arange(0, P3)[None, :]
        tl.store(at, (word & 255).to(tl.uint8), mask=ok[:, None])
        tl.store(at + P3, ((word >> 8) & 255).to(tl.uint8), mask=ok[:, None])
        tl.store(at + 2 * P3, ((word >> 16) & 255).to(tl.uint8), mask=ok[:, None])
    else:
        VPW: tl.constexpr = 8 // BITS
        P: tl.constexpr = D // VPW
        planes = tl.reshape(code, [ROWS, VPW, P])
        byte = _sum(planes << (tl.arange(0, VPW) * BITS)[None, :, None], 1)
        tl.store(codes + r[:, None] * P + tl.arange(0, P)[None, :], byte.to(tl.uint8), mask=ok[:, None])
