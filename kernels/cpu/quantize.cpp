// kvq::quantize for PyTorch's CPU dispatch key: a tensor coded in groups with ranges of their own
// (per-token groups of channels, or per-channel blocks of tokens), optional codebook levels and
// outliers by either rule: the append of every quantized format but calibrated key ranges
// (kvq::quantize_fixed). The reference (kernels/reference.py) is ~60 ATen ops per call, which
// on the one-token append of a decode step cost far more than the arithmetic; quantize_core.h's
// `quantize_groups` does the same steps in one pass and writes byte-identical results (per-vector
// outliers: the same entries unless two are equally far from the vector's mean, where the
// reference's top-k order is unspecified and this kernel keeps the lower channel).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "quantize_core.h"

namespace kvq_cpu {

// The error of a NaN/Inf entry at flat index `bad` of x (none when bad < 0), naming its index
// (both appends raise it: quantize_fixed.cpp declares it).
void refuse_non_finite(const at::Tensor& x, int64_t bad) {
  if (bad < 0) return;
  std::vector<int64_t> index(static_cast<size_t>(x.dim()));
  for (int64_t d = x.dim() - 1, rest = bad; d >= 0; --d) index[d] = rest % x.size(d), rest /= x.size(d);
  TORCH_CHECK_VALUE(false, kvq_core::kNonFiniteInput, ": x", at::IntArrayRef(index), " is ", x.reshape(-1)[bad].item<double>(),
                    "; a quantized cache does not store NaN or Inf");
}

namespace {

using kvq_core::kMaxDim;
using kvq_core::packed_bytes;

kvq_core::ScaleType scale_type_of(at::ScalarType t) {
  switch (t) {
    case at::kHalf: return kvq_core::ScaleType::Half;
    case at::kBFloat16: return kvq_core::ScaleType::BFloat16;
    case at::kFloat: return kvq_core::ScaleType::Float;
    default: TORCH_CHECK_VALUE(false, "kvq: scale_dtype must be float16, bfloat16 or float32, got ", t);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> quantize(
    const at::Tensor& x, at::IntArrayRef format, at::ScalarType scale_dtype, const at::Tensor& codebook,
    const at::Tensor& lo, const at::Tensor& hi, int64_t n_outliers) {
  TORCH_CHECK_VALUE(format.size() == kvq_format::kIntFields, "kvq: a format lists ", kvq_format::kIntFields, " ints, got ", format.size());
  const int64_t bits = format[kvq_format::BITS], axis = format[kvq_format::AXIS], group = format[kvq_format::GROUP];
  TORCH_CHECK_VALUE(kvq_format::is_packed_bits(bits), "kvq: bits must be one of ", kvq_format::kPackedBitsText, ", got ", bits);
  TORCH_CHECK_VALUE(axis == kvq_format::kAxisToken || axis == kvq_format::kAxisChannel, "kvq: axis must be ",
                    kvq_format::kAxisToken, " (token) or ", kvq_format::kAxisChannel, " (channel), got ", axis);
  TORCH_CHECK_VALUE(group > 0 || kvq_format::is_one_row(axis, group), "kvq: group size must be positive (or ", kvq_format::kOneRow,
                    ", one row for every position, with per-channel groups), got ", group);
  const int64_t meta = format[kvq_format::META];
  TORCH_CHECK_VALUE(kvq_format::is_valid_meta(meta), "kvq: meta must be ", kvq_format::kFloatMeta, " (float scale and zero) or ",
                    kvq_format::kMetaOffset, " + e with |e| <= ", kvq_format::kMetaExponentBound, " (8-bit), got ", meta);
  TORCH_CHECK_VALUE(!kvq_format::is_meta8(meta) || axis == kvq_format::kAxisToken, "kvq: 8-bit metadata (meta ", meta,
                    ") codes per-token groups of packed codes (their ranges contain 0), got axis ", axis);
  TORCH_CHECK_VALUE(x.dim() >= 2 && x.is_floating_point(), "kvq: quantize takes floating-point x as [..., tokens, head_dim], got ",
                    x.scalar_type(), " ", x.sizes());
  const int64_t tokens = x.size(-2), dim = x.size(-1);
  const bool channel = axis == kvq_format::kAxisChannel;
  const int64_t block = kvq_format::is_one_row(axis, group) ? tokens : group;
  TORCH_CHECK_VALUE(channel || dim % group == 0, "per-token group size ", group, " does not divide head_dim ", dim);
  TORCH_CHECK_VALUE(!channel || (block > 0 && tokens % block == 0), "per-channel quantization needs whole blocks of ", group,
                    " tokens, got ", tokens, " tokens");
  const int64_t planes = kvq_format::codes_per_word(bits);
  TORCH_CHECK_VALUE(dim % planes == 0 && dim <= kMaxDim, "kvq: ", bits, "-bit codes need head_dim a multiple of ", planes,
                    " and at most ", kMaxDim, ", got ", dim);
  TORCH_CHECK_VALUE(codebook.numel() == 0 || (bits <= 4 && codebook.dim() == 1 && codebook.numel() == (int64_t{1} << bits)),
                    "kvq: a codebook must hold 2**bits levels for bits in (2, 3, 4); got ", codebook.sizes(), " for ", bits, " bits");
  TORCH_CHECK_VALUE(n_outliers >= 0 && n_outliers <= dim, "kvq: n_outliers must be in [0, head_dim=", dim, "], got ", n_outliers);
  const bool by_channel = n_outliers > 0 && lo.numel() > 0;
  int64_t heads = 1;
  if (n_outliers > 0) {
    TORCH_CHECK_VALUE(x.dim() == 4, "kvq: outliers need x as [batch, heads, tokens, head_dim]");
    TORCH_CHECK_VALUE(dim <= kvq_format::kMaxOutlierHeadDim, "kvq: outliers need head_dim <= ", kvq_format::kMaxOutlierHeadDim,
                      " (uint8 channel indices), got ", dim);
    heads = x.size(1);
    if (by_channel) {
      for (const at::Tensor* t : {&lo, &hi})
        TORCH_CHECK_VALUE(t->dim() == 2 && t->size(0) == heads && t->size(1) == dim, "kvq: outlier thresholds must be [heads, head_dim] = [",
                          heads, ", ", dim, "], got ", lo.sizes(), " and ", hi.sizes());
    } else {
      TORCH_CHECK_VALUE(hi.numel() == 0, "kvq: outlier thresholds must be [heads, head_dim] = [", heads, ", ", dim, "], got ",
                        lo.sizes(), " and ", hi.sizes());
      TORCH_CHECK_VALUE(!channel, "kvq: per-vector outliers (empty lo/hi) need the per-token axis; per-channel groups need calibrated thresholds");
    }
  }
  const kvq_core::ScaleType st = scale_type_of(scale_dtype);
  auto f32 = [](const at::Tensor& t) { return t.to(at::kFloat).contiguous(); };
  const at::Tensor lo_f = by_channel ? f32(lo) : at::Tensor(), hi_f = by_channel ? f32(hi) : at::Tensor();
  const at::Tensor mids = codebook.numel() ? f32((codebook.slice(0, 1).to(at::kFloat) + codebook.slice(0, 0, -1).to(at::kFloat)) * 0.5)
                                           : at::empty({0}, x.options().dtype(at::kFloat));
  const at::Tensor xc = x.contiguous();
  std::vector<int64_t> lead(x.sizes().begin(), x.sizes().end() - 2);
  auto shape = [&](std::initializer_list<int64_t> tail) {
    std::vector<int64_t> s = lead;
    s.insert(s.end(), tail);
    return s;
  };
  at::Tensor codes = at::empty(shape({tokens, packed_bytes(dim, bits)}), x.options().dtype(at::kByte));
  const auto meta_shape = channel ? shape({tokens / block, dim}) : shape({tokens, dim / group});
  const auto stored = kvq_format::is_meta8(meta) ? at::kByte : scale_dtype;
  at::Tensor scale = at::empty(meta_shape, x.options().dtype(stored)), zero = at::empty(meta_shape, x.options().dtype(stored));
  const std::optional<kvq_core::Meta8> meta8 = kvq_core::Meta8::of(meta, bits, codebook.numel() > 0);
  at::Tensor out_val = at::empty(shape({tokens, n_outliers}), x.options());
  at::Tensor out_idx = at::empty(shape({tokens, n_outliers}), x.options().dtype(at::kByte));
  const int64_t slices = tokens ? xc.numel() / (tokens * dim) : 0;
  int64_t clamped = 0;
  if (slices > 0 && tokens > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "kvq_quantize", [&] {
      refuse_non_finite(x, kvq_core::first_non_finite(xc.data_ptr<scalar_t>(), xc.numel()));
      clamped = kvq_core::quantize_groups<scalar_t>(
          xc.data_ptr<scalar_t>(), slices, tokens, heads, static_cast<int>(dim), static_cast<int>(bits), channel,
          static_cast<int>(channel ? block : group), st, mids.data_ptr<float>(), static_cast<int>(mids.numel()),
          by_channel ? lo_f.data_ptr<float>() : nullptr, by_channel ? hi_f.data_ptr<float>() : nullptr, static_cast<int>(n_outliers),
          codes.data_ptr<uint8_t>(), scale.data_ptr(), zero.data_ptr(), out_val.data_ptr<scalar_t>(), out_idx.data_ptr<uint8_t>(),
          [](int64_t n, const auto& fn) { at::parallel_for(0, n, 1, fn); }, meta8 ? &*meta8 : nullptr);
    });
  }
  return {codes, scale, zero, out_val, out_idx, at::scalar_tensor(clamped, x.options().dtype(at::kLong))};
}

}  // namespace

TORCH_LIBRARY_IMPL(kvq, CPU, m) { m.impl("quantize", &quantize); }

}  // namespace kvq_cpu
