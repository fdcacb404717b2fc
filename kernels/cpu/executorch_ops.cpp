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
using kvq_core::DType;
using kvq_core::View;

DType dtype_of(ScalarType t) {
  switch (t) {
    case ScalarType::Bool: return DType::Bool;
    case ScalarType::Byte: return DType::Byte;
    case ScalarType::Long: return DType::Long;
    case ScalarType::Half: return DType::Half;
    case ScalarType::BFloat16: return DType::BFloat16;
    case ScalarType::Float: return DType::Float;
    case ScalarType::Double: return DType::Double;
    default: return DType::Other;
  }
}

View view_of(const Tensor& t) {
  kvq_core::check(t.dim() <= 6, "tensors of at most 6 dims, got ", t.dim());
  View v;
  v.present = true;
  v.data = t.const_data_ptr();
  v.dtype = dtype_of(t.scalar_type());
  v.dim = static_cast<int>(t.dim());
  for (int i = 0; i < v.dim; ++i) {
    v.sizes[i] = t.size(i);
    v.strides[i] = t.strides()[i];
  }
  return v;
}

View view_of(const std::optional<Tensor>& t) { return t.has_value() ? view_of(*t) : View{}; }

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
    kvq_core::Args a;
    a.q = view_of(q);
    a.k_codes = view_of(k_codes);
    a.k_scale = view_of(k_scale);
    a.k_zero = view_of(k_zero);
    a.k_codebook = view_of(k_codebook);
    a.k_out_val = view_of(k_out_val);
    a.k_out_idx = view_of(k_out_idx);
    a.v_codes = view_of(v_codes);
    a.v_scale = view_of(v_scale);
    a.v_zero = view_of(v_zero);
    a.v_codebook = view_of(v_codebook);
    a.v_out_val = view_of(v_out_val);
    a.v_out_idx = view_of(v_out_idx);
    a.side_k = view_of(side_k);
    a.side_v = view_of(side_v);
    a.side_pos = view_of(side_pos);
    a.body_end = view_of(body_end);
    a.mask = view_of(mask);
    a.rope_inv_freq = view_of(rope_inv_freq);
    a.body_start = body_start;
    a.scaling = scaling;
    a.rope_scale = rope_scale;
    a.k_bits = k_bits, a.k_axis = k_axis, a.k_group = k_group;
    a.v_bits = v_bits, a.v_axis = v_axis, a.v_group = v_group;
    a.softcap = softcap;
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
