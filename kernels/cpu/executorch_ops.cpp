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

using executorch::aten::ArrayRef;
using executorch::aten::ScalarType;
using executorch::aten::Tensor;
using executorch::runtime::KernelRuntimeContext;

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
