// The arithmetic of kvq::quantize_fixed on CPU (keys coded on arrival against calibrated per-channel
// ranges, one vector at a time), free of ATen and ExecuTorch: quantize_fixed.cpp registers it with
// PyTorch, conformance_main.cpp runs it on case files for other CPUs (kvq_ao.kernels.cpu.portable).
// What it computes, byte for byte, is the reference's `quantize_fixed` (kernels/reference.py):
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

// Rows [B * H * T] of x [.., head_dim] coded against their head's ranges; returns the clamped count.
// parallel_for(n, fn) calls fn(begin, end) over [0, n) in chunks (ATen's thread pool, or a loop);
// the rows go in tasks of kRowsPerTask.
constexpr int64_t kRowsPerTask = 64;

template <typename T, typename ParallelFor>
int64_t quantize_rows(const T* x, int64_t rows, int64_t tokens, int64_t heads, int dim, int bits, const float* lo,
                      const float* hi, const float* zero, const float* scale, const float* mids, int n_mids, int slots,
                      uint8_t* codes, T* out_val, uint8_t* out_idx, ParallelFor&& parallel_for) {
  const int row_bytes = packed_bytes(dim, bits);
  const float top_code = static_cast<float>((1 << bits) - 1);
  const int64_t tasks = (rows + kRowsPerTask - 1) / kRowsPerTask;
  std::vector<int64_t> clamped(static_cast<size_t>(tasks), 0);  // one count per task: no shared counter
  parallel_for(tasks, [&](int64_t task_begin, int64_t task_end) {
    for (int64_t task = task_begin; task < task_end; ++task) {
      const int64_t begin = task * kRowsPerTask, end = std::min(rows, begin + kRowsPerTask);
      float dense[kMaxDim], excess[kMaxDim];
      uint8_t code[kMaxDim];
      int64_t mine = 0;
      for (int64_t r = begin; r < end; ++r) {
        const int64_t h = (r / tokens) % heads;
        const T* xr = x + r * dim;
        const float *l = lo + h * dim, *u = hi + h * dim, *z = zero + h * dim, *s = scale + h * dim;
        int outside = 0;
        for (int c = 0; c < dim; ++c) {
          const float v = static_cast<float>(xr[c]);
          // as split_outliers: relu(x - hi) + relu(lo - x) over max(hi - lo, FLT_MIN)
          const float width = std::max(u[c] - l[c], 1.17549435082228750797e-38f);
          excess[c] = (std::max(v - u[c], 0.0f) + std::max(l[c] - v, 0.0f)) / width;
          dense[c] = std::min(std::max(v, l[c]), u[c]);
          outside += slots > 0 ? (excess[c] > 0.0f) : (v < l[c] || v > u[c]);
        }
        int kept = 0;
        for (int j = 0; j < slots; ++j) {  // every slot holds an exact entry (kvq_ao/format.py): free ones
          int best = 0;                    // take the lowest other channels, whose excess is 0
          for (int c = 1; c < dim; ++c)
            if (excess[c] > excess[best]) best = c;  // strict: the lower channel wins a tie
          kept += excess[best] > 0.0f;
          out_val[r * slots + j] = xr[best];
          out_idx[r * slots + j] = static_cast<uint8_t>(best);
          excess[best] = -1.0f;
        }
        mine += outside - kept;
        for (int c = 0; c < dim; ++c) {
          const float q = (dense[c] - z[c]) / (s[c] > 0.0f ? s[c] : 1.0f);
          if (n_mids > 0) {
            int k = 0;
            for (int m = 0; m < n_mids; ++m) k += q > mids[m];
            code[c] = static_cast<uint8_t>(k);
          } else {
            code[c] = static_cast<uint8_t>(std::min(std::max(std::nearbyint(q), 0.0f), top_code));  // to nearest even
          }
        }
        pack(code, dim, bits, codes + r * row_bytes);
      }
      clamped[task] = mine;
    }
  });
  int64_t total = 0;
  for (int64_t c : clamped) total += c;
  return total;
}

}  // namespace kvq_core
