// How much faster are key scores from integer dot products? Key scores of 4-bit keys in
// per-channel groups (kivi-4's layout: head_dim 64, planar codes, 32 bytes a token) for the 3
// query heads of a SmolLM2 kv head, over 32768 tokens, one thread, warm:
//   float: the kernel's own fused_scores (kernels/cpu/attention_core.h), q * scale against the levels;
//   int8:  q * scale quantized to int8 per head (alpha = max|q * scale| / 127), the codes' nibbles
//          dotted with it by AVX-512 VNNI (vpdpbusd, 64 byte products an instruction) into int32,
//          16 rows reduced to one register by three permute-and-add levels, times alpha: the
//          kernel's own int8_scores (the int8-query format, kvq_ao/format.py).
// Checks the int8 scores against float64 on the same int8 query (exact up to the final rounding)
// and prints both paths' ms and their error against the float64 scores of the float query.
//
//   mkdir -p /tmp/kvq_inc && python -c "from kvq_ao.kernels.cpu import GENERATED_HEADER as n, generated_header as h; \
//     open('/tmp/kvq_inc/' + n, 'w').write(h())"
//   g++ -O3 -march=native -fopenmp -fno-math-errno -std=c++17 -Ikernels/cpu -I/tmp/kvq_inc experiments/int8_scores.cpp \
//     -o /tmp/int8_scores && /tmp/int8_scores
#include "attention_core.h"

#include <chrono>
#include <cstdio>
#include <random>

#if !defined(__AVX512VNNI__) || !defined(__AVX512BW__)
#error "this probe needs AVX-512 VNNI and BW (-march=native on such a CPU)"
#endif

namespace {

constexpr int kDim = 64, kRowBytes = 32, kHeads = 3;

}  // namespace

int main() {
  const int T = 32768;
  std::mt19937 rng(0);
  std::vector<uint8_t> codes(size_t(T) * kRowBytes);
  for (auto& c : codes) c = rng() & 0xff;
  std::normal_distribution<float> normal;
  std::vector<float> qs(kHeads * kDim);
  for (auto& x : qs) x = normal(rng);
  qs[5] *= 20.f;  // one massive channel, as Llama keys' scales give q * scale
  // the int8 query
  std::vector<int8_t> q8(kHeads * kDim);
  float alpha[kHeads];
  for (int h = 0; h < kHeads; ++h) {
    float m = 0.f;
    for (int c = 0; c < kDim; ++c) m = std::max(m, std::fabs(qs[h * kDim + c]));
    alpha[h] = m > 0 ? m / 127.f : 1.f;
    for (int c = 0; c < kDim; ++c) q8[h * kDim + c] = static_cast<int8_t>(std::nearbyint(qs[h * kDim + c] / alpha[h]));
  }
  kvq_core::Operand op;
  op.bits = 4, op.dim = kDim, op.is_float = false, op.per_channel = true, op.row_bytes = kRowBytes, op.int8_query = true;
  auto tmp = std::make_unique<kvq_core::Scratch>();
  std::copy(q8.begin(), q8.end(), tmp->q8);
  std::copy(alpha, alpha + kHeads, tmp->alpha);
  auto int8_scores = [&](int64_t t0, float* out) { op.int8_scores<4>(*tmp, kHeads, t0, kvq_core::kTile, out); };
  op.codes_p = reinterpret_cast<const char*>(codes.data());
  auto level = [&](int64_t t, int c) { return op.level_at(codes.data() + t * kRowBytes, c); };
  alignas(64) float s_float[kHeads * kvq_core::kTile], s_int[kHeads * kvq_core::kTile];
  double err_float = 0, err_int = 0, err_exact = 0, scale = 0;
  for (int64_t t0 = 0; t0 < T; t0 += kvq_core::kTile) {  // correctness on every tile
    op.fused_scores<4, false, 3>(qs.data(), t0, kvq_core::kTile, s_float);
    int8_scores(t0, s_int);
    for (int h = 0; h < kHeads; ++h)
      for (int j = 0; j < kvq_core::kTile; ++j) {
        double exact = 0, exact8 = 0;
        for (int c = 0; c < kDim; ++c) {
          exact += double(qs[h * kDim + c]) * level(t0 + j, c);
          exact8 += double(q8[h * kDim + c]) * level(t0 + j, c);
        }
        exact8 *= alpha[h];
        scale = std::max(scale, std::fabs(exact));
        err_float = std::max(err_float, std::fabs(s_float[h * kvq_core::kTile + j] - exact));
        err_int = std::max(err_int, std::fabs(s_int[h * kvq_core::kTile + j] - exact));
        err_exact = std::max(err_exact, std::fabs(s_int[h * kvq_core::kTile + j] - exact8) / std::max(1.0, std::fabs(exact8)));
      }
  }
  if (err_exact > 1e-6) {
    std::printf("int8 path wrong: relative error %.3g against float64 on the same int8 query\n", err_exact);
    return 1;
  }
  auto time_ms = [&](auto&& fn) {
    double best = 1e30;
    for (int r = 0; r < 30; ++r) {
      const auto a = std::chrono::steady_clock::now();
      fn();
      best = std::min(best, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count());
    }
    return best;
  };
  volatile float sink = 0;
  const double ms_float = time_ms([&] {
    for (int64_t t0 = 0; t0 < T; t0 += kvq_core::kTile) op.fused_scores<4, false, 3>(qs.data(), t0, kvq_core::kTile, s_float);
    sink = sink + s_float[0];
  });
  const double ms_int = time_ms([&] {
    for (int64_t t0 = 0; t0 < T; t0 += kvq_core::kTile) int8_scores(t0, s_int);
    sink = sink + s_int[0];
  });
  std::printf("key scores of %d tokens x %d heads, one kv head, 1 thread, warm, best of 30:\n", T, kHeads);
  std::printf("  float fused_scores %.3f ms, max |error| %.3g of max |score| %.3g\n", ms_float, err_float, scale);
  std::printf("  int8 VNNI          %.3f ms, max |error| %.3g (%.2fx faster)\n", ms_int, err_int, ms_float / ms_int);
  return 0;
}
