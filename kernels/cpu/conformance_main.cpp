// A standalone runner of the CPU kernels' arithmetic (attention_core.h: decode attention;
// quantize_core.h: the appends, kvq::quantize_fixed and kvq::quantize) for the conformance cases, with
// neither ATen nor ExecuTorch: what lets the kernel's C++ be built for another CPU
// (cross-compiled for aarch64 and run under qemu-user) or with another instruction set (the
// generic vectors, no AVX) and checked against the reference on the same cases as the PyTorch
// and ExecuTorch builds (tests/kernels/test_portable_builds.py writes the cases and reads back
// the outputs).
//
//     kvq_conformance CASE OUT [CASE OUT ...]
//
// A case file holds the op's arguments in ATTENTION_SCHEMA order (kvq_ao/ops.py), each operand's
// tensors by kvq_format.h's field indices, little-endian:
//   tensor   := int32 present; if present: int32 dtype (c10 ScalarType code), int32 dim,
//               int64 sizes[dim], then the contiguous elements
//   tensors  := int32 count, tensor[count];   ints := int32 count, int64[count]
//   case     := "KVQC" int32 version(1), tensor q, tensors k, ints k_format, tensors v,
//               ints v_format, tensor side_pos, tensor body_end, tensor mask, tensor rope_inv_freq,
//               int64 body_start, float64 scaling, float64 rope_scale, float64 softcap, int32 tasks
// OUT receives int64 count then count float32 outputs [B, Hq, 1, Dv].
//   quantize case := "KVQF" int32 version(1), tensor x (float32 [B, H, T, D]), int64 bits,
//               tensor zero, tensor scale, tensor mids (codebook midpoints, float32; empty: uniform),
//               tensor lo, tensor hi (float32 [H, D]), int64 n_outliers
// OUT receives int64 clamped, then the codes, out_val (float32) and out_idx bytes as int64 size + data.
//   groups case (kvq::quantize) := "KVQG" int32 version(1), tensor x (float32 [B, H, T, D]), int64 bits,
//               int64 axis, int64 group, int64 scale type (0 float16, 1 bfloat16, 2 float32), tensor mids,
//               tensor lo, tensor hi (float32 [H, D], or empty: per-vector outliers), int64 n_outliers
// OUT receives int64 clamped, then the codes, scale, zero (scale-dtype bytes), out_val (float32) and
// out_idx bytes as int64 size + data. Tasks run one after another
// in `tasks` calls of the kernel's parallel_for, so the split-softmax merge runs as it does with
// threads. Exit status 0; a bad file or a kernel error prints the message and exits 1.

#include <cstdio>
#include <fstream>
#include <iostream>
#include <optional>
#include <vector>

#include "attention_core.h"
#include "quantize_core.h"

namespace {

// What make_args reads of a tensor (at::Tensor and ExecuTorch's Tensor have the same methods).
struct HostTensor {
  int code = 6;
  std::vector<int64_t> sizes_, strides_;
  std::vector<char> bytes;
  int64_t dim() const { return static_cast<int64_t>(sizes_.size()); }
  int64_t size(int i) const { return sizes_[i]; }
  const std::vector<int64_t>& strides() const { return strides_; }
  int scalar_type() const { return code; }
  const void* const_data_ptr() const { return bytes.data(); }
};

struct Reader {
  std::ifstream in;
  std::string path;
  template <class T> T get() {
    T x{};
    if (!in.read(reinterpret_cast<char*>(&x), sizeof(T))) throw std::runtime_error(path + ": truncated case file");
    return x;
  }
  std::optional<HostTensor> tensor() {
    if (!get<int32_t>()) return std::nullopt;
    HostTensor t;
    t.code = get<int32_t>();
    const int32_t dim = get<int32_t>();
    if (dim < 0 || dim > 6) throw std::runtime_error(path + ": bad tensor rank");
    int64_t n = 1;
    for (int i = 0; i < dim; ++i) n *= t.sizes_.emplace_back(get<int64_t>());
    t.strides_.assign(dim, 1);
    for (int i = dim - 2; i >= 0; --i) t.strides_[i] = t.strides_[i + 1] * t.sizes_[i + 1];
    const int size = kvq_core::dtype_size(kvq_core::dtype_of_code(t.code));
    if (size <= 0 || n < 0) throw std::runtime_error(path + ": unsupported tensor dtype " + std::to_string(t.code));
    t.bytes.resize(static_cast<size_t>(n * size));
    if (n && !in.read(t.bytes.data(), static_cast<std::streamsize>(t.bytes.size()))) throw std::runtime_error(path + ": truncated tensor");
    return t;
  }
  HostTensor required() {
    auto t = tensor();
    if (!t) throw std::runtime_error(path + ": a required tensor is absent");
    return *t;
  }
  std::vector<std::optional<HostTensor>> tensors() {
    std::vector<std::optional<HostTensor>> out(get<int32_t>());
    for (auto& t : out) t = tensor();
    return out;
  }
  std::vector<int64_t> ints() {
    std::vector<int64_t> out(get<int32_t>());
    for (auto& x : out) x = get<int64_t>();
    return out;
  }
};

void write_blob(std::ofstream& o, const void* data, int64_t bytes) {
  o.write(reinterpret_cast<const char*>(&bytes), sizeof(bytes));
  o.write(static_cast<const char*>(data), static_cast<std::streamsize>(bytes));
}

const float* floats(const HostTensor& t, const char* name, int64_t n) {
  if (kvq_core::dtype_of_code(t.code) != kvq_core::DType::Float || t.bytes.size() != static_cast<size_t>(n) * 4)
    throw std::runtime_error(std::string(name) + " must hold " + std::to_string(n) + " float32 values");
  return reinterpret_cast<const float*>(t.bytes.data());
}

void run_quantize_case(Reader& r, const std::string& out_path) {
  const HostTensor x = r.required();
  const int64_t bits = r.get<int64_t>();
  const HostTensor zero = r.required(), scale = r.required(), mids = r.required(), lo = r.required(), hi = r.required();
  const int64_t slots = r.get<int64_t>();
  if (x.dim() != 4 || x.size(3) > kvq_core::kMaxDim || !kvq_format::is_packed_bits(bits))
    throw std::runtime_error(r.path + ": x must be [B, H, T, D <= 256] with packed bits");
  const int64_t heads = x.size(1), tokens = x.size(2), dim = x.size(3), rows = x.size(0) * heads * tokens;
  const float* xs = floats(x, "x", rows * dim);
  std::vector<uint8_t> codes(static_cast<size_t>(rows * kvq_core::packed_bytes(dim, bits)));
  std::vector<float> out_val(static_cast<size_t>(rows * slots));
  std::vector<uint8_t> out_idx(static_cast<size_t>(rows * slots));
  const int64_t n_mids = mids.dim() ? mids.size(0) : 0;
  const int64_t clamped = kvq_core::quantize_rows<float>(
      xs, rows, tokens, heads, static_cast<int>(dim), static_cast<int>(bits), floats(lo, "lo", heads * dim),
      floats(hi, "hi", heads * dim), floats(zero, "zero", heads * dim), floats(scale, "scale", heads * dim),
      n_mids ? floats(mids, "mids", n_mids) : nullptr, static_cast<int>(n_mids), static_cast<int>(slots), codes.data(),
      out_val.data(), out_idx.data(), [](int64_t n, const auto& fn) {
        for (int64_t i = 0; i < n; ++i) fn(i, i + 1);
      });
  std::ofstream o(out_path, std::ios::binary);
  o.write(reinterpret_cast<const char*>(&clamped), sizeof(clamped));
  write_blob(o, codes.data(), static_cast<int64_t>(codes.size()));
  write_blob(o, out_val.data(), static_cast<int64_t>(out_val.size() * sizeof(float)));
  write_blob(o, out_idx.data(), static_cast<int64_t>(out_idx.size()));
  if (!o) throw std::runtime_error(out_path + ": cannot write");
}

void run_groups_case(Reader& r, const std::string& out_path) {
  const HostTensor x = r.required();
  const int64_t bits = r.get<int64_t>(), axis = r.get<int64_t>(), group = r.get<int64_t>(), scale_type = r.get<int64_t>();
  const int64_t meta = r.get<int64_t>();  // kvq_format: 8-bit scale and zero unless kFloatMeta
  const HostTensor mids = r.required(), lo = r.required(), hi = r.required();
  const int64_t slots = r.get<int64_t>();
  if (x.dim() != 4 || x.size(3) > kvq_core::kMaxDim || !kvq_format::is_packed_bits(bits) || scale_type < 0 || scale_type > 2)
    throw std::runtime_error(r.path + ": x must be [B, H, T, D <= 256] with packed bits and a scale type 0-2");
  const int64_t heads = x.size(1), tokens = x.size(2), dim = x.size(3), slices = x.size(0) * heads, rows = slices * tokens;
  const bool channel = axis == kvq_format::kAxisChannel;
  const int64_t block = kvq_format::is_one_row(axis, group) ? tokens : group;
  if (block <= 0 || (channel ? tokens % block : dim % group)) throw std::runtime_error(r.path + ": the groups do not tile x");
  const int64_t metas = channel ? slices * (tokens / block) * dim : rows * (dim / group);
  const bool meta8 = kvq_format::is_meta8(meta);
  if (meta8 && channel) throw std::runtime_error(r.path + ": 8-bit metadata codes per-token groups");
  const size_t meta_bytes = static_cast<size_t>(metas) * (meta8 ? 1 : scale_type == 2 ? 4 : 2);
  std::vector<uint8_t> codes(static_cast<size_t>(rows * kvq_core::packed_bytes(dim, bits))), scale(meta_bytes), zero(meta_bytes);
  std::vector<float> out_val(static_cast<size_t>(rows * slots));
  std::vector<uint8_t> out_idx(static_cast<size_t>(rows * slots));
  const int64_t n_mids = mids.dim() ? mids.size(0) : 0;
  const bool by_channel = lo.dim() && lo.size(0) > 0;
  const std::optional<kvq_core::Meta8> coder = kvq_core::Meta8::of(meta, bits, n_mids > 0);
  const int64_t clamped = kvq_core::quantize_groups<float>(
      floats(x, "x", rows * dim), slices, tokens, heads, static_cast<int>(dim), static_cast<int>(bits), channel,
      static_cast<int>(channel ? block : group), static_cast<kvq_core::ScaleType>(scale_type),
      n_mids ? floats(mids, "mids", n_mids) : nullptr, static_cast<int>(n_mids), by_channel ? floats(lo, "lo", heads * dim) : nullptr,
      by_channel ? floats(hi, "hi", heads * dim) : nullptr, static_cast<int>(slots), codes.data(), scale.data(), zero.data(),
      out_val.data(), out_idx.data(), [](int64_t n, const auto& fn) {
        for (int64_t i = 0; i < n; ++i) fn(i, i + 1);
      }, coder ? &*coder : nullptr);
  std::ofstream o(out_path, std::ios::binary);
  o.write(reinterpret_cast<const char*>(&clamped), sizeof(clamped));
  write_blob(o, codes.data(), static_cast<int64_t>(codes.size()));
  write_blob(o, scale.data(), static_cast<int64_t>(scale.size()));
  write_blob(o, zero.data(), static_cast<int64_t>(zero.size()));
  write_blob(o, out_val.data(), static_cast<int64_t>(out_val.size() * sizeof(float)));
  write_blob(o, out_idx.data(), static_cast<int64_t>(out_idx.size()));
  if (!o) throw std::runtime_error(out_path + ": cannot write");
}

void run_case(const std::string& case_path, const std::string& out_path) {
  Reader r{std::ifstream(case_path, std::ios::binary), case_path};
  if (!r.in) throw std::runtime_error(case_path + ": cannot open");
  char magic[4];
  if (!r.in.read(magic, 4) || r.get<int32_t>() != 1) throw std::runtime_error(case_path + ": not a version-1 kvq case");
  if (std::string(magic, 4) == "KVQF") return run_quantize_case(r, out_path);
  if (std::string(magic, 4) == "KVQG") return run_groups_case(r, out_path);
  if (std::string(magic, 4) != "KVQC") throw std::runtime_error(case_path + ": not a kvq conformance case");
  const HostTensor q = r.required();
  const auto k = r.tensors();
  const auto k_format = r.ints();
  const auto v = r.tensors();
  const auto v_format = r.ints();
  const HostTensor side_pos = r.required(), body_end = r.required(), mask = r.required();
  const std::optional<HostTensor> rope_inv_freq = r.tensor();
  const int64_t body_start = r.get<int64_t>();
  const double scaling = r.get<double>(), rope_scale = r.get<double>(), softcap = r.get<double>();
  const int32_t tasks = r.get<int32_t>();

  kvq_core::Args a = kvq_core::make_args(q, k, k_format, v, v_format, side_pos, body_end, mask, rope_inv_freq, body_start,
                                         scaling, rope_scale, softcap);
  int64_t sizes[3];
  kvq_core::output_sizes(a, sizes);
  std::vector<float> out(static_cast<size_t>(sizes[0] * sizes[1] * sizes[2]));
  kvq_core::decode_attention(a, out.data(), tasks, [](int64_t n, const auto& fn) {
    for (int64_t i = 0; i < n; ++i) fn(i, i + 1);
  });
  std::ofstream o(out_path, std::ios::binary);
  const int64_t count = static_cast<int64_t>(out.size());
  o.write(reinterpret_cast<const char*>(&count), sizeof(count));
  o.write(reinterpret_cast<const char*>(out.data()), static_cast<std::streamsize>(out.size() * sizeof(float)));
  if (!o) throw std::runtime_error(out_path + ": cannot write");
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3 || argc % 2 == 0) {
    std::cerr << "usage: " << argv[0] << " CASE OUT [CASE OUT ...]\n";
    return 2;
  }
  try {
    for (int i = 1; i + 1 < argc; i += 2) run_case(argv[i], argv[i + 1]);
  } catch (const std::exception& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}
