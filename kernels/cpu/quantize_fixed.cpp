// kvq::quantize_fixed for PyTorch's CPU dispatch key: keys coded on arrival against calibrated
// per-channel ranges (KVQuant's per-channel keys), one vector of head_dim entries at a time.
//
// The reference (kernels/reference.py) is a dozen ATen ops and a top-k per call; on the decode hot
// path (one token per layer and step) their dispatch overhead is the cost, not the arithmetic. This
// kernel does the same steps in one pass per vector and writes byte-identical results:
//   * outliers: entries outside their channel's [lo, hi], ranked by excess / (hi - lo); the
//     n_outliers largest keep their exact value (ties: the lower channel first), the rest are
//     counted as clamped; every entry is clamped into [lo, hi];
//   * codes: u = (dense - zero) / scale in float32 (scale 0 reads as 1), then the uniform grid
//     (round half to even, clamped to [0, 2^bits - 1]) or the number of codebook midpoints below u;
//   * planar packing of `kvq_ao.quant.packing` (8 / bits planes of head_dim * bits / 8 bytes; 3 bits:
//     8 planes in 24-bit words stored as three byte planes).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "kvq_format.h"  // generated from kvq_ao/format.py into the build directory

namespace kvq_cpu {
namespace {

using kvq_format::kEmptySlot;  // the index of an unused outlier slot (kvq_ao/format.py)
constexpr int kMaxDim = 256;

int packed_bytes(int64_t dim, int64_t bits) { return static_cast<int>(kvq_format::packed_row_bytes(dim, bits)); }

void pack(const uint8_t* code, int dim, int bits, uint8_t* out) {
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

template <typename T>
int64_t quantize_rows(const T* x, int64_t rows, int64_t tokens, int64_t heads, int dim, int bits, const float* lo,
                      const float* hi, const float* zero, const float* scale, const float* mids, int n_mids, int slots,
                      uint8_t* codes, T* out_val, uint8_t* out_idx) {
  const int row_bytes = packed_bytes(dim, bits);
  const float top_code = static_cast<float>((1 << bits) - 1);
  std::vector<int64_t> clamped(at::get_num_threads() + 1, 0);
  at::parallel_for(0, rows, 64, [&](int64_t begin, int64_t end) {
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
      for (int j = 0; j < slots; ++j) {
        int best = 0;
        for (int c = 1; c < dim; ++c)
          if (excess[c] > excess[best]) best = c;  // strict: the lower channel wins a tie
        const bool keep = excess[best] > 0.0f;
        out_val[r * slots + j] = keep ? xr[best] : T(0);
        out_idx[r * slots + j] = keep ? static_cast<uint8_t>(best) : kEmptySlot;
        kept += keep;
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
    clamped[at::get_thread_num()] += mine;
  });
  int64_t total = 0;
  for (int64_t c : clamped) total += c;
  return total;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize_fixed(
    const at::Tensor& x, int64_t bits, const at::Tensor& zero, const at::Tensor& scale, const at::Tensor& codebook,
    const at::Tensor& lo, const at::Tensor& hi, int64_t n_outliers) {
  TORCH_CHECK_VALUE(kvq_format::is_packed_bits(bits), "kvq: bits must be one of ", kvq_format::kPackedBitsText, ", got ", bits);
  TORCH_CHECK_VALUE(x.dim() == 4, "kvq: quantize_fixed takes x as [batch, heads, tokens, head_dim], got ", x.sizes());
  TORCH_CHECK_VALUE(x.is_floating_point(), "kvq: quantize_fixed takes floating-point x, got ", x.scalar_type());
  const int64_t heads = x.size(1), tokens = x.size(2), dim = x.size(3);
  const int64_t planes = kvq_format::codes_per_word(bits);
  TORCH_CHECK_VALUE(dim % planes == 0 && dim <= kMaxDim, "kvq: ", bits, "-bit codes need head_dim a multiple of ", planes,
                    " and at most ", kMaxDim, ", got ", dim);
  const std::pair<const char*, const at::Tensor*> ranges[4] = {{"zero", &zero}, {"scale", &scale}, {"lo", &lo}, {"hi", &hi}};
  for (const auto& [name, t] : ranges)
    TORCH_CHECK_VALUE(t->dim() == 2 && t->size(0) == heads && t->size(1) == dim, "kvq: fixed ranges need ", name,
                      " as [heads, head_dim] = [", heads, ", ", dim, "], got ", t->sizes());
  TORCH_CHECK_VALUE(n_outliers >= 0 && n_outliers <= dim && (n_outliers == 0 || dim <= kvq_format::kMaxOutlierHeadDim), "kvq: n_outliers must be in [0, head_dim=",
                    dim, "] with head_dim <= ", kvq_format::kMaxOutlierHeadDim, ", got ", n_outliers);
  TORCH_CHECK_VALUE(codebook.numel() == 0 || (bits <= 4 && codebook.dim() == 1 && codebook.numel() == (int64_t{1} << bits)),
                    "kvq: a ", bits, "-bit codebook must hold ", (int64_t{1} << bits), " levels, got ", codebook.sizes());
  auto f32 = [](const at::Tensor& t) { return t.to(at::kFloat).contiguous(); };
  const at::Tensor lo_f = f32(lo), hi_f = f32(hi), zero_f = f32(zero), scale_f = f32(scale);
  at::Tensor mids = codebook.numel() ? f32((codebook.slice(0, 1).to(at::kFloat) + codebook.slice(0, 0, -1).to(at::kFloat)) * 0.5)
                                     : at::empty({0}, x.options().dtype(at::kFloat));
  const at::Tensor xc = x.contiguous();
  at::Tensor codes = at::empty({x.size(0), heads, tokens, packed_bytes(dim, bits)}, x.options().dtype(at::kByte));
  at::Tensor out_val = at::empty({x.size(0), heads, tokens, n_outliers}, x.options());
  at::Tensor out_idx = at::empty({x.size(0), heads, tokens, n_outliers}, x.options().dtype(at::kByte));
  const int64_t rows = x.size(0) * heads * tokens;
  int64_t clamped = 0;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "kvq_quantize_fixed", [&] {
    clamped = quantize_rows<scalar_t>(xc.data_ptr<scalar_t>(), rows, tokens, heads, static_cast<int>(dim), static_cast<int>(bits),
                                      lo_f.data_ptr<float>(), hi_f.data_ptr<float>(), zero_f.data_ptr<float>(),
                                      scale_f.data_ptr<float>(), mids.data_ptr<float>(), static_cast<int>(mids.numel()),
                                      static_cast<int>(n_outliers), codes.data_ptr<uint8_t>(), out_val.data_ptr<scalar_t>(),
                                      out_idx.data_ptr<uint8_t>());
  });
  return {codes, out_val, out_idx, at::scalar_tensor(clamped, x.options().dtype(at::kLong))};
}

}  // namespace

TORCH_LIBRARY_IMPL(kvq, CPU, m) { m.impl("quantize_fixed", &quantize_fixed); }

}  // namespace kvq_cpu
