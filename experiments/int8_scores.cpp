// How much faster are key scores from integer dot products? Key scores of 4-bit keys in
// per-channel groups (kivi-4's layout: head_dim 64, planar codes, 32 bytes a token) for the 3
// query heads of a SmolLM2 kv head, over 32768 tokens, one thread, warm:
//   float: the kernel's own fused_scores (kernels/cpu/attention_core.h), q * scale against the levels;
//   int8:  q * scale quantized to int8 per head (alpha = max|q * scale| / 127), the codes' nibbles
//          dotted with it by AVX-512 VNNI (vpdpbusd, 64 byte products an instruction) into int32,
//          16 rows reduced to one register by three permute-and-add levels, times alpha: the
//          kernel's own quantize_query and int_scores (the int8-query format, kvq_ao/format.py);
//   int16: the same with 32512 steps a side, as two int8 digits (two vpdpbusd a plane).
// Checks the integer scores against float64 on the same integer query (exact up to the final
// rounding) and prints each path's ms and its error against the float64 scores of the float query.
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
  kvq_core::Operand op;
  op.bits = 4, op.dim = kDim, op.is_float = false, op.per_channel = true, op.row_bytes = kRowBytes, op.int_query = true;
  op.codes_p = reinterpret_cast<const char*>(codes.data());
  auto level = [&](int64_t t, int c) { return op.level_at(codes.data() + t * kRowBytes, c); };
  auto tmp = std::make_unique<kvq_core::Scratch>();
  std::copy(qs.begin(), qs.end(), tmp->qs);
  alignas(64) float s_float[kHeads * kvq_core::kTile], s_int[kHeads * kvq_core::kTile];
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
  std::printf("key scores of %d tokens x %d heads, one kv head, 1 thread, warm, best of 30:\n", T, kHeads);
  double err_float = 0, scale = 0;
  for (int64_t t0 = 0; t0 < T; t0 += kvq_core::kTile) {
    op.fused_scores<4, false, 3>(qs.data(), t0, kvq_core::kTile, s_float);
    for (int h = 0; h < kHeads; ++h)
      for (int j = 0; j < kvq_core::kTile; ++j) {
        double exact = 0;
        for (int c = 0; c < kDim; ++c) exact += double(qs[h * kDim + c]) * level(t0 + j, c);
        scale = std::max(scale, std::fabs(exact));
        err_float = std::max(err_float, std::fabs(s_float[h * kvq_core::kTile + j] - exact));
      }
  }
  std::printf("  float fused_scores %.3f ms, max |error| %.3g of max |score| %.3g\n", ms_float, err_float, scale);
  for (const int levels : {127, 127 * 256}) {  // the int8 and the int16 query (two int8 digits)
    const bool two = levels > 127;
    op.query_levels = levels;
    op.quantize_query(kHeads, *tmp);
    auto scores = [&](int64_t t0, float* out) {
      if (two) op.int_scores<4, true>(*tmp, kHeads, t0, kvq_core::kTile, out);
      else op.int_scores<4, false>(*tmp, kHeads, t0, kvq_core::kTile, out);
    };
    double err_int = 0, err_exact = 0;
    for (int64_t t0 = 0; t0 < T; t0 += kvq_core::kTile) {  // correctness on every tile
      scores(t0, s_int);
      for (int h = 0; h < kHeads; ++h)
        for (int j = 0; j < kvq_core::kTile; ++j) {
          double exact = 0, exact_q = 0;
          for (int c = 0; c < kDim; ++c) {
            const double qi = two ? 256.0 * tmp->q8[h * kDim + c] + tmp->q8_lo[h * kDim + c] : tmp->q8[h * kDim + c];
            exact += double(qs[h * kDim + c]) * level(t0 + j, c);
            exact_q += qi * level(t0 + j, c);
          }
          exact_q *= tmp->alpha[h];
          err_int = std::max(err_int, std::fabs(s_int[h * kvq_core::kTile + j] - exact));
          err_exact = std::max(err_exact, std::fabs(s_int[h * kvq_core::kTile + j] - exact_q) / std::max(1.0, std::fabs(exact_q)));
        }
    }
    if (err_exact > 1e-6) {
      std::printf("integer path wrong (levels %d): relative error %.3g against float64 on the same query\n", levels, err_exact);
      return 1;
    }
    const double ms_int = time_ms([&] {
      for (int64_t t0 = 0; t0 < T; t0 += kvq_core::kTile) scores(t0, s_int);
      sink = sink + s_int[0];
    });
    std::printf("  %s VNNI%s %.3f ms, max |error| %.3g (%.2fx faster)\n", two ? "int16" : "int8", two ? "" : " ", ms_int, err_int,
                ms_float / ms_int);
  }
  return 0;
}
