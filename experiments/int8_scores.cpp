// How much faster are key scores from integer dot products? Key scores of 4-bit keys in
// per-channel groups (kivi-4's layout: head_dim 64, planar codes, 32 bytes a token) for the 3
// query heads of a SmolLM2 kv head, over 32768 tokens, one thread, warm:
//   float: the kernel's own fused_scores (kernels/cpu/attention_core.h), q * scale against the levels;
//   int8:  q * scale quantized to int8 per head (alpha = max|q * scale| / 127), the codes' nibbles
//          dotted with it by AVX-512 VNNI (vpdpbusd, 64 byte products an instruction) into int32,
//          16 rows reduced to one register by three permute-and-add levels, times alpha.
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

// Index vectors of one reduction level: two registers whose 16 / w groups of w lanes each hold one
// row's partial sums -> one register of twice as many rows, w / 2 lanes each, rows in order.
struct PairIndices {
  __m512i lo, hi;
  explicit PairIndices(int w) {
    alignas(64) int32_t l[16], h[16];
    const int half = w / 2;
    for (int i = 0; i < 16; ++i) {
      const int group = i / half, elem = i % half;  // x's groups first, then y's (indices 16-31)
      const int base = group < 16 / w ? group * w : 16 + (group - 16 / w) * w;
      l[i] = base + elem, h[i] = base + half + elem;
    }
    lo = _mm512_load_si512(l), hi = _mm512_load_si512(h);
  }
};

inline __m512i reduce_pair(__m512i x, __m512i y, const PairIndices& ix) {
  return _mm512_add_epi32(_mm512_permutex2var_epi32(x, ix.lo, y), _mm512_permutex2var_epi32(x, ix.hi, y));
}

// scores[h * 64 + j] = alpha[h] * sum_c q8[h][c] * code_j[c] for 16 rows at a time (count % 16 == 0).
void int8_scores(const int8_t* q8, const float* alpha, const uint8_t* rows, int count, float* scores) {
  __m512i qlo[kHeads], qhi[kHeads];
  for (int h = 0; h < kHeads; ++h) {  // channels 0-31 meet the low nibbles, 32-63 the high ones
    qlo[h] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8 + h * kDim)));
    qhi[h] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8 + h * kDim + 32)));
  }
  const __m512i nibble = _mm512_set1_epi8(0x0f);
  const PairIndices w8(8), w4(4), w2(2);
  for (int j0 = 0; j0 < count; j0 += 16) {
    __m512i lo[8], hi[8];
    for (int p = 0; p < 8; ++p) {  // rows j0 + 2p and j0 + 2p + 1
      const __m512i x = _mm512_loadu_si512(rows + (j0 + 2 * p) * kRowBytes);
      lo[p] = _mm512_and_si512(x, nibble);
      hi[p] = _mm512_and_si512(_mm512_srli_epi16(x, 4), nibble);
    }
    for (int h = 0; h < kHeads; ++h) {
      __m512i acc[8];
      for (int p = 0; p < 8; ++p)
        acc[p] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[p], qlo[h]), hi[p], qhi[h]);
      __m512i l1[4], l2[2];
      for (int p = 0; p < 4; ++p) l1[p] = reduce_pair(acc[2 * p], acc[2 * p + 1], w8);
      for (int p = 0; p < 2; ++p) l2[p] = reduce_pair(l1[2 * p], l1[2 * p + 1], w4);
      const __m512i sums = reduce_pair(l2[0], l2[1], w2);
      _mm512_storeu_ps(scores + h * kvq_core::kTile + j0, _mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(alpha[h])));
    }
  }
}

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
  op.bits = 4, op.dim = kDim, op.is_float = false, op.per_channel = true, op.row_bytes = kRowBytes;
  op.codes_p = reinterpret_cast<const char*>(codes.data());
  auto level = [&](int64_t t, int c) { return op.level_at(codes.data() + t * kRowBytes, c); };
  alignas(64) float s_float[kHeads * kvq_core::kTile], s_int[kHeads * kvq_core::kTile];
  double err_float = 0, err_int = 0, err_exact = 0, scale = 0;
  for (int64_t t0 = 0; t0 < T; t0 += kvq_core::kTile) {  // correctness on every tile
    op.fused_scores<4, false, 3>(qs.data(), t0, kvq_core::kTile, s_float);
    int8_scores(q8.data(), alpha, codes.data() + t0 * kRowBytes, kvq_core::kTile, s_int);
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
    for (int64_t t0 = 0; t0 < T; t0 += kvq_core::kTile) int8_scores(q8.data(), alpha, codes.data() + t0 * kRowBytes, kvq_core::kTile, s_int);
    sink = sink + s_int[0];
  });
  std::printf("key scores of %d tokens x %d heads, one kv head, 1 thread, warm, best of 30:\n", T, kHeads);
  std::printf("  float fused_scores %.3f ms, max |error| %.3g of max |score| %.3g\n", ms_float, err_float, scale);
  std::printf("  int8 VNNI          %.3f ms, max |error| %.3g (%.2fx faster)\n", ms_int, err_int, ms_float / ms_int);
  return 0;
}
