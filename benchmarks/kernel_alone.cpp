// The native CPU decode kernel timed alone, without Python: kvq_core::decode_attention (header only,
// kernels/cpu/attention_core.h) on one layer's op arguments dumped by benchmarks/kernel_alone.py.
// Each call finds the cache evicted (a buffer of EVICT_MIB, default 1024, is rewritten before it), as
// a layer's cache is by the rest of a model (30 layers' caches and the weights: hundreds of MiB a
// step). The Intel VM here reports a 480 MiB L3: 64 MiB left a 32k-token layer in it, and timed the
// kernel at half its cold time. Prints the median and min ms and a checksum of the output.
//
//   kernel_alone DIR SECONDS THREADS [EVICT_MIB]
#include "attention_core.h"

#include <omp.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace {

struct Dumped {
  std::vector<char> bytes;
  kvq_core::View view;
};

// DIR/meta.txt: "T name dtype_code dim sizes..." (a contiguous tensor in DIR/name.bin),
// "N name" (an absent optional tensor) or "S name value" (a scalar argument).
void read_dump(const std::string& dir, std::map<std::string, Dumped>& tensors, std::map<std::string, double>& scalars) {
  std::ifstream meta(dir + "/meta.txt");
  if (!meta) throw std::runtime_error("no " + dir + "/meta.txt");
  std::string line;
  while (std::getline(meta, line)) {
    std::istringstream in(line);
    std::string kind, name;
    in >> kind >> name;
    if (kind == "S") {
      in >> scalars[name];
    } else if (kind == "T") {
      int code, dim;
      in >> code >> dim;
      Dumped& t = tensors[name];
      std::ifstream file(dir + "/" + name + ".bin", std::ios::binary);
      t.bytes.assign(std::istreambuf_iterator<char>(file), {});
      t.view.present = true;
      t.view.data = t.bytes.data();
      t.view.dtype = kvq_core::dtype_of_code(code);
      t.view.dim = dim;
      for (int i = 0; i < dim; ++i) in >> t.view.sizes[i];
      int64_t stride = 1;
      for (int i = dim - 1; i >= 0; --i) t.view.strides[i] = stride, stride *= t.view.sizes[i];
    }
  }
}

// Rewrites a buffer larger than the L3 before each timed call (its own function, so that a profile
// can leave it out).
__attribute__((noinline)) void evict(std::vector<float>& buffer) {
  for (float& x : buffer) x += 1.f;
}

// The eviction buffer, filled by a loop rather than the zeroing of std::vector(n): that is a libc
// memset a profile cannot tell from one inside the kernel (a GiB of it was a fifth of a short profile).
__attribute__((noinline)) std::vector<float> eviction_buffer(int64_t mib) {
  std::vector<float> buffer;
  buffer.reserve(mib << 18);
  for (int64_t i = 0; i < (mib << 18); ++i) buffer.push_back(static_cast<float>(i & 1023));
  return buffer;
}

// Keys' query_bits (how they are scored), on kernel revisions that have the field.
template <typename O>
auto set_query_bits(O* o, double bits, int) -> decltype(o->query_bits = 0, void()) {
  o->query_bits = static_cast<int64_t>(bits);
}
template <typename O>
void set_query_bits(O*, double, long) {}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4 && argc != 5) {
    std::fprintf(stderr, "usage: %s DIR SECONDS THREADS [EVICT_MIB]\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  const double seconds = std::atof(argv[2]);
  const int threads = std::atoi(argv[3]);
  std::map<std::string, Dumped> t;
  std::map<std::string, double> s;
  read_dump(dir, t, s);
  auto view = [&](const char* name) { return t.count(name) ? t[name].view : kvq_core::View{}; };
  kvq_core::Args a;
  a.q = view("q");
  for (auto [o, p] : {std::pair{&a.k, std::string("k_")}, std::pair{&a.v, std::string("v_")}}) {  // kernel_alone.py's names
    auto field = [&](const char* name) { return view((p + name).c_str()); };
    o->codes = field("codes"), o->scale = field("scale"), o->zero = field("zero"), o->codebook = field("codebook");
    o->out_val = field("out_val"), o->out_idx = field("out_idx"), o->side = field("side");
    o->bits = s[p + "bits"], o->axis = s[p + "axis"], o->group = s[p + "group"];
    if (s.count(p + "query_bits")) set_query_bits(o, s[p + "query_bits"], 0);
  }
  a.side_pos = view("side_pos"), a.body_end = view("body_end");
  a.mask = view("mask"), a.rope_inv_freq = view("rope_inv_freq");
  a.body_start = static_cast<int64_t>(s["body_start"]), a.scaling = s["scaling"], a.rope_scale = s["rope_scale"];
  a.softcap = s["softcap"];

  auto parallel_for = [threads](int64_t n, const auto& fn) {  // contiguous ranges, as ATen's
#pragma omp parallel num_threads(threads)
    {
      const int64_t i = omp_get_thread_num(), k = omp_get_num_threads();
      if (n * i / k < n * (i + 1) / k) fn(n * i / k, n * (i + 1) / k);
    }
  };
  std::vector<float> out(a.q.size(0) * a.q.size(1) * a.v.side.size(3));
  kvq_core::decode_attention(a, out.data(), threads, parallel_for);
  double checksum = 0;
  for (float x : out) checksum += x;

  const int64_t evict_mib = argc == 5 ? std::atoll(argv[4]) : 1024;
  std::vector<float> buffer = eviction_buffer(evict_mib);
  std::vector<double> ms;
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (std::chrono::steady_clock::now() < end || ms.size() < 5) {
    evict(buffer);
    const auto t0 = std::chrono::steady_clock::now();
    kvq_core::decode_attention(a, out.data(), threads, parallel_for);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  std::printf("%.4f %.4f %zu %.6f\n", ms[ms.size() / 2], ms[0], ms.size(), checksum);
}
