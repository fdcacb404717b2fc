// kvq::decode_attention.out, kvq::quantize.out and kvq::quantize_fixed.out for the ExecuTorch runtime: the same arithmetic
// as the PyTorch CPU ops (attention_core.h, quantize_core.h), registered in ExecuTorch's kernel
// registry, so a `.pte` whose program calls them runs them natively instead of the decomposed
// reference (the one-token append decomposed to ~60 portable ops per operand and layer). Built against the headers and
// libexecutorch.so of the installed executorch wheel (kvq_ao/kernels/cpu/executorch_library.py);
// ExecuTorch tensors are contiguous, and the exported q and output are float32.

#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>
#include <omp.h>

#include <optional>

#include "attention_core.h"
#include "quantize_core.h"

namespace kvq_executorch {
namespace {

using executorch::aten::ArrayRef;
using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::KernelRuntimeContext;

// parallel_for of the kernel cores: fn(i, i + 1) for each task i < n, on OpenMP's threads.
const auto omp_tasks = [](int64_t n, const auto& fn) {
#pragma omp parallel for schedule(static, 1)
  for (int64_t i = 0; i < n; ++i) fn(i, i + 1);
};

// The appends' refusal of NaN/Inf, with the cache's message (the step fails; the runtime logs it).
void refuse_non_finite(const float* x, int64_t n) {
  const int64_t bad = kvq_core::first_non_finite(x, n);
  kvq_core::check(bad < 0, kvq_core::kNonFiniteInput, ": x has NaN or Inf at flat index ", bad, "; a quantized cache does not store NaN or Inf");
}

// The decision thresholds between a float32 codebook's neighbouring levels (none without one), as
// the PyTorch ops compute them.
std::vector<float> codebook_mids(const Tensor& codebook) {
  std::vector<float> mids;
  const float* levels = codebook.numel() ? codebook.const_data_ptr<float>() : nullptr;
  for (int64_t i = 0; levels && i + 1 < codebook.numel(); ++i) mids.push_back((levels[i + 1] + levels[i]) * 0.5f);
  return mids;
}

// ATTENTION_SCHEMA's arguments (kvq_ao/ops.py) then `out`; each operand's lists are read by
// kvq_format.h's indices.
Tensor& decode_attention_out(
    KernelRuntimeContext& ctx, const Tensor& q, ArrayRef<std::optional<Tensor>> k, ArrayRef<int64_t> k_format,
    ArrayRef<std::optional<Tensor>> v, ArrayRef<int64_t> v_format, const Tensor& side_pos, const Tensor& body_end,
    const Tensor& mask, std::optional<Tensor> rope_inv_freq, int64_t body_start, double scaling, double rope_scale,
    double softcap, Tensor& out) {
  try {
    kvq_core::Args a = kvq_core::make_args(q, k, k_format, v, v_format, side_pos, body_end, mask, rope_inv_freq, body_start,
                                           scaling, rope_scale, softcap);
    int64_t sizes[3];
    kvq_core::output_sizes(a, sizes);
    kvq_core::check(out.scalar_type() == ScalarType::Float && out.dim() == 4 && out.size(0) == sizes[0] && out.size(1) == sizes[1] &&
                        out.size(2) == 1 && out.size(3) == sizes[2],
                    "out must be float32 [", sizes[0], ", ", sizes[1], ", 1, ", sizes[2], "]");
    kvq_core::decode_attention(a, out.mutable_data_ptr<float>(), omp_get_max_threads(), omp_tasks);
  } catch (const std::invalid_argument& e) {
    ET_LOG(Error, "%s", e.what());
    ctx.fail(executorch::runtime::Error::InvalidArgument);
  }
  return out;
}

// Out tensors are memory-planned from the op's fake (kvq_ao/ops.py) with static shapes: checked, not resized.
void expect_shape(const Tensor& t, const char* name, std::initializer_list<int64_t> sizes) {
  bool ok = t.dim() == static_cast<int64_t>(sizes.size());
  int d = 0;
  for (int64_t s : sizes) ok = ok && t.size(d++) == s;
  kvq_core::check(ok, "kvq::quantize.out: ", name, " has the wrong shape");
}

// kvq::quantize's arguments (kvq_ao/ops.py) then its six outputs; float32 x (the exported models'
// dtype), the codes of `kvq_core::quantize_groups`, byte for byte those of the PyTorch CPU op.
std::tuple<Tensor&, Tensor&, Tensor&, Tensor&, Tensor&, Tensor&> quantize_out(
    KernelRuntimeContext& ctx, const Tensor& x, ArrayRef<int64_t> format, ScalarType scale_dtype, const Tensor& codebook,
    const Tensor& lo, const Tensor& hi, int64_t n_outliers, Tensor& codes, Tensor& scale, Tensor& zero, Tensor& out_val,
    Tensor& out_idx, Tensor& clamped) {
  try {
    kvq_core::check(format.size() == kvq_format::kIntFields, "kvq::quantize.out: a format lists ", kvq_format::kIntFields, " ints");
    const int64_t bits = format[kvq_format::BITS], axis = format[kvq_format::AXIS], group = format[kvq_format::GROUP];
    kvq_core::check(kvq_format::is_packed_bits(bits), "kvq::quantize.out: bits must be one of ", kvq_format::kPackedBitsText);
    const int64_t meta = format[kvq_format::META];
    const bool meta8 = kvq_format::is_meta8(meta);
    kvq_core::check(kvq_format::is_valid_meta(meta) && (!meta8 || axis == kvq_format::kAxisToken),
                    "kvq::quantize.out: 8-bit metadata codes per-token groups, with meta ", kvq_format::kMetaOffset, " + e, |e| <= ",
                    kvq_format::kMetaExponentBound);
    kvq_core::check(x.scalar_type() == ScalarType::Float && x.dim() == 4, "kvq::quantize.out: x must be float32 [B, H, T, D]");
    const bool channel = axis == kvq_format::kAxisChannel;
    const int64_t B = x.size(0), H = x.size(1), tokens = x.size(2), dim = x.size(3);
    const int64_t block = kvq_format::is_one_row(axis, group) ? tokens : group;
    kvq_core::check(block > 0 && (channel ? tokens % block == 0 : dim % group == 0) && dim <= kvq_core::kMaxDim &&
                        dim % kvq_format::codes_per_word(bits) == 0,
                    "kvq::quantize.out: the format does not tile x");
    kvq_core::ScaleType st;
    switch (scale_dtype) {
      case ScalarType::Half: st = kvq_core::ScaleType::Half; break;
      case ScalarType::BFloat16: st = kvq_core::ScaleType::BFloat16; break;
      case ScalarType::Float: st = kvq_core::ScaleType::Float; break;
      default: throw std::invalid_argument("kvq::quantize.out: scale_dtype must be float16, bfloat16 or float32");
    }
    const bool by_channel = n_outliers > 0 && lo.numel() > 0;
    kvq_core::check(n_outliers >= 0 && n_outliers <= dim, "kvq::quantize.out: n_outliers must be in [0, head_dim]");
    kvq_core::check(!by_channel || (lo.scalar_type() == ScalarType::Float && hi.scalar_type() == ScalarType::Float &&
                                    lo.numel() == H * dim && hi.numel() == H * dim),
                    "kvq::quantize.out: outlier thresholds must be float32 [heads, head_dim]");
    kvq_core::check(codebook.numel() == 0 || (codebook.scalar_type() == ScalarType::Float && codebook.numel() == (int64_t{1} << bits)),
                    "kvq::quantize.out: a codebook must be float32 with 2**bits levels");
    const std::vector<float> mids = codebook_mids(codebook);
    expect_shape(codes, "codes", {B, H, tokens, kvq_core::packed_bytes(dim, bits)});
    if (channel) expect_shape(scale, "scale", {B, H, tokens / block, dim}), expect_shape(zero, "zero", {B, H, tokens / block, dim});
    else expect_shape(scale, "scale", {B, H, tokens, dim / group}), expect_shape(zero, "zero", {B, H, tokens, dim / group});
    expect_shape(out_val, "out_val", {B, H, tokens, n_outliers});
    expect_shape(out_idx, "out_idx", {B, H, tokens, n_outliers});
    const ScalarType stored = meta8 ? ScalarType::Byte : scale_dtype;
    kvq_core::check(scale.scalar_type() == stored && zero.scalar_type() == stored && out_val.scalar_type() == ScalarType::Float &&
                        out_idx.scalar_type() == ScalarType::Byte && codes.scalar_type() == ScalarType::Byte &&
                        clamped.scalar_type() == ScalarType::Long && clamped.numel() == 1,
                    "kvq::quantize.out: an output has the wrong dtype");
    const float* xp = x.const_data_ptr<float>();
    refuse_non_finite(xp, x.numel());
    int64_t n_clamped = 0;
    const std::optional<kvq_core::Meta8> coder = kvq_core::Meta8::of(meta, bits, codebook.numel() > 0);
    if (x.numel() > 0)
      n_clamped = kvq_core::quantize_groups<float>(
          xp, B * H, tokens, n_outliers > 0 ? H : 1, static_cast<int>(dim), static_cast<int>(bits), channel,
          static_cast<int>(channel ? block : group), st, mids.data(), static_cast<int>(mids.size()),
          by_channel ? lo.const_data_ptr<float>() : nullptr, by_channel ? hi.const_data_ptr<float>() : nullptr,
          static_cast<int>(n_outliers), codes.mutable_data_ptr<uint8_t>(), scale.mutable_data_ptr(), zero.mutable_data_ptr(),
          out_val.mutable_data_ptr<float>(), out_idx.mutable_data_ptr<uint8_t>(), omp_tasks, coder ? &*coder : nullptr);
    clamped.mutable_data_ptr<int64_t>()[0] = n_clamped;
  } catch (const std::invalid_argument& e) {
    ET_LOG(Error, "%s", e.what());
    ctx.fail(executorch::runtime::Error::InvalidArgument);
  }
  return {codes, scale, zero, out_val, out_idx, clamped};
}

// A [heads, head_dim] range of float32, float16 or bfloat16 (the cache keeps them in its scale
// dtype) as floats, as the PyTorch op's `.to(float)` reads them.
std::vector<float> range_floats(const Tensor& t, const char* name, int64_t heads, int64_t dim) {
  const kvq_core::DType type = kvq_core::dtype_of_code(static_cast<int>(t.scalar_type()));
  kvq_core::check(t.dim() == 2 && t.size(0) == heads && t.size(1) == dim, "kvq::quantize_fixed.out: ", name,
                  " must be [heads, head_dim] = [", heads, ", ", dim, "]");
  kvq_core::check(type == kvq_core::DType::Float || type == kvq_core::DType::Half || type == kvq_core::DType::BFloat16,
                  "kvq::quantize_fixed.out: ", name, " must be float32, float16 or bfloat16");
  std::vector<float> out(static_cast<size_t>(heads * dim));
  kvq_core::load_floats(t.const_data_ptr(), type, heads * dim, out.data());
  return out;
}

// kvq::quantize_fixed's arguments (keys coded against calibrated per-channel ranges) then its four
// outputs; float32 x, the codes of `kvq_core::quantize_rows`, byte for byte those of the PyTorch CPU op.
std::tuple<Tensor&, Tensor&, Tensor&, Tensor&> quantize_fixed_out(
    KernelRuntimeContext& ctx, const Tensor& x, int64_t bits, const Tensor& zero, const Tensor& scale, const Tensor& codebook,
    const Tensor& lo, const Tensor& hi, int64_t n_outliers, Tensor& codes, Tensor& out_val, Tensor& out_idx, Tensor& clamped) {
  try {
    kvq_core::check(kvq_format::is_packed_bits(bits), "kvq::quantize_fixed.out: bits must be one of ", kvq_format::kPackedBitsText);
    kvq_core::check(x.scalar_type() == ScalarType::Float && x.dim() == 4, "kvq::quantize_fixed.out: x must be float32 [B, H, T, D]");
    const int64_t B = x.size(0), H = x.size(1), tokens = x.size(2), dim = x.size(3);
    kvq_core::check(dim <= kvq_core::kMaxDim && dim % kvq_format::codes_per_word(bits) == 0,
                    "kvq::quantize_fixed.out: ", bits, "-bit codes need head_dim a multiple of ", kvq_format::codes_per_word(bits),
                    " and at most ", kvq_core::kMaxDim);
    kvq_core::check(n_outliers >= 0 && n_outliers <= dim && (n_outliers == 0 || dim <= kvq_format::kMaxOutlierHeadDim),
                    "kvq::quantize_fixed.out: n_outliers must be in [0, head_dim]");
    kvq_core::check(codebook.numel() == 0 || (bits <= 4 && codebook.scalar_type() == ScalarType::Float && codebook.numel() == (int64_t{1} << bits)),
                    "kvq::quantize_fixed.out: a codebook must be float32 with 2**bits levels");
    const std::vector<float> lo_f = range_floats(lo, "lo", H, dim), hi_f = range_floats(hi, "hi", H, dim);
    const std::vector<float> zero_f = range_floats(zero, "zero", H, dim), scale_f = range_floats(scale, "scale", H, dim);
    const std::vector<float> mids = codebook_mids(codebook);
    expect_shape(codes, "codes", {B, H, tokens, kvq_core::packed_bytes(dim, bits)});
    expect_shape(out_val, "out_val", {B, H, tokens, n_outliers});
    expect_shape(out_idx, "out_idx", {B, H, tokens, n_outliers});
    kvq_core::check(codes.scalar_type() == ScalarType::Byte && out_val.scalar_type() == ScalarType::Float &&
                        out_idx.scalar_type() == ScalarType::Byte && clamped.scalar_type() == ScalarType::Long && clamped.numel() == 1,
                    "kvq::quantize_fixed.out: an output has the wrong dtype");
    const float* xp = x.const_data_ptr<float>();
    refuse_non_finite(xp, x.numel());
    int64_t n_clamped = 0;
    if (x.numel() > 0)
      n_clamped = kvq_core::quantize_rows<float>(
          xp, B * H * tokens, tokens, H, static_cast<int>(dim), static_cast<int>(bits), lo_f.data(), hi_f.data(), zero_f.data(),
          scale_f.data(), mids.data(), static_cast<int>(mids.size()), static_cast<int>(n_outliers), codes.mutable_data_ptr<uint8_t>(),
          out_val.mutable_data_ptr<float>(), out_idx.mutable_data_ptr<uint8_t>(), omp_tasks);
    clamped.mutable_data_ptr<int64_t>()[0] = n_clamped;
  } catch (const std::invalid_argument& e) {
    ET_LOG(Error, "%s", e.what());
    ctx.fail(executorch::runtime::Error::InvalidArgument);
  }
  return {codes, out_val, out_idx, clamped};
}

}  // namespace
}  // namespace kvq_executorch

EXECUTORCH_LIBRARY(kvq, "decode_attention.out", kvq_executorch::decode_attention_out);
// Registered boxed by hand: ExecuTorch's unboxing wrapper (EXECUTORCH_LIBRARY) takes one out tensor.
namespace kvq_executorch {
namespace {
void quantize_out_boxed(KernelRuntimeContext& ctx, executorch::runtime::Span<executorch::runtime::EValue*> stack) {
  // the 13 arguments, then the returned tuple (a tensor list aliasing the outs)
  ET_KERNEL_CHECK_MSG(ctx, stack.size() == 14, InvalidArgument, , "kvq::quantize.out: 14 stack values expected, got %zu",
                      stack.size());
  quantize_out(ctx, stack[0]->toTensor(), stack[1]->toIntList(), stack[2]->toScalarType(), stack[3]->toTensor(),
               stack[4]->toTensor(), stack[5]->toTensor(), stack[6]->toInt(), stack[7]->toTensor(), stack[8]->toTensor(),
               stack[9]->toTensor(), stack[10]->toTensor(), stack[11]->toTensor(), stack[12]->toTensor());
}
const auto quantize_registered =
    executorch::runtime::register_kernel(executorch::runtime::Kernel("kvq::quantize.out", quantize_out_boxed));
void quantize_fixed_out_boxed(KernelRuntimeContext& ctx, executorch::runtime::Span<executorch::runtime::EValue*> stack) {
  // the 12 arguments, then the returned tuple
  ET_KERNEL_CHECK_MSG(ctx, stack.size() == 13, InvalidArgument, , "kvq::quantize_fixed.out: 13 stack values expected, got %zu",
                      stack.size());
  quantize_fixed_out(ctx, stack[0]->toTensor(), stack[1]->toInt(), stack[2]->toTensor(), stack[3]->toTensor(), stack[4]->toTensor(),
                     stack[5]->toTensor(), stack[6]->toTensor(), stack[7]->toInt(), stack[8]->toTensor(), stack[9]->toTensor(),
                     stack[10]->toTensor(), stack[11]->toTensor());
}
const auto quantize_fixed_registered =
    executorch::runtime::register_kernel(executorch::runtime::Kernel("kvq::quantize_fixed.out", quantize_fixed_out_boxed));
}  // namespace
}  // namespace kvq_executorch
