// kvq::quantize_fixed for PyTorch's CPU dispatch key: keys coded on arrival against calibrated
// per-channel ranges (KVQuant's per-channel keys), one vector of head_dim entries at a time.
//
// The reference (kernels/reference.py) is a dozen ATen ops and a top-k per call; on the decode hot
// path (one token per layer and step) their dispatch overhead is the cost, not the arithmetic. The
// arithmetic (quantize_core.h) does the same steps in one pass per vector and writes byte-identical
// results; this file checks the arguments, allocates the outputs and runs it on ATen's thread pool.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

#include "quantize_core.h"

namespace kvq_cpu {

void refuse_non_finite(const at::Tensor& x, int64_t bad);  // quantize.cpp

namespace {

using kvq_core::kMaxDim;
using kvq_core::packed_bytes;

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
    refuse_non_finite(x, kvq_core::first_non_finite(xc.data_ptr<scalar_t>(), xc.numel()));
    clamped = kvq_core::quantize_rows<scalar_t>(xc.data_ptr<scalar_t>(), rows, tokens, heads, static_cast<int>(dim), static_cast<int>(bits),
                                      lo_f.data_ptr<float>(), hi_f.data_ptr<float>(), zero_f.data_ptr<float>(),
                                      scale_f.data_ptr<float>(), mids.data_ptr<float>(), static_cast<int>(mids.numel()),
                                      static_cast<int>(n_outliers), codes.data_ptr<uint8_t>(), out_val.data_ptr<scalar_t>(),
                                      out_idx.data_ptr<uint8_t>(),
                                                [](int64_t n, const auto& fn) { at::parallel_for(0, n, 1, fn); });
  });
  return {codes, out_val, out_idx, at::scalar_tensor(clamped, x.options().dtype(at::kLong))};
}

}  // namespace

TORCH_LIBRARY_IMPL(kvq, CPU, m) { m.impl("quantize_fixed", &quantize_fixed); }

}  // namespace kvq_cpu
