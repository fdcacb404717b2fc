// kvq::decode_attention for PyTorch's CPU dispatch key: the arithmetic is attention_core.h (shared
// with the ExecuTorch kernel library, executorch_ops.cpp); this layer turns ATen tensors into the
// core's views, runs it on ATen's thread pool, and turns its argument errors into ValueErrors.
// The schema is ATTENTION_SCHEMA in kvq_ao/ops.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "attention_core.h"

namespace kvq_cpu {
namespace {

using kvq_core::DType;
using kvq_core::View;

DType dtype_of(at::ScalarType t) {
  switch (t) {
    case at::kBool: return DType::Bool;
    case at::kByte: return DType::Byte;
    case at::kLong: return DType::Long;
    case at::kHalf: return DType::Half;
    case at::kBFloat16: return DType::BFloat16;
    case at::kFloat: return DType::Float;
    case at::kDouble: return DType::Double;
    default: return DType::Other;
  }
}

// A view of `t` (made contiguous into `keep` unless it is the mask, whose broadcast strides the
// core reads as they are).
View view_of(const at::Tensor& t, std::vector<at::Tensor>& keep, bool strided = false) {
  TORCH_CHECK_VALUE(t.dim() <= 6, "kvq.decode_attention: tensors of at most 6 dims, got ", t.sizes());
  keep.push_back(strided ? t : t.contiguous());
  const at::Tensor& c = keep.back();
  View v;
  v.present = true;
  v.data = c.data_ptr();
  v.dtype = dtype_of(c.scalar_type());
  v.dim = static_cast<int>(c.dim());
  for (int i = 0; i < v.dim; ++i) {
    v.sizes[i] = c.size(i);
    v.strides[i] = c.stride(i);
  }
  return v;
}

View view_of(const std::optional<at::Tensor>& t, std::vector<at::Tensor>& keep) {
  return t.has_value() ? view_of(*t, keep) : View{};
}

at::Tensor decode_attention(
    const at::Tensor& q,
    const at::Tensor& k_codes, const std::optional<at::Tensor>& k_scale, const std::optional<at::Tensor>& k_zero,
    const std::optional<at::Tensor>& k_codebook, const std::optional<at::Tensor>& k_out_val, const std::optional<at::Tensor>& k_out_idx,
    const at::Tensor& v_codes, const std::optional<at::Tensor>& v_scale, const std::optional<at::Tensor>& v_zero,
    const std::optional<at::Tensor>& v_codebook, const std::optional<at::Tensor>& v_out_val, const std::optional<at::Tensor>& v_out_idx,
    const at::Tensor& side_k, const at::Tensor& side_v, const at::Tensor& side_pos, const at::Tensor& body_end,
    const at::Tensor& mask, const std::optional<at::Tensor>& rope_inv_freq,
    int64_t body_start, double scaling, double rope_scale,
    int64_t k_bits, int64_t k_axis, int64_t k_group, int64_t v_bits, int64_t v_axis, int64_t v_group, double softcap) {
  TORCH_CHECK_VALUE(q.is_floating_point(), "kvq.decode_attention: q must be floating point, got ", q.scalar_type());
  std::vector<at::Tensor> keep;
  keep.reserve(24);
  kvq_core::Args a;
  a.q = view_of(q.to(at::kFloat), keep);
  a.k_codes = view_of(k_codes, keep);
  a.k_scale = view_of(k_scale, keep);
  a.k_zero = view_of(k_zero, keep);
  a.k_codebook = view_of(k_codebook, keep);
  a.k_out_val = view_of(k_out_val, keep);
  a.k_out_idx = view_of(k_out_idx, keep);
  a.v_codes = view_of(v_codes, keep);
  a.v_scale = view_of(v_scale, keep);
  a.v_zero = view_of(v_zero, keep);
  a.v_codebook = view_of(v_codebook, keep);
  a.v_out_val = view_of(v_out_val, keep);
  a.v_out_idx = view_of(v_out_idx, keep);
  a.side_k = view_of(side_k, keep);
  a.side_v = view_of(side_v, keep);
  a.side_pos = view_of(side_pos, keep);
  a.body_end = view_of(body_end, keep);
  a.mask = view_of(mask, keep, /*strided=*/true);
  a.rope_inv_freq = view_of(rope_inv_freq, keep);
  a.body_start = body_start;
  a.scaling = scaling;
  a.rope_scale = rope_scale;
  a.k_bits = k_bits, a.k_axis = k_axis, a.k_group = k_group;
  a.v_bits = v_bits, a.v_axis = v_axis, a.v_group = v_group;
  a.softcap = softcap;
  try {
    int64_t sizes[3];
    kvq_core::output_sizes(a, sizes);
    at::Tensor out = at::empty({sizes[0], sizes[1], 1, sizes[2]}, q.options().dtype(at::kFloat));
    kvq_core::decode_attention(a, out.data_ptr<float>(), at::get_num_threads(),
                               [](int64_t n, const auto& fn) { at::parallel_for(0, n, 1, fn); });
    return out.to(q.scalar_type());
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(kvq, CPU, m) { m.impl("decode_attention", &decode_attention); }

}  // namespace kvq_cpu
