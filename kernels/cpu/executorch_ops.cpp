// kvq::decode_attention.out for the ExecuTorch runtime: the same arithmetic as the PyTorch CPU op
// (attention_core.h), registered in ExecuTorch's kernel registry, so a `.pte` whose program calls
// the op runs it natively instead of the decomposed reference. Built against the headers and
// libexecutorch.so of the installed executorch wheel (kvq_ao/kernels/cpu/executorch_library.py);
// ExecuTorch tensors are contiguous, and the exported q and output are float32.

#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/kernel/kernel_includes.h>
#include <omp.h>

#include "attention_core.h"

namespace kvq_executorch {
namespace {

using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::KernelRuntimeContext;

Tensor& decode_attention_out(
    KernelRuntimeContext& ctx, const Tensor& q,
    const Tensor& k_codes, std::optional<Tensor> k_scale, std::optional<Tensor> k_zero, std::optional<Tensor> k_codebook,
    std::optional<Tensor> k_out_val, std::optional<Tensor> k_out_idx,
    const Tensor& v_codes, std::optional<Tensor> v_scale, std::optional<Tensor> v_zero, std::optional<Tensor> v_codebook,
    std::optional<Tensor> v_out_val, std::optional<Tensor> v_out_idx,
    const Tensor& side_k, const Tensor& side_v, const Tensor& side_pos, const Tensor& body_end, const Tensor& mask,
    std::optional<Tensor> rope_inv_freq, int64_t body_start, double scaling, double rope_scale,
    int64_t k_bits, int64_t k_axis, int64_t k_group, int64_t v_bits, int64_t v_axis, int64_t v_group, double softcap,
    Tensor& out) {
  try {
    kvq_core::Args a = kvq_core::make_args(q, k_codes, k_scale, k_zero, k_codebook, k_out_val, k_out_idx, v_codes, v_scale,
                                           v_zero, v_codebook, v_out_val, v_out_idx, side_k, side_v, side_pos, body_end,
                                           mask, rope_inv_freq, body_start, scaling, rope_scale, k_bits, k_axis, k_group,
                                           v_bits, v_axis, v_group, softcap);
    int64_t sizes[3];
    kvq_core::output_sizes(a, sizes);
    kvq_core::check(out.scalar_type() == ScalarType::Float && out.dim() == 4 && out.size(0) == sizes[0] && out.size(1) == sizes[1] &&
                        out.size(2) == 1 && out.size(3) == sizes[2],
                    "out must be float32 [", sizes[0], ", ", sizes[1], ", 1, ", sizes[2], "]");
    kvq_core::decode_attention(a, out.mutable_data_ptr<float>(), omp_get_max_threads(), [](int64_t n, const auto& fn) {
#pragma omp parallel for schedule(static, 1)
      for (int64_t i = 0; i < n; ++i) fn(i, i + 1);
    });
  } catch (const std::invalid_argument& e) {
    ET_LOG(Error, "%s", e.what());
    ctx.fail(executorch::runtime::Error::InvalidArgument);
  }
  return out;
}

}  // namespace
}  // namespace kvq_executorch

EXECUTORCH_LIBRARY(kvq, "decode_attention.out", kvq_executorch::decode_attention_out);
