// The arithmetic of kvq::quantize_fixed on CPU (keys coded on arrival against calibrated per-channel
// ranges, one vector at a time), free of ATen and ExecuTorch: quantize_fixed.cpp registers it with
// PyTorch, conformance_main.cpp runs it on case files for other CPUs (kvq_ao.kernels.cpu.portable).
// and of kvq::quantize (`quantize_groups`, below: ranges of their own per group, the appends of
// every other quantized format).
// What quantize_rows computes, byte for byte, is the reference's `quantize_fixed` (kernels/reference.py):
//   * outliers: entries outside their channel's [lo, hi], ranked by excess / (hi - lo); the
//     n_outliers largest keep their exact value (ties: the lower channel first), the rest are
//     counted as clamped; every entry is clamped into [lo, hi];
//   * codes: u = (dense - zero) / scale in float32 (scale 0 reads as 1), then the uniform grid
//     (round half to even, clamped to [0, 2^bits - 1]) or the number of codebook midpoints below u;
//   * planar packing of `kvq_ao.quant.packing` (8 / bits planes of head_dim * bits / 8 bytes; 3 bits:
//     8 planes in 24-bit words stored as three byte planes).

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "kvq_format.h"  // generated from kvq_ao/format.py into the build directory

namespace kvq_core {

constexpr int kMaxDim = 256;

inline int packed_bytes(int64_t dim, int64_t bits) { return static_cast<int>(kvq_format::packed_row_bytes(dim, bits)); }

inline void pack(const uint8_t* code, int dim, int bits, uint8_t* out) {
  if (bits == 8) {
    for (int c = 0; c < dim; ++c) out[c] = code[c];
  } else if (bits == 3) {
    const int p = dim / 8;
    for (int j = 0; j < p; ++j) {
      uint32_t word = 0;
      for (int i = 0; i < 8; ++i) word |= static_cast<uint32_t>(code[i * p + j]) << (3 * i);
      out[j] = word & 255;
      out[p + j] = (word >> 8) & 255;
      out[2 * p + j] = (word >> 16) & 255;
    }
  } else {
    const int per_byte = 8 / bits, p = dim / per_byte;
    for (int j = 0; j < p; ++j) {
      uint32_t byte = 0;
      for (int i = 0; i < per_byte; ++i) byte |= static_cast<uint32_t>(code[i * p + j]) << (i * bits);
      out[j] = static_cast<uint8_t>(byte);
    }
  }
}

// ----------------------------------------------------------------------------- NaN and Inf
// Both native appends refuse NaN/Inf input (their bodies would hold codes of a NaN range, or a
// range an Inf erased): an error starting with kNonFiniteInput, which the cache turns into its
// NonFiniteKVError naming the position and layer (kvq_ao/finite.py). One compare per entry in a
// pass the compiler vectorizes, so an eager append on CPU needs no check of its own in Python.
constexpr const char* kNonFiniteInput = "kvq: non-finite input";

template <typename T>
int64_t first_non_finite(const T* x, int64_t n) {
  bool any = false;
  for (int64_t i = 0; i < n; ++i) any |= !std::isfinite(static_cast<float>(x[i]));
  if (!any) return -1;
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(static_cast<float>(x[i]))) return i;
  return -1;
}

// ----------------------------------------------------------------------------- kvq::quantize
// The metadata dtypes of kvq::quantize (its scale_dtype), as the reference rounds to them.
enum class ScaleType : int { Half = 0, BFloat16 = 1, Float = 2 };

// float32 -> IEEE binary16 bits, round to nearest even (subnormals, and overflow to inf from 65520 on),
// as torch converts.
inline uint16_t half_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);  // NaN
  if (ax >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // >= 65520: inf
  if (ax < 0x38800000u) {  // below 2^-14: a subnormal half, round(|f| * 2^24) units of 2^-24
    float a;
    std::memcpy(&a, &ax, 4);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(a * 16777216.0f)));
  }
  uint32_t h = ((((ax >> 23) - 127 + 15) << 10) | ((ax & 0x7fffffu) >> 13));
  const uint32_t rest = ax & 0x1fffu;
  h += (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ? 1u : 0u;  // a carry moves into the exponent
  return static_cast<uint16_t>(sign | h);
}

inline float half_value(uint16_t h) {
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  float v = exp == 0 ? std::ldexp(static_cast<float>(mant), -24)
          : exp == 31 ? (mant ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity())
                      : std::ldexp(static_cast<float>(mant | 0x400u), static_cast<int>(exp) - 25);
  return (h & 0x8000u) ? -v : v;
}

// float32 -> bfloat16 bits, round to nearest even (as c10::BFloat16).
inline uint16_t bfloat16_bits(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((x >> 16) | 0x40u);
  x += 0x7fffu + ((x >> 16) & 1u);
  return static_cast<uint16_t>(x >> 16);
}

inline float bfloat16_value(uint16_t b) {
  const uint32_t x = static_cast<uint32_t>(b) << 16;
  float v;
  std::memcpy(&v, &x, 4);
  return v;
}

// finfo of a scale dtype: max, eps and smallest normal (powers of two but max).
struct ScaleInfo {
  ScaleType type;
  float max, eps, tiny;
};

inline ScaleInfo scale_info(ScaleType t) {
  switch (t) {
    case ScaleType::Half: return {t, 65504.0f, 0.0009765625f, 6.103515625e-05f};
    case ScaleType::BFloat16: return {t, 3.3895313892515355e+38f, 0.0078125f, 1.1754943508222875e-38f};
    default: return {t, std::numeric_limits<float>::max(), 1.1920928955078125e-07f, 1.1754943508222875e-38f};
  }
}

// x rounded to the scale dtype, as float32 (`uniform._rounded`).
inline float rounded(float x, const ScaleInfo& si) {
  if (si.type == ScaleType::Half) return half_value(half_bits(x));
  if (si.type == ScaleType::BFloat16) return bfloat16_value(bfloat16_bits(x));
  return x;
}

// x moved one or two ulps of the scale dtype in `direction` (`uniform._step`).
inline float stepped(float x, float direction, const ScaleInfo& si) {
  const float delta = std::max(std::fabs(x) * si.eps, si.tiny * si.eps);
  return rounded(x + direction * delta, si);
}

// (zero, scale) of a group with minimum lo and maximum hi, float32 holding scale-dtype values
// (`uniform.group_range`): zero rounded down, scale rounded up, checked in float64.
inline void group_range(float lo, float hi, int levels, const ScaleInfo& si, float* zero, float* scale) {
  float z = rounded(std::min(std::max(lo, -si.max), si.max), si);
  if (z > lo) z = stepped(z, -1.0f, si);
  float s = rounded(std::min(std::max((hi - z) / static_cast<float>(levels), 0.0f), si.max), si);
  if (static_cast<double>(s) * levels + static_cast<double>(z) < static_cast<double>(hi)) s = stepped(s, 1.0f, si);
  *zero = z;
  *scale = s;
}

inline void store_scale(void* out, int64_t i, float v, const ScaleInfo& si) {
  if (si.type == ScaleType::Float) static_cast<float*>(out)[i] = v;
  else static_cast<uint16_t*>(out)[i] = si.type == ScaleType::Half ? half_bits(v) : bfloat16_bits(v);  // v is exact there
}

// 8-bit metadata of per-token groups (kvq_ao/format.py, `meta`): the scale a code on a log grid
// above 2^e, the zero a fraction z / 256 of the range below 0; coded by format.py's rule with
// float32 multiplies and compares only, so these bytes are the reference's
// (kvq_ao.quant.metadata.encode_range).
struct Meta8 : kvq_format::MetaTable {  // scale[c] = S[c] = 2^e * kScaleTable[c] (exact), levels = L
  float scaled[256];                     // fl(S[c] * L)

  Meta8(int64_t meta, int levels_) : kvq_format::MetaTable(meta, levels_) {
    for (int c = 0; c < 256; ++c) scaled[c] = scale[c] * static_cast<float>(levels);
  }

  // The coder of `meta` for codes of `bits` (with or without a codebook); none for float metadata.
  static std::optional<Meta8> of(int64_t meta, int64_t bits, bool codebook) {
    if (!kvq_format::is_meta8(meta)) return std::nullopt;
    return std::optional<Meta8>(std::in_place, meta, kvq_format::range_levels(bits, codebook));
  }

  float zero_of(float s, int z) const { return zero(s, z); }

  // The smallest z in [0, 255] whose zero lies at or below lo (255 if none): zero_of falls as z grows.
  int zero_code(float s, float lo) const {
    int first = 0, last = kvq_format::kZeroSteps - 1;
    if (zero_of(s, last) > lo) return last;
    while (first < last) {
      const int mid = (first + last) / 2;
      if (zero_of(s, mid) <= lo) last = mid;
      else first = mid + 1;
    }
    return first;
  }

  // The codes of a group with minimum lo and maximum hi, and the (zero, scale) they decode to.
  void encode(float lo, float hi, uint8_t* s_code, uint8_t* z_code, float* zero, float* s) const {
    lo = std::min(lo, 0.0f);
    hi = std::max(hi, 0.0f);
    const float span = hi - lo;
    int c0 = 0;
    for (int c = 0; c < 256; ++c) c0 += scaled[c] < span;
    int c = 0, z = 0;
    for (int step = 0; step < 3; ++step) {  // the first of c0, c0 + 1, c0 + 2 whose range covers [lo, hi], else the last
      c = std::min(c0 + step, 255);
      z = zero_code(scale[c], lo);
      const float zr = zero_of(scale[c], z);
      if (zr <= lo && zr + scaled[c] >= hi) break;
    }
    *s_code = static_cast<uint8_t>(c);
    *z_code = static_cast<uint8_t>(z);
    *s = scale[c];
    *zero = zero_of(scale[c], z);
  }
};

// The dense part of one vector and its outlier slots, as the reference's `quantize` splits it:
// * lo/hi given (channel rule, `split_outliers`): entries clamped into their channel's range, the
//   `slots` largest excesses kept (then the lowest other channels); returns the clamped count;
// * lo/hi null and slots > 0 (vector rule, `split_vector_outliers`): the `slots` entries furthest
//   from the vector's mean kept, each clamped into the range of the rest of its group of `group`
//   channels (a group of outliers only keeps its own range);
// * slots 0: the vector itself, or with lo/hi (quantize_fixed) clamped into them and its entries
//   outside counted.
template <typename T>
inline int64_t split_vector(const T* xr, int dim, int slots, const float* l, const float* u, int group, float* dense,
                            T* out_val, uint8_t* out_idx) {
  float score[kMaxDim];
  for (int c = 0; c < dim; ++c) dense[c] = static_cast<float>(xr[c]);
  if (slots == 0 && l == nullptr) return 0;
  int64_t outside = 0;
  if (l != nullptr) {
    for (int c = 0; c < dim; ++c) {
      // as split_outliers: relu(x - hi) + relu(lo - x) over max(hi - lo, FLT_MIN)
      const float v = dense[c], width = std::max(u[c] - l[c], 1.17549435082228750797e-38f);
      score[c] = (std::max(v - u[c], 0.0f) + std::max(l[c] - v, 0.0f)) / width;
      dense[c] = std::min(std::max(v, l[c]), u[c]);
      outside += slots > 0 ? score[c] > 0.0f : (v < l[c] || v > u[c]);  // as the reference counts each case
    }
  } else {
    float sum = 0.0f;
    for (int c = 0; c < dim; ++c) sum += dense[c];
    const float mean = sum / static_cast<float>(dim);
    for (int c = 0; c < dim; ++c) score[c] = std::fabs(dense[c] - mean);
  }
  bool picked[kMaxDim] = {};
  int64_t kept = 0;
  for (int j = 0; j < slots; ++j) {  // largest score first; the lower channel wins a tie
    int best = -1;
    for (int c = 0; c < dim; ++c)
      if (!picked[c] && (best < 0 || score[c] > score[best])) best = c;
    kept += l != nullptr && score[best] > 0.0f;
    picked[best] = true;
    out_val[j] = xr[best];
    out_idx[j] = static_cast<uint8_t>(best);
  }
  if (l != nullptr) return outside - kept;
  for (int g0 = 0; g0 < dim; g0 += group) {  // vector rule: clamp each group's outliers into the rest's range
    float lo = std::numeric_limits<float>::max(), hi = -std::numeric_limits<float>::max();
    float all_lo = dense[g0], all_hi = dense[g0];
    bool any_rest = false;
    for (int c = g0; c < g0 + group; ++c) {
      all_lo = std::min(all_lo, dense[c]);
      all_hi = std::max(all_hi, dense[c]);
      if (!picked[c]) lo = std::min(lo, dense[c]), hi = std::max(hi, dense[c]), any_rest = true;
    }
    if (!any_rest) lo = all_lo, hi = all_hi;
    for (int c = g0; c < g0 + group; ++c) dense[c] = std::min(std::max(dense[c], lo), hi);
  }
  return 0;
}

inline uint8_t code_of(float v, float zero, float scale, int levels, const float* mids, int n_mids) {
  const float q = (v - zero) / (scale > 0.0f ? scale : 1.0f);
  if (n_mids > 0) {
    int k = 0;
    for (int m = 0; m < n_mids; ++m) k += q > mids[m];
    return static_cast<uint8_t>(k);
  }
  return static_cast<uint8_t>(std::min(std::max(std::nearbyint(q), 0.0f), static_cast<float>(levels)));
}

// Rows [B * H * T] of x [.., head_dim] coded against their head's ranges; returns the clamped count.
// parallel_for(n, fn) calls fn(begin, end) over [0, n) in chunks (ATen's thread pool, or a loop);
// the rows go in tasks of kRowsPerTask. The split and the codes are kvq::quantize's (`split_vector`
// by channel ranges, `code_of`), against one fixed scale/zero per channel.
constexpr int64_t kRowsPerTask = 64;

template <typename T, typename ParallelFor>
int64_t quantize_rows(const T* x, int64_t rows, int64_t tokens, int64_t heads, int dim, int bits, const float* lo,
                      const float* hi, const float* zero, const float* scale, const float* mids, int n_mids, int slots,
                      uint8_t* codes, T* out_val, uint8_t* out_idx, ParallelFor&& parallel_for) {
  const int row_bytes = packed_bytes(dim, bits), levels = (1 << bits) - 1;
  const int64_t tasks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  std::vector<int64_t> clamped(static_cast<size_t>(tasks), 0);  // one count per task: no shared counter
  parallel_for(tasks, [&](int64_t task_begin, int64_t task_end) {
    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t begin = task * kRowsPerTask, end = std::min(rows, begin + kRowsPerTask);
      float dense[kMaxDim];
      uint8_t code[kMaxDim];
      int64_t mine = 0;
      for (int64_t r = begin; r < end; ++r) {
        const int64_t h = (r / tokens) % heads;
        const float *z = zero + h * dim, *s = scale + h * dim;
        mine += split_vector(x + r * dim, dim, slots, lo + h * dim, hi + h * dim, dim, dense, out_val + r * slots, out_idx + r * slots);
        for (int c = 0; c < dim; ++c) code[c] = code_of(dense[c], z[c], s[c], levels, mids, n_mids);
        pack(code, dim, bits, codes + r * row_bytes);
      }
      clamped[task] = mine;
    }
  });
  int64_t total = 0;
  for (int64_t c : clamped) total += c;
  return total;
}

// kvq::quantize of x [slices, tokens, dim] (slices = the leading dims; head = slice % heads picks
// lo/hi): per-token groups of `group` channels, or per-channel blocks of `group` tokens (`block`
// = tokens for one row over all positions), each group's own range (`group_range`), its entries
// coded by uniform levels or codebook midpoints, packed per row. Scale and zero are written in
// the scale dtype, [slices, tokens, dim / group] (token axis) or [slices, tokens / block, dim].
// With `meta8` (token axis only) scale and zero are written as its uint8 codes instead.
// Returns the clamped count. Work is split into units of rows that share no range: one row
// (token axis) or one block of one slice (channel axis).
template <typename T, typename ParallelFor>
int64_t quantize_groups(const T* x, int64_t slices, int64_t tokens, int64_t heads, int dim, int bits, bool channel_axis,
                        int group, ScaleType scale_type, const float* mids, int n_mids, const float* lo, const float* hi,
                        int slots, uint8_t* codes, void* scale_out, void* zero_out, T* out_val, uint8_t* out_idx,
                        ParallelFor&& parallel_for, const Meta8* meta8 = nullptr) {
  const ScaleInfo si = scale_info(scale_type);
  const int row_bytes = packed_bytes(dim, bits);
  const int levels = n_mids > 0 ? 1 : (1 << bits) - 1;
  const int64_t unit_rows = channel_axis ? group : 1;
  const int64_t units = slices * tokens / unit_rows;
  const int64_t units_per_task = std::max<int64_t>(1, kRowsPerTask / unit_rows);
  const int64_t tasks = (units + units_per_task - 1) / units_per_task;
  std::vector<int64_t> clamped(static_cast<size_t>(tasks), 0);
  parallel_for(tasks, [&](int64_t task_begin, int64_t task_end) {
    std::vector<float> dense(static_cast<size_t>(unit_rows * dim));
    std::vector<float> zero(channel_axis ? dim : dim / group), scale(zero.size());
    uint8_t code[kMaxDim];
    for (int64_t task = task_begin; task < task_end; ++task) {
      int64_t mine = 0;
      for (int64_t unit = task * units_per_task; unit < std::min(units, (task + 1) * units_per_task); ++unit) {
        const int64_t row0 = unit * unit_rows, h = (row0 / tokens) % heads;
        const float* l = lo ? lo + h * dim : nullptr;
        const float* u = hi ? hi + h * dim : nullptr;
        for (int64_t r = 0; r < unit_rows; ++r)
          mine += split_vector(x + (row0 + r) * dim, dim, slots, l, u, group, dense.data() + r * dim,
                               out_val + (row0 + r) * slots, out_idx + (row0 + r) * slots);
        if (channel_axis) {
          for (int c = 0; c < dim; ++c) {
            float mn = dense[c], mx = dense[c];
            for (int64_t r = 1; r < unit_rows; ++r) mn = std::min(mn, dense[r * dim + c]), mx = std::max(mx, dense[r * dim + c]);
            group_range(mn, mx, levels, si, &zero[c], &scale[c]);
            store_scale(zero_out, unit * dim + c, zero[c], si);
            store_scale(scale_out, unit * dim + c, scale[c], si);
          }
        } else {
          const int groups = dim / group;
          for (int g = 0; g < groups; ++g) {
            float mn = dense[g * group], mx = mn;
            for (int c = g * group + 1; c < (g + 1) * group; ++c) mn = std::min(mn, dense[c]), mx = std::max(mx, dense[c]);
            if (meta8) {
              meta8->encode(mn, mx, static_cast<uint8_t*>(scale_out) + row0 * groups + g,
                            static_cast<uint8_t*>(zero_out) + row0 * groups + g, &zero[g], &scale[g]);
              continue;
            }
            group_range(mn, mx, levels, si, &zero[g], &scale[g]);
            store_scale(zero_out, row0 * groups + g, zero[g], si);
            store_scale(scale_out, row0 * groups + g, scale[g], si);
          }
        }
        for (int64_t r = 0; r < unit_rows; ++r) {
          const float* d = dense.data() + r * dim;
          for (int c = 0; c < dim; ++c) {
            const int m = channel_axis ? c : c / group;
            code[c] = code_of(d[c], zero[m], scale[m], levels, mids, n_mids);
          }
          pack(code, dim, bits, codes + (row0 + r) * row_bytes);
        }
      }
      clamped[task] = mine;
    }
  });
  int64_t total = 0;
  for (int64_t c : clamped) total += c;
  return total;
}

}  // namespace kvq_core
