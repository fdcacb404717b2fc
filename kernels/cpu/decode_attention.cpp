// kvq::decode_attention for PyTorch's CPU dispatch key: the arithmetic is attention_core.h (shared
// with the ExecuTorch kernel library, executorch_ops.cpp); this layer turns ATen tensors into the
// core's views, runs it on ATen's thread pool, and turns its argument errors into ValueErrors.
// The schema is ATTENTION_SCHEMA in kvq_ao/ops.py.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <deque>
#include <optional>

#include "attention_core.h"

namespace kvq_cpu {
namespace {

// Keeps contiguous copies of the arguments alive for the call (the core reads raw pointers);
// the mask stays as it is, since the core reads its broadcast strides.
class Keep {
 public:
  const at::Tensor& operator()(const at::Tensor& t) { return kept_.emplace_back(t.contiguous()); }
  const std::optional<at::Tensor>& operator()(const std::optional<at::Tensor>& t) {
    return optional_.emplace_back(t.has_value() ? std::optional<at::Tensor>(t->contiguous()) : std::nullopt);
  }

 private:
  std::deque<at::Tensor> kept_;  // a deque: references to its elements survive later emplace_backs
  std::deque<std::optional<at::Tensor>> optional_;
};

using TensorList = c10::List<std::optional<at::Tensor>>;

// Contiguous copies of an operand's tensors (None stays None), kept alive for the call.
std::vector<std::optional<at::Tensor>> contiguous(Keep& keep, const TensorList& list) {
  std::vector<std::optional<at::Tensor>> out;
  out.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i) out.push_back(keep(static_cast<std::optional<at::Tensor>>(list.get(i))));
  return out;
}

// The kernel on ATen tensors: out [B, Hq, 1, Dv] float32 and, when `lse` is given, the rows'
// log-sum-exp [B, Hq, 1] float32 written into it. The arguments are ATTENTION_SCHEMA's
// (kvq_ao/ops.py); each operand's lists are read by kvq_format.h's indices.
at::Tensor run(const at::Tensor& q, const TensorList& k, at::IntArrayRef k_format, const TensorList& v,
               at::IntArrayRef v_format, const at::Tensor& side_pos, const at::Tensor& body_end, const at::Tensor& mask,
               const std::optional<at::Tensor>& rope_inv_freq, int64_t body_start, double scaling, double rope_scale,
               double softcap, int64_t position_offset, at::Tensor* lse) {
  TORCH_CHECK_VALUE(q.is_floating_point(), "kvq.decode_attention: q must be floating point, got ", q.scalar_type());
  TORCH_CHECK_VALUE(position_offset >= 0, "kvq partial attention: position_offset must be >= 0, got ", position_offset);
  Keep c;
  try {
    const auto k_list = contiguous(c, k), v_list = contiguous(c, v);
    kvq_core::Args a = kvq_core::make_args(c(q.to(at::kFloat)), k_list, k_format, v_list, v_format, c(side_pos), c(body_end),
                                           mask, c(rope_inv_freq), body_start, scaling, rope_scale, softcap);
    a.position_offset = position_offset;
    int64_t sizes[3];
    kvq_core::output_sizes(a, sizes);
    at::Tensor out = at::empty({sizes[0], sizes[1], 1, sizes[2]}, q.options().dtype(at::kFloat));
    if (lse) *lse = at::empty({sizes[0], sizes[1], 1}, q.options().dtype(at::kFloat));
    kvq_core::decode_attention(a, out.data_ptr<float>(), at::get_num_threads(),
                               [](int64_t n, const auto& fn) { at::parallel_for(0, n, 1, fn); },
                               lse ? lse->data_ptr<float>() : nullptr);
    return out;
  } catch (const std::invalid_argument& e) {
    TORCH_CHECK_VALUE(false, e.what());
  }
}

#define KVQ_ATTENTION_PARAMS                                                                                         \
  const at::Tensor &q, const TensorList &k, at::IntArrayRef k_format, const TensorList &v, at::IntArrayRef v_format, \
      const at::Tensor &side_pos, const at::Tensor &body_end, const at::Tensor &mask,                                \
      const std::optional<at::Tensor>&rope_inv_freq, int64_t body_start, double scaling, double rope_scale, double softcap
#define KVQ_ATTENTION_ARGS \
  q, k, k_format, v, v_format, side_pos, body_end, mask, rope_inv_freq, body_start, scaling, rope_scale, softcap

at::Tensor decode_attention(KVQ_ATTENTION_PARAMS) {
  return run(KVQ_ATTENTION_ARGS, 0, nullptr).to(q.scalar_type());
}

// kvq::decode_attention_partial (PARTIAL_SCHEMA): float32 out and log-sum-exp of a shard.
std::tuple<at::Tensor, at::Tensor> decode_attention_partial(KVQ_ATTENTION_PARAMS, int64_t position_offset) {
  at::Tensor lse;
  at::Tensor out = run(KVQ_ATTENTION_ARGS, position_offset, &lse);
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(kvq, CPU, m) {
  m.impl("decode_attention", &decode_attention);
  m.impl("decode_attention_partial", &decode_attention_partial);
}

}  // namespace kvq_cpu
