// The arithmetic of kvq::decode_attention on CPU: one query token attending over one layer's
// quantized cache, straight from the packed codes (no float [T, D] copy of the cache).
// Free of ATen and of ExecuTorch: decode_attention.cpp registers it with PyTorch,
// executorch_ops.cpp with the ExecuTorch runtime; both pass plain views of their tensors.
//
// What it computes is defined by the reference (kernels/reference.py, `attention` with one
// query token); the argument list is the schema in kvq_ao/ops.py (ATTENTION_SCHEMA), which this
// file implements for the CPU dispatch key.
//
// How (flash-decoding on CPU):
// * the body's readable positions [body_start, body_end) are cut into tiles of kTile tokens and
//   the tiles into chunks, one task per chunk (the caller's parallel_for: ATen's thread pool, or OpenMP); the side
//   store (sink and recent window, full precision) is one more task;
// * per tile and per (batch, kv head): skip it if the mask hides it from every query head of the
//   group, else score all query heads of the group against its keys (GQA inside the kernel: each
//   key is unpacked once per kv head), update each head's running max / sum / weighted sum (online
//   softmax), and accumulate its values for all heads of the group;
// * keys in per-channel groups (post-RoPE) or in one per-token group a vector, and values in
//   per-token groups, are consumed as bare levels straight from the codes, in registers
//   (fused_scores, fused_values): the scales ride on q, on each score, and on the softmax weights.
//   Other formats (pre-RoPE keys, rotated at their positions; keys in several per-token groups a
//   vector; per-channel values) are unpacked into a float tile in L1 first;
// * the tasks' partial results are merged with their log-sum-exp (split softmax).
// Arithmetic is float32 throughout; GCC/Clang vector extensions give explicit 8-wide SIMD that
// compiles to AVX2/AVX-512 or NEON (-march=native at build time), with scalar tails for any
// head_dim. The hot loops use 16 lanes where AVX-512 has the registers for them (3-bit rows of
// head_dim 64 as plane pairs, kPlanePairs), else 8 lanes within AVX2's 16 registers.

#pragma once

#if defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__ARM_NEON)
#include <arm_neon.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kvq_format.h"  // generated from kvq_ao/format.py into the build directory

// A profiling build (benchmarks/kernel_alone.py --perf) defines KVQ_PROFILED as noinline, so that the
// steps of the tile loop show up in a profile as functions of their own; everywhere else it is empty.
#ifndef KVQ_PROFILED
#define KVQ_PROFILED
#endif

namespace kvq_core {

typedef float v8f __attribute__((vector_size(32)));
typedef int32_t v8i __attribute__((vector_size(32)));

// Tokens per tile: the unit of masking, online softmax and value weights. 64 rather than 32 halves
// that per-tile work (kivi-4 at 32k, one thread: 9% faster); a float tile at head_dim 64 still
// touches only 16 KiB (64 rows of 256 bytes), at head_dim 256 it is 64 KiB (in L2, not L1).
constexpr int kTile = 64;
// Rows of packed codes ahead of the one being read whose lines are prefetched (prefetch_ahead).
constexpr int kPrefetchRows = 2 * kTile;
constexpr int kMaxHeadDim = 256;     // per-tile buffers are sized for this
constexpr int kZsum = kMaxHeadDim / 8;  // zero sums per head: one per group of >= 8 channels
// Row stride of the float tiles. Not a power of two: rows 1 KiB apart would all fall in a quarter of
// L1's sets, and a tile of keys and one of values would evict each other (measured 1.5x slower).
constexpr int kRow = kMaxHeadDim + 16;
constexpr int kMaxGroupHeads = 64;   // query heads per kv head
constexpr int kMaxRopeSlots = 2;     // outlier slots a pre-RoPE key vector may have on the fused path
// Lanes of the widest float register: the hot loops' 16-lane blocks keep 8-16 accumulators, which
// fit AVX-512's 32 registers but spill on AVX2's 16 (measured 2x slower on a Zen 3 there).
#if defined(__AVX512F__)
constexpr int kWide = 16;
#else
constexpr int kWide = 8;
#endif
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline v8f load8(const float* p) { v8f v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void store8(float* p, v8f v) { std::memcpy(p, &v, sizeof(v)); }
inline v8f splat(float x) { return v8f{x, x, x, x, x, x, x, x}; }
inline v8i splat_i(int32_t x) { return v8i{x, x, x, x, x, x, x, x}; }

// Asks for the cache lines that start within [lo, lo + bytes) (a row kPrefetchRows ahead of the
// one being read), so that called once per row, in order, it asks for every line of a stream once.
// Why: a layer's cache arrives cold (the rest of the model's step evicts it), and the hardware
// prefetchers left the tile loop waiting on memory: kivi-4 at 32k tokens took 3.3 ms cold against
// 2.1 ms warm on one Xeon thread. Spread over the rows like this, cold came to 2.2 ms; the same
// lines asked for in one burst per tile changed nothing (the burst fills the line-fill buffers).
// Addresses as integers: the row ahead may lie past the end of the cache (a prefetch never faults).
inline void prefetch_lines_starting(uintptr_t lo, int64_t bytes) {
  const uintptr_t hi = lo + bytes;
  for (uintptr_t a = (lo + 63) & ~uintptr_t{63}; a < hi; a += 64) __builtin_prefetch(reinterpret_cast<const void*>(a), 0, 3);
}

#if defined(__ARM_NEON)
// Arm (NEON, every aarch64 CPU): GCC lowers the 8-lane vectors to pairs of 128-bit registers, but
// byte widening, table lookups and horizontal sums have no generic form it turns into NEON (they
// become one lane insert or extract per element), so those few helpers have NEON bodies below.
template <class V> inline void neon_halves(const V& v, uint32x4_t* lo, uint32x4_t* hi) {
  std::memcpy(lo, &v, 16);
  std::memcpy(hi, reinterpret_cast<const char*>(&v) + 16, 16);
}
template <class V, class H> inline V neon_join(const H& lo, const H& hi) {
  V v;
  std::memcpy(&v, &lo, 16);
  std::memcpy(reinterpret_cast<char*>(&v) + 16, &hi, 16);
  return v;
}
// The bytes of float lanes t[code]: each lane's 4 byte indices code * 4 + {0, 1, 2, 3}.
inline uint8x16_t neon_float_bytes(uint32x4_t code) {
  return vreinterpretq_u8_u32(vmlaq_n_u32(vdupq_n_u32(0x03020100u), code, 0x04040404u));
}
#endif

inline v8i bytes8(const uint8_t* p) {  // 8 bytes -> 8 int32 lanes
#if defined(__AVX2__)
  return reinterpret_cast<v8i>(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#elif defined(__ARM_NEON)
  const uint16x8_t w = vmovl_u8(vld1_u8(p));
  return neon_join<v8i>(vmovl_u16(vget_low_u16(w)), vmovl_high_u16(w));
#else
  return v8i{p[0], p[1], p[2], p[3], p[4], p[5], p[6], p[7]};
#endif
}
inline float hsum(v8f v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

// Planar packing (kvq_ao/quant/packing.py) at compile time: the planes of a row, and the 8 code
// words at byte j of a row (P bytes a plane; a 3-bit code word spans three bytes, P apart).
template <int BITS> constexpr int kPlanesOf = BITS == 8 ? 1 : BITS == 3 ? 8 : 8 / BITS;
template <int BITS> inline v8i code_words(const uint8_t* row, int j, int P) {
  v8i word = bytes8(row + j);
  if constexpr (BITS == 3) word = word | (bytes8(row + P + j) << 8) | (bytes8(row + 2 * P + j) << 16);
  return word;
}

// N-lane vectors for the hot loops: 16 lanes (one AVX-512 register, or two AVX2 ones) where a row
// allows, 8 lanes for the rest.
template <int N> struct Vec {
  typedef float f __attribute__((vector_size(N * 4)));
  typedef int32_t i __attribute__((vector_size(N * 4)));
};
template <int N> inline typename Vec<N>::f loadv(const float* p) { typename Vec<N>::f v; std::memcpy(&v, p, sizeof(v)); return v; }
template <int N> inline void storev(float* p, typename Vec<N>::f v) { std::memcpy(p, &v, sizeof(v)); }
template <int N> inline typename Vec<N>::f splatv(float x) { return x - typename Vec<N>::f{}; }  // x - 0 folds to a broadcast
template <int N> inline typename Vec<N>::i bytesv(const uint8_t* p) {  // N bytes -> N int32 lanes
#if defined(__AVX512F__)
  if constexpr (N == 16) return reinterpret_cast<typename Vec<N>::i>(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#endif
#if defined(__AVX2__)
  if constexpr (N == 8) return reinterpret_cast<typename Vec<N>::i>(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#endif
#if defined(__ARM_NEON)
  if constexpr (N == 8) return bytes8(p);
#endif
  typename Vec<N>::i v;
  for (int l = 0; l < N; ++l) v[l] = p[l];
  return v;
}
// table[code] for codebook levels of BITS-bit codes (tables of 16 entries), N lanes.
template <int N, int BITS = 4> inline typename Vec<N>::f lookupv(typename Vec<N>::i code, const float* table) {
#if defined(__AVX512F__)
  if constexpr (N == 16) return reinterpret_cast<typename Vec<N>::f>(_mm512_permutexvar_ps(reinterpret_cast<__m512i>(code), _mm512_loadu_ps(table)));
#endif
#if defined(__AVX2__)
  if constexpr (N == 8) {
    const __m256i c = reinterpret_cast<__m256i>(code);
    const __m256 below = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table), c);
    if constexpr (BITS <= 3) return reinterpret_cast<typename Vec<N>::f>(below);  // codes < 8: one permute
    const __m256 above = _mm256_permutevar8x32_ps(_mm256_loadu_ps(table + 8), c);
    // code >= 8 picks `above`: blendv reads the sign bit, where a shift by 28 puts bit 3 of the code
    return reinterpret_cast<typename Vec<N>::f>(_mm256_blendv_ps(below, above, _mm256_castsi256_ps(_mm256_slli_epi32(c, 28))));
  }
#endif
#if defined(__ARM_NEON)
  if constexpr (N == 8) {  // one byte-table lookup (TBL) per 4 lanes: 8 levels are 32 bytes, 16 are 64
    uint32x4_t lo, hi;
    neon_halves(code, &lo, &hi);
    const uint8_t* bytes = reinterpret_cast<const uint8_t*>(table);
    if constexpr (BITS <= 3) {
      const uint8x16x2_t t = vld1q_u8_x2(bytes);
      return neon_join<typename Vec<N>::f>(vqtbl2q_u8(t, neon_float_bytes(lo)), vqtbl2q_u8(t, neon_float_bytes(hi)));
    } else {
      const uint8x16x4_t t = vld1q_u8_x4(bytes);
      return neon_join<typename Vec<N>::f>(vqtbl4q_u8(t, neon_float_bytes(lo)), vqtbl4q_u8(t, neon_float_bytes(hi)));
    }
  }
#endif
  typename Vec<N>::f v;
  for (int l = 0; l < N; ++l) v[l] = table[code[l]];
  return v;
}
// code_words for N lanes: the N code words at byte j of a row (j + N <= P).
template <int BITS, int N> inline typename Vec<N>::i code_words_v(const uint8_t* row, int j, int P) {
  if constexpr (N == 8) return code_words<BITS>(row, j, P);
  typename Vec<N>::i word = bytesv<N>(row + j);
  if constexpr (BITS == 3) word = word | (bytesv<N>(row + P + j) << 8) | (bytesv<N>(row + 2 * P + j) << 16);
  return word;
}
// Channel blocks of the fused loops: N consecutive channels of one plane (word j of a row holds code
// j of every plane), except 3-bit codes at 8 bytes a plane (head_dim 64) in 16 lanes, where a block
// is a plane pair: the row's 8 code words in both halves of a register, block i = planes 2i (low
// half) and 2i + 1 = channels [16i, 16i + 16). Without pairs such rows ran on 8 lanes (other
// 3-bit rows still do: wide_scores).
template <int BITS, int N> constexpr bool kPlanePairs = BITS == 3 && N == 16;
template <int BITS, int N> constexpr int kBlocksOf = kPlanePairs<BITS, N> ? kPlanesOf<BITS> / 2 : kPlanesOf<BITS>;
// The code words of block column j of a row (P = dim / kBlocksOf: a plane's bytes, or a pair's 16).
template <int BITS, int N> inline typename Vec<N>::i block_words(const uint8_t* row, int j, int P) {
  if constexpr (kPlanePairs<BITS, N>) {
    const v8i w = code_words<BITS>(row, 0, P / 2);
#if defined(__AVX512F__)
    return reinterpret_cast<typename Vec<N>::i>(_mm512_broadcast_i64x4(reinterpret_cast<__m256i>(w)));
#else
    typename Vec<N>::i both;  // (a copy through memory would stall on store forwarding)
    for (int l = 0; l < N; ++l) both[l] = w[l % 8];
    return both;
#endif
  } else {
    return code_words_v<BITS, N>(row, j, P);
  }
}
// The 8 lanes of a + the 8 lanes of b, as one v8f (halves of 16-lane sums).
inline v8f fold16(Vec<16>::f v) {
#if defined(__AVX512F__)
  // in registers: halves through memory cost a failed store-to-load forward (a 64-byte store read
  // back as two 32-byte loads) on every fold, a seventh of the wide key scores' time
  const __m512d x = reinterpret_cast<__m512d>(v);
  return reinterpret_cast<v8f>(_mm256_add_ps(_mm256_castpd_ps(_mm512_castpd512_pd256(x)), _mm256_castpd_ps(_mm512_extractf64x4_pd(x, 1))));
#endif
  v8f lo, hi;
  std::memcpy(&lo, &v, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
  return lo + hi;
}
inline v8f fold16(v8f v) { return v; }  // already 8 lanes
// The lane-wise max of a 16-lane vector's halves, with the select the 8-lane loops use.
inline v8f max8(Vec<16>::f v) {
  v8f lo, hi;
#if defined(__AVX512F__)  // in registers, as fold16
  const __m512d x = reinterpret_cast<__m512d>(v);
  lo = reinterpret_cast<v8f>(_mm512_castpd512_pd256(x)), hi = reinterpret_cast<v8f>(_mm512_extractf64x4_pd(x, 1));
#else
  std::memcpy(&lo, &v, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
#endif
  return lo > hi ? lo : hi;
}
inline v8f max8(v8f v) { return v; }

// out[r] = sum of the lanes of a[r], r < 8.
inline void hsum8x8(const v8f* a, float* out) {
#if defined(__AVX2__)
  const __m256 s01 = _mm256_hadd_ps(reinterpret_cast<__m256>(a[0]), reinterpret_cast<__m256>(a[1]));
  const __m256 s23 = _mm256_hadd_ps(reinterpret_cast<__m256>(a[2]), reinterpret_cast<__m256>(a[3]));
  const __m256 s45 = _mm256_hadd_ps(reinterpret_cast<__m256>(a[4]), reinterpret_cast<__m256>(a[5]));
  const __m256 s67 = _mm256_hadd_ps(reinterpret_cast<__m256>(a[6]), reinterpret_cast<__m256>(a[7]));
  const __m256 lo = _mm256_hadd_ps(s01, s23), hi = _mm256_hadd_ps(s45, s67);  // [0..3 | 0..3], [4..7 | 4..7]
  _mm256_storeu_ps(out, _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31)));
#elif defined(__ARM_NEON)
  float32x4_t s[8];
  for (int r = 0; r < 8; ++r) {
    float32x4_t lo, hi;
    std::memcpy(&lo, &a[r], 16);
    std::memcpy(&hi, reinterpret_cast<const char*>(&a[r]) + 16, 16);
    s[r] = vaddq_f32(lo, hi);
  }
  for (int r = 0; r < 8; r += 4)  // pairwise adds: [s0 s1 s2 s3] sums in one register
    vst1q_f32(out + r, vpaddq_f32(vpaddq_f32(s[r], s[r + 1]), vpaddq_f32(s[r + 2], s[r + 3])));
#else
  for (int r = 0; r < 8; ++r) out[r] = hsum(a[r]);
#endif
}

#if defined(__AVX512F__)
// out[r] = sum of the 16 lanes of a[r], r < 8: halves, then quarters, then pairs of lanes of two
// rows added in one register each step (24 instructions; folding each row to 8 lanes first and
// then hsum8x8 took about 40, a tenth of the wide key scores' time).
inline void hsum8x8(const Vec<16>::f* a, float* out) {
  auto m = [](Vec<16>::f v) { return reinterpret_cast<__m512>(v); };
  __m512 h[4], q[2];
  for (int r = 0; r < 4; ++r)  // rows 2r, 2r + 1: [row 2r 8 lanes | row 2r + 1 8 lanes]
    h[r] = _mm512_add_ps(_mm512_shuffle_f32x4(m(a[2 * r]), m(a[2 * r + 1]), 0x44), _mm512_shuffle_f32x4(m(a[2 * r]), m(a[2 * r + 1]), 0xee));
  for (int r = 0; r < 2; ++r)  // rows 4r .. 4r + 3, 4 lanes each
    q[r] = _mm512_add_ps(_mm512_shuffle_f32x4(h[2 * r], h[2 * r + 1], 0x88), _mm512_shuffle_f32x4(h[2 * r], h[2 * r + 1], 0xdd));
  // 128-bit block k of q[0] holds row k (of the first 4), of q[1] row k + 4: two lanes each, then one
  const __m512 e = _mm512_add_ps(_mm512_shuffle_ps(q[0], q[1], 0x44), _mm512_shuffle_ps(q[0], q[1], 0xee));
  const __m512 f = _mm512_add_ps(e, _mm512_shuffle_ps(e, e, 0xb1));  // block k: [row k, row k, row k + 4, row k + 4]
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0);
  _mm256_storeu_ps(out, _mm512_castps512_ps256(_mm512_permutexvar_ps(order, f)));
}
#endif

// exp(x) for x <= 0 (scores minus their running max), 8 lanes: 2^n * P(r), |rel err| < 2e-7.
template <int N>
inline typename Vec<N>::f expv(typename Vec<N>::f x) {
  typedef typename Vec<N>::f vf;
  x = x < splatv<N>(-87.0f) ? splatv<N>(-87.0f) : x;
  const vf magic = splatv<N>(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  vf n = (x * splatv<N>(1.44269504f) + magic) - magic;
  vf r = x - n * splatv<N>(0.693145751953125f) - n * splatv<N>(1.428606765330187e-06f);
  vf p = splatv<N>(1.0f / 720);
  p = p * r + splatv<N>(1.0f / 120);
  p = p * r + splatv<N>(1.0f / 24);
  p = p * r + splatv<N>(1.0f / 6);
  p = p * r + splatv<N>(0.5f);
  p = p * r + splatv<N>(1.0f);
  p = p * r + splatv<N>(1.0f);
  typename Vec<N>::i e = (__builtin_convertvector(n, typename Vec<N>::i) + 127) << 23;
  vf scale;
  std::memcpy(&scale, &e, sizeof(scale));
  return p * scale;
}

typedef double v8d __attribute__((vector_size(64)));

// sin and cos of 8 float32 angles as torch computes them, to ~1e-7: reduced modulo pi/2 in float32
// with FMAs below 2^21 radians, else in double (within 9.3e-8 of double sin/cos up to 2^24, where
// the float reduction's error had grown to 2e-4), then Cephes' single-precision polynomials on
// the remainder (|r| <= pi/4), quadrant by selects. Explicit vectors: the same arithmetic as a
// scalar loop did not vectorize; polynomials in double cost twice as much and were a quarter of a
// pre-RoPE format's time.
inline void sincos8(v8f a, v8f* s, v8f* c) {
  v8f r;
  v8i quadrant;
#if defined(__FMA__)
  const __m256 x = reinterpret_cast<__m256>(a);
  const __m256 magnitude = _mm256_andnot_ps(_mm256_set1_ps(-0.f), x);
  if (_mm256_movemask_ps(_mm256_cmp_ps(magnitude, _mm256_set1_ps(2097152.f), _CMP_GE_OQ)) == 0) {
    // Angles below 2^21 (every lane): Cody-Waite in float32, pi/2 as three floats, each product
    // subtracted by an FMA (exact product, one rounding): sin/cos within 1.2e-7 up to 2^20 and
    // 3.7e-7 up to 2^21 (against double), at half the cost of the reduction in double.
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(0.636619772f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 rr = _mm256_fnmadd_ps(k, _mm256_set1_ps(1.57079637e+00f), x);
    rr = _mm256_fnmadd_ps(k, _mm256_set1_ps(-4.37113883e-08f), rr);
    rr = _mm256_fnmadd_ps(k, _mm256_set1_ps(-1.71512451e-15f), rr);
    r = reinterpret_cast<v8f>(rr);
    quadrant = __builtin_convertvector(reinterpret_cast<v8f>(k), v8i) & 3;
  } else
#endif
  {
    const v8d xd = __builtin_convertvector(a, v8d);
    const v8d magic = xd * 0.0 + 6755399441055744.0;  // 1.5 * 2^52: adding it rounds to an integer
    const v8d k = (xd * 0.63661977236758134 + magic) - magic;
    r = __builtin_convertvector((xd - k * 1.5707963267948966) - k * 6.123233995736766e-17, v8f);
    quadrant = __builtin_convertvector(k, v8i) & 3;
  }
  const v8f r2 = r * r;
  const v8f sf = r + r * r2 * (splat(-1.6666654611e-1f) + r2 * (splat(8.3321608736e-3f) + r2 * splat(-1.9515295891e-4f)));
  const v8f cf = splat(1.0f) - splat(0.5f) * r2 +
                 r2 * r2 * (splat(4.166664568298827e-2f) + r2 * (splat(-1.388731625493765e-3f) + r2 * splat(2.443315711809948e-5f)));
  const v8i odd = (quadrant & 1) != 0;
  const v8f sv = odd ? cf : sf, cv = odd ? sf : cf;
  *s = quadrant >= 2 ? -sv : sv;
  *c = (quadrant == 1) | (quadrant == 2) ? -cv : cv;
}

inline void sincos1(float a, float* s, float* c) {
  v8f vs, vc;
  sincos8(splat(a), &vs, &vc);
  *s = vs[0];
  *c = vc[0];
}

// The dtypes the kernel reads (each registration layer maps its tensor type onto these).
enum class DType { Bool, Byte, Long, Half, BFloat16, Float, Double, Other };

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::Bool: return "bool";
    case DType::Byte: return "uint8";
    case DType::Long: return "int64";
    case DType::Half: return "float16";
    case DType::BFloat16: return "bfloat16";
    case DType::Float: return "float32";
    case DType::Double: return "float64";
    default: return "an unsupported dtype";
  }
}

inline int dtype_size(DType t) {
  switch (t) {
    case DType::Bool: case DType::Byte: return 1;
    case DType::Half: case DType::BFloat16: return 2;
    case DType::Float: return 4;
    default: return 8;
  }
}

inline bool is_float(DType t) { return t == DType::Half || t == DType::BFloat16 || t == DType::Float || t == DType::Double; }

inline float half_to_float(uint16_t h) {  // IEEE binary16 -> float32, subnormals and inf/nan included
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) bits = sign | 0x7f800000u | (man << 13);
  else if (exp != 0) bits = sign | ((exp + 112) << 23) | (man << 13);
  else if (man == 0) bits = sign;
  else {
    float f = static_cast<float>(man) * (1.0f / 16777216.0f);  // man * 2^-24
    std::memcpy(&bits, &f, sizeof(bits));
    bits |= sign;
  }
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// Reads `n` elements of a float tensor of any supported dtype as float32.
inline void load_floats(const void* src, DType type, int64_t n, float* out) {
  switch (type) {
    case DType::Float: std::memcpy(out, src, n * sizeof(float)); break;
    case DType::Half: {
      auto* p = static_cast<const uint16_t*>(src);
      int64_t i = 0;
#if defined(__F16C__)
      for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + i))));
#endif
      for (; i < n; ++i) out[i] = half_to_float(p[i]);
      break;
    }
    case DType::BFloat16: {
      auto* p = static_cast<const uint16_t*>(src);
      for (int64_t i = 0; i < n; ++i) {
        const uint32_t bits = static_cast<uint32_t>(p[i]) << 16;
        std::memcpy(out + i, &bits, sizeof(float));
      }
      break;
    }
    case DType::Double: { auto* p = static_cast<const double*>(src); for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(p[i]); break; }
    default: throw std::invalid_argument(std::string("kvq.decode_attention: unsupported float dtype ") + dtype_name(type));
  }
}

// A tensor as the kernel reads it: data, dtype, sizes, and element strides (all contiguous except
// the mask, which may be a broadcast view). `present` is false for an absent optional tensor.
struct View {
  bool present = false;
  const void* data = nullptr;
  DType dtype = DType::Other;
  int dim = 0;
  int64_t sizes[6] = {};
  int64_t strides[6] = {};
  int64_t size(int i) const { return sizes[i]; }
  int64_t numel() const { int64_t n = 1; for (int i = 0; i < dim; ++i) n *= sizes[i]; return n; }
  const char* bytes() const { return static_cast<const char*>(data); }
  std::string shape() const {
    std::ostringstream s;
    s << "[";
    for (int i = 0; i < dim; ++i) s << (i ? ", " : "") << sizes[i];
    s << "]";
    return s.str();
  }
};

// One operand (K or V) as the kernel reads it: the fields of kvq_ao/format.py by name (make_args
// fills them from the op's lists through the generated kvq_format.h indices).
struct OperandArgs {
  View codes;     // packed codes (or the values of a float body)
  View scale;     // absent for a float body
  View zero;      // absent for a float body
  View codebook;  // absent for uniform levels
  View out_val;   // exact outliers, absent without outlier slots
  View out_idx;   // their channels (uint8)
  View side;      // full-precision entries (sink, recent window)
  int64_t bits = kvq_format::kFloatBits, axis = kvq_format::kAxisToken, group = 1;
  int64_t query_bits = kvq_format::kFloatQuery;  // how keys are scored (kvq_ao/format.py)
  int64_t meta = kvq_format::kFloatMeta;         // how scale and zero are stored (kvq_ao/format.py)
};

// The kernel's arguments: the two operands and the fields they share (ATTENTION_SCHEMA, kvq_ao/ops.py).
struct Args {
  View q;
  OperandArgs k, v;
  View side_pos, body_end, mask, rope_inv_freq;
  int64_t body_start = 0;
  double scaling = 1.0, rope_scale = 1.0;
  double softcap = 0.0;
  // Not in ATTENTION_SCHEMA: kvq::decode_attention_partial's shard start (body index 0 is this
  // sequence position for RoPE; masks and body bounds stay in the shard's indices).
  int64_t position_offset = 0;
};

// Bad arguments: std::invalid_argument with the pieces streamed into one message (the layers turn
// it into a ValueError in PyTorch and an InvalidArgument failure in ExecuTorch).
template <typename... Parts>
inline void check(bool ok, const Parts&... parts) {
  if (ok) return;
  std::ostringstream s;
  s << "kvq.decode_attention: ";
  (s << ... << parts);
  throw std::invalid_argument(s.str());
}

// DType of a ScalarType code: c10's and ExecuTorch's ScalarType enums share their numbering.
inline DType dtype_of_code(int code) {
  switch (code) {
    case 0: return DType::Byte;
    case 4: return DType::Long;
    case 5: return DType::Half;
    case 6: return DType::Float;
    case 7: return DType::Double;
    case 11: return DType::Bool;
    case 15: return DType::BFloat16;
    default: return DType::Other;
  }
}

// A View of a tensor of either runtime: at::Tensor and ExecuTorch's Tensor both have dim(), size(),
// strides(), scalar_type() and const_data_ptr(). The caller keeps the tensor alive.
template <class Tensor>
View view_of(const Tensor& t) {
  check(t.dim() <= 6, "tensors of at most 6 dims, got ", t.dim());
  View v;
  v.present = true;
  v.data = t.const_data_ptr();
  v.dtype = dtype_of_code(static_cast<int>(t.scalar_type()));
  v.dim = static_cast<int>(t.dim());
  for (int i = 0; i < v.dim; ++i) {
    v.sizes[i] = t.size(i);
    v.strides[i] = t.strides()[i];
  }
  return v;
}

template <class Tensor>
View view_of(const std::optional<Tensor>& t) {
  return t.has_value() ? view_of(*t) : View{};
}

// One operand from an op's Tensor?[] and int[] arguments, by the indices kvq_format.h generates
// from kvq_ao/format.py (the one place their order is written).
template <class List, class Ints>
OperandArgs operand_of(const char* name, const List& tensors, const Ints& format) {
  check(static_cast<int64_t>(tensors.size()) == kvq_format::kTensorFields, name, " must list ", kvq_format::kTensorFields,
        " tensors, got ", tensors.size());
  check(static_cast<int64_t>(format.size()) == kvq_format::kIntFields, name, "_format must list ", kvq_format::kIntFields,
        " ints, got ", format.size());
  auto field = [&](int i) { return view_of(tensors[i]); };
  OperandArgs o;
  o.codes = field(kvq_format::CODES), o.scale = field(kvq_format::SCALE), o.zero = field(kvq_format::ZERO);
  o.codebook = field(kvq_format::CODEBOOK), o.out_val = field(kvq_format::OUT_VAL), o.out_idx = field(kvq_format::OUT_IDX);
  o.side = field(kvq_format::SIDE);
  check(o.codes.present && o.side.present, name, " needs its codes and side tensors (got None)");
  o.bits = format[kvq_format::BITS], o.axis = format[kvq_format::AXIS], o.group = format[kvq_format::GROUP];
  o.query_bits = format[kvq_format::QUERY_BITS];
  o.meta = format[kvq_format::META];
  return o;
}

// The Args of one call: the one place both registration layers (decode_attention.cpp,
// executorch_ops.cpp) turn their tensors into the kernel's arguments.
template <class T, class O, class List, class Ints>
Args make_args(const T& q, const List& k, const Ints& k_format, const List& v, const Ints& v_format, const T& side_pos,
               const T& body_end, const T& mask, const O& rope_inv_freq, int64_t body_start, double scaling,
               double rope_scale, double softcap) {
  Args a;
  a.q = view_of(q);
  a.k = operand_of("k", k, k_format);
  a.v = operand_of("v", v, v_format);
  a.side_pos = view_of(side_pos), a.body_end = view_of(body_end), a.mask = view_of(mask);
  a.rope_inv_freq = view_of(rope_inv_freq);
  a.body_start = body_start, a.scaling = scaling, a.rope_scale = rope_scale;
  a.softcap = softcap;
  return a;
}

// Per-thread buffers of one operand: its scale/zero row as floats, kept while tokens share it.
struct Scratch {
  float scale[kMaxHeadDim], zero[kMaxHeadDim];
  float tile_scale[kTile * kMaxHeadDim], tile_zero[kTile * kMaxHeadDim];  // [group][token], axis 0
  float raw[kTile * kMaxHeadDim];
  int64_t meta_row = -1;
  alignas(64) float qs[kMaxGroupHeads * kMaxHeadDim];
  float bias[kMaxGroupHeads];  // q * scale and q . zero of meta_row
  // integer-query keys: q * scale rounded (an int16 query as two int8 digits, hi in q8 and lo in
  // q8_lo: q = 256 hi + lo), and its step
  alignas(64) int8_t q8[kMaxGroupHeads * kMaxHeadDim];
  alignas(64) int8_t q8_lo[kMaxGroupHeads * kMaxHeadDim];
  float alpha[kMaxGroupHeads];
  // rope_lane_scores' per-channel level tables (head_dim 64): entry 16 c + l = scale[c] *
  // level[l mod 2^bits] + zero[c], one fused multiply-add as the rows take it, for scale row
  // table_row[r % kLaneTables] in slot r % kLaneTables. Pre-RoPE tiles go tile-major over the kv
  // heads, so with one calibrated row a head (kvquant) the slots keep each head's table over the call.
  static constexpr int kLaneTables = 4;
  alignas(64) float lane_table[kLaneTables][64 * 16];
  int64_t table_row[kLaneTables] = {-1, -1, -1, -1};
};

// Everything a task needs besides the shared partial results: allocated once per thread and kept
// (a fresh ~0.5 MB per call cost page faults and zeroing on every layer of every decode step).
struct Workspace {
  alignas(64) float ktile[kTile * kRow];
  alignas(64) float vtile[kTile * kRow];
  alignas(64) float scores[kMaxGroupHeads * kTile];
  alignas(64) float probs[kMaxGroupHeads * kTile];
  float cos_t[kTile * kMaxHeadDim / 2], sin_t[kTile * kMaxHeadDim / 2];
  uint8_t visible[kMaxGroupHeads * kTile];
  Scratch k_tmp, v_tmp;

  static Workspace& of_this_thread() {
    thread_local std::unique_ptr<Workspace> ws(new Workspace);  // default-initialized: not zeroed
    return *ws;
  }
};

struct Partial;

// One of K or V, as the kernel reads it.
struct Operand {
  int bits = 0, group = 1, dim = 0;            // code width (packed bodies), tokens or channels per group
  bool is_float = true;                          // a float body: codes are the values (kvq_format::is_float)
  bool per_channel = false;                      // channel axis: one scale/zero row per group of tokens
  int64_t row_bytes = 0;                         // packed bytes (or float elements) per token
  const char* codes_p = nullptr;
  const char* scale_p = nullptr;
  const char* zero_p = nullptr;
  const char* out_val_p = nullptr;
  const uint8_t* out_idx_p = nullptr;
  DType codes_t = DType::Byte, scale_t = DType::Half, zero_t = DType::Half, out_val_t = DType::Float;
  int codes_size = 1, scale_size = 2, zero_size = 2, out_val_size = 4;
  int n_out = 0;
  float levels[16] = {};                          // codebook levels (or the integer grid)
  bool codebook = false;
  bool int_query = false;                         // keys scored against an integer query (kvq_format::kInt8Query, kInt16Query)
  int32_t query_levels = 0;                       // its steps a side (127: int8; 32512: int16, two int8 digits)
  bool meta8 = false;                             // scale and zero as 8-bit codes (kvq_format::is_meta8), per-token groups
  kvq_format::MetaTable meta_table;               // what its codes decode to (L: 2^bits - 1, or 1 with a codebook)

  // 8-bit metadata of n groups (scale codes s, zero codes z) as floats: scale = S[s],
  // zero = -(scale * float(L * z)) * 2^-8, in float32 as kvq_ao/format.py writes it.
  void decode_meta(const uint8_t* s, const uint8_t* z, int64_t n, float* scale, float* zero) const {
    for (int64_t i = 0; i < n; ++i) {
      scale[i] = meta_table.scale[s[i]];
      zero[i] = meta_table.zero(scale[i], z[i]);
    }
  }

  // The fast paths (defined below): keys with per-channel groups scored from their levels, values
  // with per-token groups accumulated from their levels.
  void direct_key_scores(const float* q, int n_heads, int64_t bh, int64_t T, int64_t t0, int count, float* lv,
                         float* scores, Scratch& tmp) const;
  void vector_key_scores(const float* q, int n_heads, int64_t bh, int64_t T, int64_t t0, int count, float* scores,
                         Scratch& tmp) const;
  // Keys that vector_key_scores serves: quantized, one per-token group a vector (the rotated
  // formats' layout), float query, planes of whole 8-lane blocks.
  bool vector_keys() const { return !is_float && !per_channel && group == dim && !int_query && fusable(); }
  void rope_tile(int64_t bh, int64_t T, int64_t t0, int count, const float* cos_t, const float* sin_t, float* out,
                 Scratch& tmp) const;
  void rope_lane_tile(const float* q, int n_heads, int64_t bh, int64_t T, int64_t t0, int count, const float* cos_l,
                      const float* sin_l, float* scores, Scratch& tmp) const;
  void direct_accumulate(float* acc, float correction, const float* probs, int count, const float* lv, const Scratch& tmp,
                         int64_t bh, int64_t T, int64_t t0) const;
  void token_weights(const float* probs, int count, const Scratch& tmp, float* w, float* zsum, int group_stride = kTile) const;
  void add_zero_sums(float* acc, const float* zsum) const;

  // acc[d] += p_j * (exact - dense) for each outlier of the tile's tokens `first + j` that p_j
  // sees: per-token-group values after their dense levels were accumulated; level(j, d) is the
  // bare level of token j's channel d.
  template <typename Level>
  void correct_value_outliers(float* acc, const float* probs, int count, const Scratch& tmp, int64_t first, Level&& level) const {
    for_each_outlier(first, count, [&](int j, int d, float exact) {
      if (probs[j] == 0.f) return;
      const int g = d / group;
      acc[d] += probs[j] * (exact - (tmp.tile_scale[g * kTile + j] * level(j, d) + tmp.tile_zero[g * kTile + j]));
    });
  }

  // Tokens [t0, t0 + count) of (batch, head) `bh` as floats, row i at out + i * kRow.
  void tile(int64_t bh, int64_t T, int64_t t0, int count, float* out, Scratch& tmp) const {
    if (is_float) {
      for (int i = 0; i < count; ++i)
        load_floats(codes_p + (bh * T + t0 + i) * dim * codes_size, codes_t, dim, out + i * kRow);
    } else {
      dispatch([&](auto unpack_row) { tile_with(unpack_row, bh, T, t0, count, out, tmp); });
    }
    // exact outliers replace their channel's dense value
    for_each_outlier(bh * T + t0, count, [&](int i, int d, float exact) { out[i * kRow + d] = exact; });
  }

  // fn(j, channel, exact value) for each filled outlier slot of the tokens `first + j`, j < count
  // (indices in [B * H * T]). Their slots are contiguous, so the values are read as a few blocks, not
  // one call per token (per token, this cost a kvquant format a tenth of its time).
  template <typename F>
  void for_each_outlier(int64_t first, int count, F&& fn) const {
    if (!n_out) return;
    float vals[kMaxHeadDim];
    const int per_block = std::max(1, kMaxHeadDim / n_out);  // tokens whose values fit in vals
    for (int j0 = 0; j0 < count; j0 += per_block) {
      const int m = std::min(per_block, count - j0);
      load_floats(out_val_p + (first + j0) * n_out * out_val_size, out_val_t, int64_t{m} * n_out, vals);
      const uint8_t* idx = out_idx_p + (first + j0) * n_out;
      for (int j = 0; j < m; ++j)
        for (int o = 0; o < n_out; ++o)  // an index >= dim marks an empty slot
          if (idx[j * n_out + o] < dim) fn(j0 + j, static_cast<int>(idx[j * n_out + o]), vals[j * n_out + o]);
    }
  }

  // Row j of packed codes starting at `src` is being read: prefetch the row kPrefetchRows ahead.
  inline void prefetch_ahead(const uint8_t* src, int j) const {
    prefetch_lines_starting(reinterpret_cast<uintptr_t>(src) + (j + kPrefetchRows) * row_bytes, row_bytes);
  }

  // Tokens [t0, t0 + count) of (batch, head) `bh` as bare levels, row i at out + i * kRow
  // (quantized operands only; outliers are left to the caller's corrections).
  void levels_tile(int64_t bh, int64_t T, int64_t t0, int count, float* out) const {
    const uint8_t* src = reinterpret_cast<const uint8_t*>(codes_p) + (bh * T + t0) * row_bytes;
    dispatch([&](auto unpack_row) {
      for (int i = 0; i < count; ++i) {
        prefetch_ahead(src, i);
        unpack_row(src + i * row_bytes, out + i * kRow, nullptr, nullptr, std::false_type{});
      }
    });
  }

  // Per-token scale and zero of tokens [t0, t0 + count), axis 0, as [group][token] rows kTile apart
  // (what the weights of a group are computed from, a vector at a time).
  void token_meta(int64_t bh, int64_t T, int64_t t0, int count, Scratch& tmp) const {
    const int groups = dim / group;
    const int64_t meta = (bh * T + t0) * groups;
    if (meta8) {
      if (groups == 1) {
        decode_meta(reinterpret_cast<const uint8_t*>(scale_p) + meta, reinterpret_cast<const uint8_t*>(zero_p) + meta, count,
                    tmp.tile_scale, tmp.tile_zero);
        return;
      }
      for (int j = 0; j < count; ++j)
        for (int g = 0; g < groups; ++g)
          decode_meta(reinterpret_cast<const uint8_t*>(scale_p) + meta + j * groups + g,
                      reinterpret_cast<const uint8_t*>(zero_p) + meta + j * groups + g, 1, tmp.tile_scale + g * kTile + j,
                      tmp.tile_zero + g * kTile + j);
      return;
    }
    if (groups == 1) {  // already [token] rows
      load_floats(scale_p + meta * scale_size, scale_t, count, tmp.tile_scale);
      load_floats(zero_p + meta * zero_size, zero_t, count, tmp.tile_zero);
      return;
    }
#if defined(__F16C__)
    if (groups == 2 && scale_t == DType::Half && zero_t == DType::Half && count % 8 == 0) {
      // [token][2] halves -> two [token] rows: 8 tokens per step, deinterleaved in registers
      auto split = [&](const char* src, float* out) {
        const uint16_t* p = reinterpret_cast<const uint16_t*>(src);
        for (int j = 0; j < count; j += 8) {
          const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * j)));
          const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 2 * j + 8)));
          const __m256d g0 = _mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0x88)), g1 = _mm256_castps_pd(_mm256_shuffle_ps(lo, hi, 0xdd));
          _mm256_storeu_ps(out + j, _mm256_castpd_ps(_mm256_permute4x64_pd(g0, 0xd8)));
          _mm256_storeu_ps(out + kTile + j, _mm256_castpd_ps(_mm256_permute4x64_pd(g1, 0xd8)));
        }
      };
      split(scale_p + meta * scale_size, tmp.tile_scale);
      split(zero_p + meta * zero_size, tmp.tile_zero);
      return;
    }
#endif
    load_floats(scale_p + meta * scale_size, scale_t, int64_t{count} * groups, tmp.raw);
    for (int j = 0; j < count; ++j)
      for (int g = 0; g < groups; ++g) tmp.tile_scale[g * kTile + j] = tmp.raw[j * groups + g];
    load_floats(zero_p + meta * zero_size, zero_t, int64_t{count} * groups, tmp.raw);
    for (int j = 0; j < count; ++j)
      for (int g = 0; g < groups; ++g) tmp.tile_zero[g * kTile + j] = tmp.raw[j * groups + g];
  }

  // Planes of a packed row (codes of channel i * P + j share byte j, or bytes j, P + j, 2P + j at 3 bits).
  int planes() const { return kvq_format::codes_per_word(bits); }

  // Whether the fused paths below serve this operand: quantized, and a plane is whole 8-lane blocks.
  bool fusable() const { return !is_float && (dim / planes()) % 8 == 0; }

  // Per-channel groups: tmp.scale/tmp.zero hold scale row `meta_row` ([batch * heads * T / group]).
  // Returns whether it had to load them (the rows a caller derives from them are then stale too).
  bool load_scale_row(int64_t meta_row, Scratch& tmp) const {
    if (meta_row == tmp.meta_row) return false;
    load_floats(scale_p + meta_row * dim * scale_size, scale_t, dim, tmp.scale);
    load_floats(zero_p + meta_row * dim * zero_size, zero_t, dim, tmp.zero);
    tmp.meta_row = meta_row;
    return true;
  }

  // The bare level of channel d of a packed row (for outlier corrections; scalar).
  float level_at(const uint8_t* row, int d) const {
    if (bits == 8) return level1(row[d]);
    const int P = dim / planes(), j = d % P, i = d / P;
    int32_t word = row[j];
    if (bits == 3) word |= (row[P + j] << 8) | (row[2 * P + j] << 16);
    return level1((word >> (i * bits)) & ((1 << bits) - 1));
  }

  // Calls f(bits, codebook) with both as compile-time constants.
  template <typename F>
  void with_format(F&& f) const {
    auto with = [&](auto bits_c) {
      if (codebook) f(bits_c, std::true_type{});
      else f(bits_c, std::false_type{});
    };
    switch (bits) {
      case 2: with(std::integral_constant<int, 2>{}); break;
      case 3: with(std::integral_constant<int, 3>{}); break;
      case 4: with(std::integral_constant<int, 4>{}); break;
      default: with(std::integral_constant<int, 8>{}); break;
    }
  }

  // A fused value pass keeps heads x planes-per-sweep accumulators in registers: at most 12, which
  // leaves AVX2's 16 registers room for the codes being unpacked. Wide formats (3 bits: 8 planes)
  // sweep a row's planes in two halves, so one unpacked level still serves three heads.
  template <int BITS>
  static constexpr int sweep_planes() { return BITS == 8 ? 1 : BITS == 4 ? 2 : 4; }
  static constexpr int kPass = 4;  // the most heads of one fused value pass (max_pass_heads)
  template <int BITS>
  static constexpr int max_pass_heads() { return BITS == 4 || BITS == 8 ? 4 : 3; }

  // The bare levels (the integer grid, or the codebook) of plane i of N code words (code_words), or
  // of block i of a plane pair's words (kPlanePairs, block_words).
  template <int BITS, bool CB, int N = 8>
  typename Vec<N>::f plane_levels(typename Vec<N>::i word, int i) const {
    constexpr int32_t kMask = BITS == 8 ? 0xff : (1 << BITS) - 1;
    if constexpr (kPlanePairs<BITS, N>) {  // planes 2i and 2i + 1: shifts 6i in the low half, 6i + 3 in the high
#if defined(__AVX512F__)
      // vpermps reads an index's low 4 bits: the 8 levels repeated, so the next code's bit needs no mask
      const __m512 grid = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7);
      const __m512 table = CB ? _mm512_shuffle_f32x4(_mm512_castps256_ps512(_mm256_loadu_ps(levels)),
                                                     _mm512_castps256_ps512(_mm256_loadu_ps(levels)), 0x44)
                              : grid;
      const __m512i shift = _mm512_add_epi32(_mm512_set1_epi32(6 * i), _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 3, 3, 3, 3, 3, 3, 3, 3));
      return reinterpret_cast<typename Vec<N>::f>(_mm512_permutexvar_ps(_mm512_srlv_epi32(reinterpret_cast<__m512i>(word), shift), table));
#else
      typename Vec<N>::i code;
      for (int l = 0; l < N; ++l) code[l] = (word[l] >> (BITS * (2 * i + l / 8))) & kMask;
      return CB ? lookupv<N, BITS>(code, levels) : __builtin_convertvector(code, typename Vec<N>::f);
#endif
    }
#if defined(__AVX512F__)
    if constexpr (N == 16 && (BITS == 4 || BITS == 2)) {
      // vpermps reads only an index's low 4 bits, so the codes of the planes above need no mask:
      // a 16-entry table (the grid or the codebook, repeated every 2^BITS entries) in one step
      const __m512 table = CB ? (BITS == 4 ? _mm512_loadu_ps(levels) : _mm512_broadcast_f32x4(_mm_loadu_ps(levels)))
                              : _mm512_cvtepi32_ps(_mm512_and_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                                    _mm512_set1_epi32(kMask)));
      return reinterpret_cast<typename Vec<N>::f>(_mm512_permutexvar_ps(reinterpret_cast<__m512i>(word >> (i * BITS)), table));
    }
#endif
    const typename Vec<N>::i code = BITS == 8 ? word : (word >> (i * BITS)) & kMask;
    return CB ? lookupv<N, BITS>(code, levels) : __builtin_convertvector(code, typename Vec<N>::f);
  }

  // Lanes of the fused loops' channel blocks: kWide (16 on AVX-512) where a plane is whole 16-byte
  // blocks, or a pair of 8-byte 3-bit planes (kPlanePairs), and, for values, a group of channels
  // whole 16-channel blocks; else 8. 16 lanes halve the
  // unpack and FMA instructions per row (the loops are bound by instructions once the rows are
  // prefetched); a value lane still accumulates one channel in the same order, a key score's lanes
  // are summed in another order (a float rounding apart).
  template <int BITS>
  bool wide_scores() const {
    const int P = dim / kPlanesOf<BITS>;
    // 16-lane 3-bit code words are plane pairs (kPlanePairs), so only rows of 8-byte planes (head_dim 64)
    return kWide == 16 && (BITS == 3 ? P == 8 : P % 16 == 0);
  }
  template <int BITS>
  bool wide_values() const { return wide_scores<BITS>() && group % 16 == 0; }

  // Integer-query keys (kvq_ao/format.py): tmp.q8 (and tmp.q8_lo) and tmp.alpha of each head from
  // tmp.qs = q * scale, each step one float32 operation as the format fixes it, so every kernel gets
  // the same integer vector; an int16 query (query_levels 32512) is kept as two int8 digits, hi in
  // q8 and lo in q8_lo (q = 256 hi + lo, lo in [-128, 127]), so the dot products stay byte ones.
  // A head whose qs holds NaN or Inf gets alpha NaN: its scores are NaN, as the reference's.
  void quantize_query(int n_heads, Scratch& tmp) const {
    const float levels = static_cast<float>(query_levels);
    const bool two = query_levels > 127;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    if (dim % 16 == 0) {  // 16 lanes, narrowed to bytes in registers (vpmovsdb)
      for (int h = 0; h < n_heads; ++h) {
        const float* qs = tmp.qs + h * dim;
        __m512 top = _mm512_setzero_ps();
        __mmask16 bad = 0;
        for (int d = 0; d < dim; d += 16) {
          const __m512 x = _mm512_loadu_ps(qs + d);
          top = _mm512_max_ps(top, _mm512_abs_ps(x));
          bad |= _mm512_cmp_ps_mask(_mm512_sub_ps(x, x), _mm512_setzero_ps(), _CMP_NEQ_UQ);  // NaN or Inf
        }
        const float m = _mm512_reduce_max_ps(top);
        int8_t* q8 = tmp.q8 + h * dim;
        int8_t* lo = tmp.q8_lo + h * dim;
        if (bad || m == 0.f) {
          for (int d = 0; d < dim; ++d) q8[d] = 0, lo[d] = 0;
          tmp.alpha[h] = bad ? std::numeric_limits<float>::quiet_NaN() : 0.f;
          continue;
        }
        const __m512 inv = _mm512_set1_ps(levels / m);
        for (int d = 0; d < dim; d += 16) {  // the product, then cvtps2dq's rounding (MXCSR's default: ties to even)
          __m512i qi = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(qs + d), inv));
          if (two) {  // hi = (qi + 128) >> 8 (arithmetic), lo = qi - 256 hi
            const __m512i hi = _mm512_srai_epi32(_mm512_add_epi32(qi, _mm512_set1_epi32(128)), 8);
            _mm_storeu_si128(reinterpret_cast<__m128i*>(lo + d), _mm512_cvtsepi32_epi8(_mm512_sub_epi32(qi, _mm512_slli_epi32(hi, 8))));
            qi = hi;
          }
          _mm_storeu_si128(reinterpret_cast<__m128i*>(q8 + d), _mm512_cvtsepi32_epi8(qi));
        }
        tmp.alpha[h] = m / levels;
      }
      return;
    }
#endif
    for (int h = 0; h < n_heads; ++h) {
      const float* qs = tmp.qs + h * dim;
      int8_t* q8 = tmp.q8 + h * dim;
      int8_t* lo = tmp.q8_lo + h * dim;
      float m = 0.f;
      bool not_finite = false;
      int d0 = 0;
      if (dim % 8 == 0) {  // 8 lanes at a time (a scalar max with NaN checks was most of this path's time)
        v8f top = splat(0.f);
        v8i bad = splat_i(0);
        for (; d0 < dim; d0 += 8) {
          const v8f x = load8(qs + d0);
          const v8f a = x < splat(0.f) ? -x : x;
          top = a > top ? a : top;
          bad |= (x - x) != splat(0.f);  // NaN or Inf
        }
        for (int l = 0; l < 8; ++l) m = top[l] > m ? top[l] : m, not_finite = not_finite || bad[l];
      }
      for (int d = d0; d < dim; ++d) {
        const float a = std::fabs(qs[d]);
        m = a > m ? a : m;
        not_finite = not_finite || !(qs[d] - qs[d] == 0.f);
      }
      if (not_finite || m == 0.f) {
        for (int d = 0; d < dim; ++d) q8[d] = 0, lo[d] = 0;
        tmp.alpha[h] = not_finite ? std::numeric_limits<float>::quiet_NaN() : 0.f;
        continue;
      }
      round_to_digits(qs, levels / m, dim, q8, two ? lo : nullptr);
      tmp.alpha[h] = m / levels;
    }
  }

  // q[d] = qs[d] * inv rounded to the nearest integer, ties to even (as torch.round), d < dim: the
  // product then the rounding, never fused; stored in q8, or with `lo` as two int8 digits (q8 = hi,
  // q = 256 hi + lo). Vector conversions where the CPU has them (x86's cvtps2dq rounds by MXCSR,
  // whose default is ties to even; Arm's fcvtns); a scalar loop (std::nearbyint, a library call per
  // entry) had made the whole int8 path slower than float scores.
  static void round_to_digits(const float* qs, float inv, int dim, int8_t* q8, int8_t* lo) {
    auto put = [&](int d, int32_t qi) {
      if (lo) {
        const int32_t hi = (qi + 128) >> 8;  // arithmetic shift: floor((qi + 128) / 256)
        q8[d] = static_cast<int8_t>(hi), lo[d] = static_cast<int8_t>(qi - hi * 256);
      } else {
        q8[d] = static_cast<int8_t>(qi);
      }
    };
    int d = 0;
#if defined(__AVX__)
    const __m256 s = _mm256_set1_ps(inv);
    for (; d + 8 <= dim; d += 8) {
      alignas(32) int32_t lanes[8];
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(qs + d), s)));
      for (int l = 0; l < 8; ++l) put(d + l, lanes[l]);
    }
#elif defined(__ARM_NEON)
    const float32x4_t s = vdupq_n_f32(inv);
    for (; d + 4 <= dim; d += 4) {
      int32_t lanes[4];
      vst1q_s32(lanes, vcvtnq_s32_f32(vmulq_f32(vld1q_f32(qs + d), s)));
      for (int l = 0; l < 4; ++l) put(d + l, lanes[l]);
    }
#endif
    for (; d < dim; ++d) put(d, static_cast<int32_t>(__builtin_roundevenf(qs[d] * inv)));
  }

  // The codes of a packed row in channel order (planar packing: plane i of word j is channel i * P + j).
  template <int BITS>
  void row_codes(const uint8_t* row, uint8_t* out) const {
    if constexpr (BITS == 8) {
      std::memcpy(out, row, dim);
    } else {
      constexpr int kPlanes = kPlanesOf<BITS>, kMask = (1 << BITS) - 1;
      const int P = dim / kPlanes;
      for (int j = 0; j < P; ++j) {
        int32_t word = row[j];
        if constexpr (BITS == 3) word |= (row[P + j] << 8) | (row[2 * P + j] << 16);
        for (int i = 0; i < kPlanes; ++i) out[i * P + j] = static_cast<uint8_t>((word >> (i * BITS)) & kMask);
      }
    }
  }

  // Calls f(RB) with RB, the packed row's bytes, as a compile-time constant where the integer-query
  // blocks take it: planar rows without padding of 16, 32 or 64 bytes. Otherwise f is not called.
  template <int BITS, typename F>
  void with_row_bytes(F&& f) const {
    const int64_t packed = int64_t{dim} * BITS / 8;
    if (row_bytes != packed) return;
    if (packed == 16) f(std::integral_constant<int, 16>{});
    else if (packed == 32) f(std::integral_constant<int, 32>{});
    else if (packed == 64) f(std::integral_constant<int, 64>{});
  }

  // scores[h * kTile + j] = alpha[h] * (q[h] . codes of token `first + j`), j < count, h < n_heads:
  // the int32 dot products of the integer query with the codes (exact), scaled once; TWO: an int16
  // query's two digits, (hi . codes) * 256 + lo . codes. AVX-512 VNNI takes up to 16 rows of 2- and
  // 4-bit codes at head_dim 64 at a time, AVX2 8; every other shape and CPU the portable loop below
  // (which compilers turn into their dot-product instructions where they have them).
  template <int BITS, bool TWO>
  void int_scores(const Scratch& tmp, int n_heads, int64_t first, int count, float* scores) const {
    const uint8_t* src = reinterpret_cast<const uint8_t*>(codes_p) + first * row_bytes;
    int j = 0;
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    if constexpr (BITS == 4 || BITS == 2)
      with_row_bytes<BITS>([&](auto rb_c) {
        constexpr int RB = decltype(rb_c)::value;
        for (; j < count; j += 16) vnni_scores<BITS, TWO, RB>(tmp, n_heads, src + j * row_bytes, std::min(16, count - j), scores + j);
      });
#elif defined(__AVX2__)
    if constexpr (BITS == 4 || BITS == 2)
      with_row_bytes<BITS>([&](auto rb_c) {
        constexpr int RB = decltype(rb_c)::value;
        for (; j + 8 <= count; j += 8) avx2_scores<BITS, TWO, RB>(tmp, n_heads, src + j * row_bytes, scores + j, kTile);
        if (j < count) {  // the last rows, zero-padded to a block of 8
          alignas(32) uint8_t rows[8 * RB] = {};
          alignas(32) float part[kMaxGroupHeads * 8];
          const int n = count - j;
          std::memcpy(rows, src + j * row_bytes, n * row_bytes);
          avx2_scores<BITS, TWO, RB>(tmp, n_heads, rows, part, 8);
          for (int h = 0; h < n_heads; ++h)
            for (int r = 0; r < n; ++r) scores[h * kTile + j + r] = part[h * 8 + r];
          j = count;
        }
      });
#endif
    // codes below 2^7 as signed bytes: a signed 8 x 8-bit dot product (Arm's sdot; x86 widens to pmaddwd)
    typedef std::conditional_t<BITS == 8, uint8_t, int8_t> Code;
    alignas(64) uint8_t raw[kMaxHeadDim];
    const Code* codes = reinterpret_cast<const Code*>(raw);
    for (; j < count; ++j) {
      prefetch_ahead(src, j);
      row_codes<BITS>(src + j * row_bytes, raw);
      for (int h = 0; h < n_heads; ++h) {
        const int8_t* q8 = tmp.q8 + h * dim;
        int32_t acc = 0;
        for (int d = 0; d < dim; ++d) acc += static_cast<int32_t>(codes[d]) * static_cast<int32_t>(q8[d]);
        if constexpr (TWO) {
          const int8_t* lo = tmp.q8_lo + h * dim;
          int32_t acc_lo = 0;
          for (int d = 0; d < dim; ++d) acc_lo += static_cast<int32_t>(codes[d]) * static_cast<int32_t>(lo[d]);
          acc = acc * 256 + acc_lo;
        }
        scores[h * kTile + j] = tmp.alpha[h] * static_cast<float>(acc);
      }
    }
  }

#if defined(__AVX2__) && !(defined(__AVX512VNNI__) && defined(__AVX512BW__))
  // 8 rows of RB bytes of 2- or 4-bit codes from `rows` (scores h at out + h * stride), as
  // vnni_scores lays them out: vpmaddubsw multiplies unsigned codes by int8 query entries and adds
  // pairs into int16 (at most 2 x 15 x 127 a pair, 4 such sums a lane: no saturation), vpmaddwd
  // widens to int32. A 32-byte load is two 16-byte rows (2 bits at head_dim 64: plane i channels 16i
  // to 16i + 15), one 32-byte row (4 bits at 64: low nibbles channels 0-31, high 32-63), or half of
  // a 64-byte row (4 bits at 128), whose halves' sums are added before the sums across lanes.
  // TWO: an int16 query's digits, each through the same products (a lo digit in [-128, 127] keeps
  // the pair sums below 2^15), combined in int32 as hi * 256 + lo before the sums across lanes.
  template <int BITS, bool TWO, int RB>
  void avx2_scores(const Scratch& tmp, int n_heads, const uint8_t* rows, float* out, int stride) const {
    static_assert(RB == 16 || RB == 32 || RB == 64, "rows of 16, 32 or 64 bytes");
    // a 32-byte load is two 16-byte rows, one 32-byte row, or half a 64-byte one
    constexpr int kRowsPerLoad = RB == 16 ? 2 : 1, kHalves = RB == 64 ? 2 : 1, kRegs = 8 / kRowsPerLoad;
    constexpr int kLoads = kRegs * kHalves, kPlanes = 8 / BITS;
    const __m256i mask = _mm256_set1_epi8(static_cast<char>((1 << BITS) - 1)), ones = _mm256_set1_epi16(1);
    for (int r = 0; r < 8; ++r) prefetch_ahead(rows, r);
    __m256i plane[kLoads][kPlanes];
    for (int l = 0; l < kLoads; ++l) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rows + l * 32));
      for (int i = 0; i < kPlanes; ++i) plane[l][i] = _mm256_and_si256(_mm256_srli_epi16(x, i * BITS), mask);
    }
    // the query channels plane i of load half k meets: RB i + 32 k onwards (16-byte rows: repeated twice)
    auto query = [&](const int8_t* q8, __m256i (&q)[kHalves][kPlanes]) {
      for (int k = 0; k < kHalves; ++k)
        for (int i = 0; i < kPlanes; ++i) {
          if constexpr (RB == 16) q[k][i] = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q8 + 16 * i)));
          else q[k][i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8 + RB * i + 32 * k));
        }
    };
    auto dots = [&](int reg, const __m256i (&q)[kHalves][kPlanes]) {  // int32 lanes of register `reg`'s rows, halves summed
      __m256i sum = _mm256_setzero_si256();
      for (int k = 0; k < kHalves; ++k) {
        const int l = reg * kHalves + k;
        __m256i p = _mm256_maddubs_epi16(plane[l][0], q[k][0]);
        for (int i = 1; i < kPlanes; ++i) p = _mm256_add_epi16(p, _mm256_maddubs_epi16(plane[l][i], q[k][i]));
        sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, ones));
      }
      return sum;
    };
    for (int h = 0; h < n_heads; ++h) {
      __m256i q[kHalves][kPlanes], q_lo[kHalves][kPlanes];
      query(tmp.q8 + h * dim, q);
      if constexpr (TWO) query(tmp.q8_lo + h * dim, q_lo);
      __m256i acc[kRegs];
      for (int r = 0; r < kRegs; ++r) {
        acc[r] = dots(r, q);
        if constexpr (TWO) acc[r] = _mm256_add_epi32(_mm256_slli_epi32(acc[r], 8), dots(r, q_lo));
      }
      __m256i sums;
      if constexpr (kRowsPerLoad == 1) {  // 8 registers of one row x 8 lanes: the float hsum8x8's transposing sums
        const __m256i a01 = _mm256_hadd_epi32(acc[0], acc[1]), a23 = _mm256_hadd_epi32(acc[2], acc[3]);
        const __m256i a45 = _mm256_hadd_epi32(acc[4], acc[5]), a67 = _mm256_hadd_epi32(acc[6], acc[7]);
        const __m256i b0 = _mm256_hadd_epi32(a01, a23), b1 = _mm256_hadd_epi32(a45, a67);
        sums = _mm256_add_epi32(_mm256_permute2x128_si256(b0, b1, 0x20), _mm256_permute2x128_si256(b0, b1, 0x31));
      } else {  // 4 registers of 2 rows (one a half) x 4 lanes -> rows 0 2 4 6 | 1 3 5 7, then in order
        const __m256i h0 = _mm256_hadd_epi32(acc[0], acc[1]), h1 = _mm256_hadd_epi32(acc[2], acc[3]);
        sums = _mm256_permutevar8x32_epi32(_mm256_hadd_epi32(h0, h1), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
      }
      _mm256_storeu_ps(out + h * stride, _mm256_mul_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(tmp.alpha[h])));
    }
  }
#endif

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
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
  static __m512i reduce_pair(__m512i x, __m512i y, const PairIndices& ix) {
    return _mm512_add_epi32(_mm512_permutex2var_epi32(x, ix.lo, y), _mm512_permutex2var_epi32(x, ix.hi, y));
  }

  // 16 rows of RB bytes of 2- or 4-bit codes (head_dim 64 or 128; 2 bits also 256) from `rows`:
  // vpdpbusd multiplies 64 unsigned codes by 64 int8 query entries into 16 int32 lanes. A 64-byte
  // load is 64 / RB rows; plane i of a row (its bytes shifted by i * BITS) holds channels RB i to
  // RB i + RB - 1, so it meets those query entries, repeated for every row of the load (4 bits at
  // head_dim 64: two rows, low nibbles channels 0-31 and high 32-63; at 128 one row, 0-63 and 64-127).
  // Permute-and-add levels then reduce each row's 16 / (64 / RB) lanes to one register of 16 scores.
  // n < 16 rows: the bytes past them are not read (masked loads) and their scores not written.
  // TWO: an int16 query's digits, each through the same vpdpbusd, combined in int32 as hi * 256 + lo
  // before the reduction.
  template <int BITS, bool TWO, int RB>
  void vnni_scores(const Scratch& tmp, int n_heads, const uint8_t* rows, int n, float* scores) const {
    static_assert(RB == 16 || RB == 32 || RB == 64, "rows of 16, 32 or 64 bytes");
    constexpr int kRowsPerLoad = 64 / RB, kLoads = 16 / kRowsPerLoad, kPlanes = 8 / BITS;
    static const PairIndices w16(16), w8(8), w4(4), w2(2);
    const __m512i mask = _mm512_set1_epi8(static_cast<char>((1 << BITS) - 1));
    for (int r = 0; r < n; ++r) prefetch_ahead(rows, r);
    const int64_t bytes = int64_t{n} * row_bytes;
    __m512i plane[kLoads][kPlanes];
    for (int l = 0; l < kLoads; ++l) {
      const int64_t left = bytes - l * 64;
      const __mmask64 in = left >= 64 ? ~__mmask64{0} : left <= 0 ? __mmask64{0} : (__mmask64{1} << left) - 1;
      const __m512i x = _mm512_maskz_loadu_epi8(in, rows + l * 64);
      for (int i = 0; i < kPlanes; ++i) plane[l][i] = _mm512_and_si512(_mm512_srli_epi16(x, i * BITS), mask);
    }
    auto query = [&](const int8_t* q8, __m512i (&q)[kPlanes]) {  // the query channels each plane meets, repeated for every row of a load
      for (int i = 0; i < kPlanes; ++i) {
        if constexpr (RB == 64) q[i] = _mm512_loadu_si512(q8 + 64 * i);
        else if constexpr (RB == 32) q[i] = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q8 + 32 * i)));
        else q[i] = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q8 + 16 * i)));
      }
    };
    for (int h = 0; h < n_heads; ++h) {
      __m512i q[kPlanes], q_lo[kPlanes];
      query(tmp.q8 + h * dim, q);
      if constexpr (TWO) query(tmp.q8_lo + h * dim, q_lo);
      __m512i acc[kLoads];
      for (int l = 0; l < kLoads; ++l) {
        acc[l] = _mm512_setzero_si512();
        for (int i = 0; i < kPlanes; ++i) acc[l] = _mm512_dpbusd_epi32(acc[l], plane[l][i], q[i]);
        if constexpr (TWO) {
          __m512i lo = _mm512_setzero_si512();
          for (int i = 0; i < kPlanes; ++i) lo = _mm512_dpbusd_epi32(lo, plane[l][i], q_lo[i]);
          acc[l] = _mm512_add_epi32(_mm512_slli_epi32(acc[l], 8), lo);
        }
      }
      // `live` registers of 16 / live rows x live lanes a row: each level pairs them, halving both
      for (int live = kLoads; live > 1; live /= 2) {
        const PairIndices& ix = live == 16 ? w16 : live == 8 ? w8 : live == 4 ? w4 : w2;
        for (int p = 0; p < live / 2; ++p) acc[p] = reduce_pair(acc[2 * p], acc[2 * p + 1], ix);
      }
      const __m512i sums = acc[0];
      _mm512_mask_storeu_ps(scores + h * kTile, static_cast<__mmask16>((1u << n) - 1),
                            _mm512_mul_ps(_mm512_cvtepi32_ps(sums), _mm512_set1_ps(tmp.alpha[h])));
    }
  }
#endif

  // scores[h * kTile + j] = qs[h] . levels of token `first + j`, j < count, h < NH (qs rows `dim`
  // apart): each row's codes unpacked in registers and consumed there, no level tile written.
  // fused_scores for query heads [0, n_heads) (qs rows `dim` apart, scores rows kTile apart), in
  // passes of up to 4 heads (2 x 4 accumulators), at this operand's width and level kind.
  void fused_scores_of_heads(const float* qs, int n_heads, int64_t first, int count, float* scores) const {
    with_format([&](auto bits_c, auto cb_c) {
      constexpr int B = decltype(bits_c)::value;
      constexpr bool CB = decltype(cb_c)::value;
      for (int h = 0; h < n_heads;) {
        const float* qh = qs + h * dim;
        float* sh = scores + h * kTile;
        const int left = n_heads - h;
        if (left >= 4) fused_scores<B, CB, 4>(qh, first, count, sh), h += 4;
        else if (left >= 3) fused_scores<B, CB, 3>(qh, first, count, sh), h += 3;
        else if (left >= 2) fused_scores<B, CB, 2>(qh, first, count, sh), h += 2;
        else fused_scores<B, CB, 1>(qh, first, count, sh), h += 1;
      }
    });
  }

  template <int BITS, bool CB, int NH>
  void fused_scores(const float* qs, int64_t first, int count, float* scores) const {
    if (wide_scores<BITS>()) fused_scores_n<BITS, CB, NH, kWide>(qs, first, count, scores);
    else fused_scores_n<BITS, CB, NH, 8>(qs, first, count, scores);
  }
  template <int BITS, bool CB, int NH, int N>
  void fused_scores_n(const float* qs, int64_t first, int count, float* scores) const {
    const uint8_t* src = reinterpret_cast<const uint8_t*>(codes_p) + first * row_bytes;
    typename Vec<N>::f part[NH][8];
    int start = 0;
#if defined(__AVX512VBMI__)
    if constexpr (BITS == 2 && N == 16)
      if (dim == 64)
        for (; start + 16 <= count; start += 16) {
          for (int j = start; j < start + 16; ++j) prefetch_ahead(src, j);
          token_lane_scores<CB, NH>(qs, src + start * row_bytes, scores + start);
        }
#endif
    for (int j0 = start; j0 < count; j0 += 8) {
      const int n = std::min(8, count - j0);
      for (int j = j0; j < j0 + n; ++j) prefetch_ahead(src, j);
      int jj = 0;
      if constexpr (N == 16) for (; jj + 4 <= n; jj += 4) fused_row_block<BITS, CB, NH, 4, N>(qs, src + (j0 + jj) * row_bytes, part, jj);
      for (; jj + 2 <= n; jj += 2) fused_row_block<BITS, CB, NH, 2, N>(qs, src + (j0 + jj) * row_bytes, part, jj);
      if (jj < n) fused_row_block<BITS, CB, NH, 1, N>(qs, src + (j0 + jj) * row_bytes, part, jj);
      for (int h = 0; h < NH; ++h) {
        if (n == 8) hsum8x8(part[h], scores + h * kTile + j0);
        else for (int jj = 0; jj < n; ++jj) scores[h * kTile + j0 + jj] = hsum(fold16(part[h][jj]));
      }
    }
  }

#if defined(__AVX512VBMI__)
  // scores[h * kTile + t] = qs[h] . levels of row t, t < 16, h < NH, for 2-bit rows of head_dim 64
  // (16 bytes: byte j holds channels j, 16 + j, 32 + j, 48 + j), with a lane per token instead of
  // per channel: the 16 rows' bytes are transposed by byte permutes (vpermt2b) so that each byte
  // column is one register of 16 tokens, and every channel is one broadcast FMA per head. No
  // horizontal sums (with a lane per channel, a fifth of the row loop's instructions summed lanes).
  // Each lane sums its channels in plane order (a float rounding apart from the channel-lane sums).
  template <bool CB, int NH>
  void token_lane_scores(const float* qs, const uint8_t* rows, float* scores) const {
    __m512 acc[NH][4];  // one sum per head and plane, so no FMA waits on the last
    for (int h = 0; h < NH; ++h)
      for (int i = 0; i < 4; ++i) acc[h][i] = _mm512_setzero_ps();
    auto column = [&](const __m512i cols, auto m_c, int j) {  // byte column j = lane m of cols
      constexpr int m = decltype(m_c)::value;
      const __m512i word = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(cols, m));
      for (int i = 0; i < 4; ++i) {
        const __m512 level = reinterpret_cast<__m512>(plane_levels<2, CB, 16>(reinterpret_cast<Vec<16>::i>(word), i));
        for (int h = 0; h < NH; ++h) acc[h][i] = _mm512_fmadd_ps(_mm512_set1_ps(qs[h * dim + 16 * i + j]), level, acc[h][i]);
      }
    };
    __m512i r[4];
    lane_rows2(rows, 16, r);
    for (int k = 0; k < 4; ++k) {
      const __m512i cols = lane_columns2(r, k);
      column(cols, std::integral_constant<int, 0>{}, 4 * k);
      column(cols, std::integral_constant<int, 1>{}, 4 * k + 1);
      column(cols, std::integral_constant<int, 2>{}, 4 * k + 2);
      column(cols, std::integral_constant<int, 3>{}, 4 * k + 3);
    }
    for (int h = 0; h < NH; ++h)
      _mm512_storeu_ps(scores + h * kTile, _mm512_add_ps(_mm512_add_ps(acc[h][0], acc[h][1]), _mm512_add_ps(acc[h][2], acc[h][3])));
  }
#endif

  // part[h][jj + r] = lane-wise products of q row h with the levels of row r, r < ROWS (rows
  // `row_bytes` apart from `rows`). The loop is bound by loads, so each q vector is loaded once for
  // all ROWS rows; a row alone alternates two accumulators by plane so its FMAs do not wait on each
  // other. N lanes a channel block (wide_scores).
  template <int BITS, bool CB, int NH, int ROWS, int N = 8>
  void fused_row_block(const float* qs, const uint8_t* rows, typename Vec<N>::f (&part)[NH][8], int jj) const {
    typedef typename Vec<N>::f vf;
    constexpr int kPlanes = kBlocksOf<BITS, N>, kChains = ROWS == 1 ? 2 : 1;
    const int P = dim / kPlanes;
    vf s[kChains][ROWS][NH];
    for (int c = 0; c < kChains; ++c)
      for (int r = 0; r < ROWS; ++r)
        for (int h = 0; h < NH; ++h) s[c][r][h] = splatv<N>(0.f);
    for (int jb = 0; jb < P; jb += N) {
      typename Vec<N>::i word[ROWS];
      for (int r = 0; r < ROWS; ++r) word[r] = block_words<BITS, N>(rows + r * row_bytes, jb, P);
      for (int i = 0; i < kPlanes; ++i) {
        vf level[ROWS];
        for (int r = 0; r < ROWS; ++r) level[r] = plane_levels<BITS, CB, N>(word[r], i);
        for (int h = 0; h < NH; ++h) {
          const vf qv = loadv<N>(qs + h * dim + i * P + jb);
          for (int r = 0; r < ROWS; ++r) s[i % kChains][r][h] += qv * level[r];
        }
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int r = 0; r < ROWS; ++r) {
        if constexpr (kChains == 2) part[h][jj + r] = s[0][r][h] + s[1][r][h];
        else part[h][jj + r] = s[0][r][h];
      }
  }

  // Pre-RoPE keys in per-channel groups as rotated float rows: out[j * kRow + c] = rotate(sc * level_j
  // + zc, with token j's NS exact outliers in place)[c] for the tokens `first + j`, j < count, each
  // row unpacked, scaled, patched and rotated at its token's angles (cos/sin rows dim/2 apart, already
  // times rope_scale) in registers and stored once (before: a tile written, patched, then read and
  // rewritten by the rotation). Channel pairs (c, c + dim/2) come from planes i and i + planes/2 of
  // the same code word (8-bit codes: two words). Needs rope_fusable().
  template <int BITS, bool CB, int NS, int N = 8>
  void rope_rows(int64_t first, int count, const float* cos_t, const float* sin_t, const float* sc, const float* zc,
                 const float* out_vals, float* out) const {
    typedef typename Vec<N>::f vf;
    typedef typename Vec<N>::i vi;
    constexpr int kPlanes = kBlocksOf<BITS, N>;
    const int P = dim / kPlanes, half = dim / 2;
    const uint8_t* src = reinterpret_cast<const uint8_t*>(codes_p) + first * row_bytes;
    const uint8_t* idx = NS ? out_idx_p + first * NS : nullptr;
    vi lanes;
    for (int l = 0; l < N; ++l) lanes[l] = l;
    for (int j = 0; j < count; ++j) {
      prefetch_ahead(src, j);
      const uint8_t* r = src + j * row_bytes;
      const float* cr = cos_t + j * half;
      const float* sr = sin_t + j * half;
      float* y = out + j * kRow;
      vi at[NS + 1];  // the row's outlier channels (>= dim: none) and exact values, broadcast
      vf exact[NS + 1];
      for (int o = 0; o < NS; ++o) at[o] = static_cast<int32_t>(idx[j * NS + o]) - vi{}, exact[o] = splatv<N>(out_vals[j * NS + o]);
      auto pair = [&](vf l1, vf l2, int c) {  // channels [c, c + N) and their partners [c + half, c + half + N)
        vf x1 = l1 * loadv<N>(sc + c) + loadv<N>(zc + c), x2 = l2 * loadv<N>(sc + c + half) + loadv<N>(zc + c + half);
        for (int o = 0; o < NS; ++o) {  // an exact outlier replaces its channel's dense value
          x1 = at[o] == lanes + c ? exact[o] : x1;
          x2 = at[o] == lanes + (c + half) ? exact[o] : x2;
        }
        const vf cs = loadv<N>(cr + c), sn = loadv<N>(sr + c);
        storev<N>(y + c, x1 * cs - x2 * sn);
        storev<N>(y + c + half, x2 * cs + x1 * sn);
      };
      if constexpr (BITS == 8) {
        for (int c = 0; c < half; c += N)
          pair(plane_levels<BITS, CB, N>(bytesv<N>(r + c), 0), plane_levels<BITS, CB, N>(bytesv<N>(r + c + half), 0), c);
      } else {
        for (int jb = 0; jb < P; jb += N) {
          const vi word = block_words<BITS, N>(r, jb, P);
          for (int i = 0; i < kPlanes / 2; ++i)
            pair(plane_levels<BITS, CB, N>(word, i), plane_levels<BITS, CB, N>(word, i + kPlanes / 2), i * P + jb);
        }
      }
    }
  }

#if defined(__AVX512VBMI__)
  // Pre-RoPE 2- or 3-bit keys of head_dim 64 in per-channel groups, scored with a lane a token:
  // scores[h * kTile + t] = qs[h] . rotate_t(scale * level_t + zero, token t's NS exact outliers in
  // place) for t < n <= 16, h < NH (qs rows `dim` apart). Channel c and its RoPE partner c + 32 lie
  // in one code word: 3-bit rows are 24 bytes, word j (bytes j, 8 + j, 16 + j) holding channel
  // 8p + j in bits 3p..3p + 2, so the pair is planes p and p + 4; 2-bit rows are 16 bytes, byte j
  // holding channel 16p + j in bits 2p..2p + 1, so planes p and p + 2. The 16 rows are transposed
  // into registers of one word for 16 tokens (lane_words3, lane_columns2); each channel pair is then
  // unpacked and scaled (one permute of the channel's table of scaled levels, Scratch::lane_table),
  // patched and rotated for 16 tokens at once, and consumed by one broadcast FMA per head and
  // channel: no float row stored and read back, no lanes summed across (rope_rows and score_rows
  // took over half of kvquant-3-1pct's time). Each lane sums its channels in another order than
  // score_rows (a float rounding apart). cos/sin with a lane a token (AngleRuns::fill_lanes), pair
  // i's row at i * kTile from this block's first token; `tables` the scale row's level tables;
  // `idx`/`exact` the block's outlier slots (NS a token); lanes >= n are read masked, computed and
  // not stored.
  template <int BITS, int NS, int NH>
  void rope_lane_scores(const float* qs, const uint8_t* rows, int n, const uint8_t* idx, const float* exact,
                        const float* cos_l, const float* sin_l, const float* tables, float* scores) const {
    static_assert(BITS == 2 || BITS == 3, "rope_lane_scores reads 2- and 3-bit rows of head_dim 64");
    const __mmask16 live = static_cast<__mmask16>(n >= 16 ? 0xFFFF : (1u << n) - 1);
    __m512i at[NS + 1];  // outlier channels (>= dim: an empty slot) and exact values, a lane a token
    __m512 value[NS + 1];
    if constexpr (NS == 1) {
      at[0] = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(live, idx));
      value[0] = _mm512_maskz_loadu_ps(live, exact);
    } else if constexpr (NS == 2) {
      const __m512i both = _mm512_cvtepu8_epi16(_mm256_maskz_loadu_epi8(n >= 16 ? 0xFFFFFFFFu : (1u << 2 * n) - 1, idx));
      at[0] = _mm512_and_si512(both, _mm512_set1_epi32(0xFFFF)), at[1] = _mm512_srli_epi32(both, 16);
      const int lo_n = std::min(2 * n, 16), hi_n = std::max(2 * n - 16, 0);
      const __m512 e0 = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << lo_n) - 1), exact);
      const __m512 e1 = _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << hi_n) - 1), exact + 16);
      const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
      value[0] = _mm512_permutex2var_ps(e0, even, e1);
      value[1] = _mm512_permutex2var_ps(e0, _mm512_add_epi32(even, _mm512_set1_epi32(1)), e1);
    }
    struct Channels {
      int32_t c[64] = {};
      constexpr Channels() {
        for (int ch = 0; ch < 64; ++ch) c[ch] = ch;
      }
    };
    static constexpr Channels channels{};
    // The channel numbers the outlier slots are compared with, through a pointer the compiler cannot
    // see into: each compare then broadcasts its number from memory (a load), where GCC otherwise
    // moves the constant into a register and broadcasts it from there (a vector op of its own).
    const int32_t* channel = channels.c;
    __asm__("" : "+r"(channel));
    __m512 acc[NH][2];  // per head, the first and second channel of each pair: two FMA chains
    for (int h = 0; h < NH; ++h) acc[h][0] = acc[h][1] = _mm512_setzero_ps();
    // channels c1 < 32 and c1 + 32, at bits `s1` and `s2` of each lane of `word`
    auto pair = [&](__m512i word, int s1, int s2, int c1) {
      const int c2 = c1 + 32;
      // vpermps reads an index's low 4 bits: the tables repeat the levels, so the next code's bits
      // need no mask. An exact outlier replaces its channel's dense value: the first slot's value is
      // where the permute writes nothing (one compare a channel), a second slot's blended after.
      const __m512i i1 = _mm512_srli_epi32(word, s1), i2 = _mm512_srli_epi32(word, s2);
      const __m512 t1 = _mm512_load_ps(tables + 16 * c1), t2 = _mm512_load_ps(tables + 16 * c2);
      __m512 x1, x2;
      if constexpr (NS == 0) {
        x1 = _mm512_permutexvar_ps(i1, t1), x2 = _mm512_permutexvar_ps(i2, t2);
      } else {
        const __m512i n1 = _mm512_set1_epi32(channel[c1]), n2 = _mm512_set1_epi32(channel[c2]);
        x1 = _mm512_mask_permutexvar_ps(value[0], _mm512_cmpneq_epi32_mask(at[0], n1), i1, t1);
        x2 = _mm512_mask_permutexvar_ps(value[0], _mm512_cmpneq_epi32_mask(at[0], n2), i2, t2);
        for (int o = 1; o < NS; ++o) {
          x1 = _mm512_mask_mov_ps(x1, _mm512_cmpeq_epi32_mask(at[o], n1), value[o]);
          x2 = _mm512_mask_mov_ps(x2, _mm512_cmpeq_epi32_mask(at[o], n2), value[o]);
        }
      }
      const __m512 cs = _mm512_loadu_ps(cos_l + c1 * kTile), sn = _mm512_loadu_ps(sin_l + c1 * kTile);
      const __m512 r1 = _mm512_fmsub_ps(x1, cs, _mm512_mul_ps(x2, sn)), r2 = _mm512_fmadd_ps(x2, cs, _mm512_mul_ps(x1, sn));
      for (int h = 0; h < NH; ++h) {
        acc[h][0] = _mm512_fmadd_ps(_mm512_set1_ps(qs[h * dim + c1]), r1, acc[h][0]);
        acc[h][1] = _mm512_fmadd_ps(_mm512_set1_ps(qs[h * dim + c2]), r2, acc[h][1]);
      }
    };
    if constexpr (BITS == 3) {
      __m512i w[8];
      lane_words3(rows, n, w);
      // unrolled: channel numbers, shifts and table offsets become constants
#pragma GCC unroll 8
      for (int j = 0; j < 8; ++j)
#pragma GCC unroll 4
        for (int p = 0; p < 4; ++p) pair(w[j], 3 * p, 3 * p + 12, 8 * p + j);
    } else {
      __m512i r[4];
      lane_rows2(rows, n, r);
#pragma GCC unroll 4
      for (int k = 0; k < 4; ++k) {  // byte columns 4k .. 4k + 3
        const __m512i cols = lane_columns2(r, k);
        auto column = [&](auto m_c) {  // byte column 4k + m (the extract takes an immediate)
          constexpr int m = decltype(m_c)::value;
          const __m512i word = _mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(cols, m));
#pragma GCC unroll 2
          for (int p = 0; p < 2; ++p) pair(word, 2 * p, 2 * p + 4, 16 * p + 4 * k + m);
        };
        column(std::integral_constant<int, 0>{}), column(std::integral_constant<int, 1>{});
        column(std::integral_constant<int, 2>{}), column(std::integral_constant<int, 3>{});
      }
    }
    for (int h = 0; h < NH; ++h) _mm512_mask_storeu_ps(scores + h * kTile, live, _mm512_add_ps(acc[h][0], acc[h][1]));
  }

  // w[j] lane t = the 24-bit word j of 3-bit row t (t < n; lanes >= n read nothing): a byte permute
  // puts rows m and m + 8 into one register as words, then three exchanges of a register bit with a
  // lane bit (two vpermt2d per register pair) turn register m lane 8u + j into register j lane 8u + m.
  static void lane_words3(const uint8_t* rows, int n, __m512i* w) {
    struct Tables {
      alignas(64) uint8_t spread[64] = {};  // byte 4 (8 u + j) + k <- byte 32 u + 8 k + j
      alignas(64) int32_t low[3][16] = {}, high[3][16] = {};
      constexpr Tables() {
        for (int u = 0; u < 2; ++u)
          for (int j = 0; j < 8; ++j)
            for (int k = 0; k < 3; ++k) spread[4 * (8 * u + j) + k] = static_cast<uint8_t>(32 * u + 8 * k + j);
        for (int L = 0; L < 3; ++L)
          for (int l = 0; l < 16; ++l) {
            const int from_high = ((l >> L) & 1) << 4;  // vpermt2d: bit 4 picks the second register
            low[L][l] = (l & ~(1 << L)) | from_high;
            high[L][l] = (l | (1 << L)) | from_high;
          }
      }
    };
    static constexpr Tables tables{};
    const __m512i spread = _mm512_load_si512(tables.spread);
    for (int m = 0; m < 8; ++m) {
      const __m256i a = _mm256_maskz_loadu_epi8(m < n ? 0xFFFFFFu : 0u, rows + 24 * m);
      const __m256i b = _mm256_maskz_loadu_epi8(m + 8 < n ? 0xFFFFFFu : 0u, rows + 24 * (m + 8));
      w[m] = _mm512_maskz_permutexvar_epi8(0x7777777777777777ull, spread, _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1));
    }
    for (int L = 0; L < 3; ++L) {
      const __m512i lo = _mm512_load_si512(tables.low[L]), hi = _mm512_load_si512(tables.high[L]);
      for (int m = 0; m < 8; ++m)
        if (!(m >> L & 1)) {
          const __m512i x = w[m], y = w[m | 1 << L];
          w[m] = _mm512_permutex2var_epi32(x, lo, y);
          w[m | 1 << L] = _mm512_permutex2var_epi32(x, hi, y);
        }
    }
  }

  // The 256 bytes of 16 rows of 16 bytes (2-bit codes at head_dim 64) in four registers, rows >= n
  // read as zeros (nothing past them is touched).
  static void lane_rows2(const uint8_t* rows, int n, __m512i (&r)[4]) {
    for (int i = 0; i < 4; ++i) {  // rows 4i .. 4i + 3, those < n
      const int live = std::clamp(n - 4 * i, 0, 4);
      r[i] = _mm512_maskz_loadu_epi8(live == 4 ? ~0ull : (1ull << (16 * live)) - 1, rows + 64 * i);
    }
  }
  // Byte columns 4k .. 4k + 3 of those rows (lane_rows2): byte 16 m + t <- row t's byte 4k + m, by
  // byte permutes (vpermt2b), so that each byte column is one register of 16 tokens.
  static __m512i lane_columns2(const __m512i (&r)[4], int k) {
    struct Columns {
      alignas(64) uint8_t idx[4][64] = {};
      constexpr Columns() {
        for (int kk = 0; kk < 4; ++kk)
          for (int m = 0; m < 4; ++m)
            for (int t = 0; t < 16; ++t) idx[kk][16 * m + t] = static_cast<uint8_t>((t % 8 < 4 ? 0 : 64) + 16 * (t % 4) + 4 * kk + m);
      }
    };
    static constexpr Columns columns{};  // built at compile time: no guard on the hot path
    const __m512i idx = _mm512_load_si512(columns.idx[k]);
    return _mm512_mask_blend_epi8(0xFF00FF00FF00FF00ull, _mm512_permutex2var_epi8(r[0], idx, r[1]),
                                  _mm512_permutex2var_epi8(r[2], idx, r[3]));  // tokens 0-7 | 8-15
  }
#endif

  // Pre-RoPE keys that rope_lane_tile scores (this build has AVX-512 VBMI): 2- and 3-bit codes at
  // head_dim 64 on the fused RoPE path.
  bool rope_lanes() const {
#if defined(__AVX512VBMI__)
    return rope_fusable() && (bits == 2 || bits == 3) && dim == 64;
#else
    return false;
#endif
  }

  // rope_rows in 16 lanes where the blocks (wide_scores) and, for 8-bit codes, half a row are whole
  // 16-channel blocks.
  template <int BITS>
  bool wide_rope() const { return wide_scores<BITS>() && (BITS != 8 || (dim / 2) % 16 == 0); }

  // rope_rows's layout needs: whole 8-channel blocks in every plane, and an even plane count
  // (or 8-bit codes with dim/2 a multiple of 8), so each block's RoPE partner is a block too; and
  // few outlier slots a vector (each costs two compares and blends per block).
  bool rope_fusable() const { return fusable() && dim % 16 == 0 && n_out <= kMaxRopeSlots; }

  // acc[h][c] = acc[h][c] * correction[h] + zsum[h][c / group] + sum_j w[c / group][h][j] * level_j[c]
  // for h < NH, the tokens `first + j`, j < count (w rows [groups][kPass][kTile], zsum rows kZsum
  // apart: the zeros' share, added with the correction, not in a pass of its own): the accumulators of a block of
  // channels stay in registers over the tile while each row's codes are unpacked once for all NH heads.
  // N lanes a channel block (wide_values): each lane still one channel, its sum in the same order.
  // The heads' weights of a group lie kTile apart, so a plane's weights are one pointer and fixed
  // offsets (a pointer per head and plane spilled: a fifth of the loop's samples were reloads).
  template <int BITS, bool CB, int NH, int N = 8>
  void fused_accumulate(float* const* acc, const float* correction, const float* w, const float* zsum, int64_t first, int count) const {
    typedef typename Vec<N>::f vf;
    constexpr int kPlanes = kBlocksOf<BITS, N>;
    const int P = dim / kPlanes;
    const uint8_t* src = reinterpret_cast<const uint8_t*>(codes_p) + first * row_bytes;
    constexpr int kSweep = std::min(sweep_planes<BITS>(), kPlanes);
    for (int jb = 0; jb < P; jb += N)
      for (int p0 = 0; p0 < kPlanes; p0 += kSweep) {  // planes [p0, p0 + kSweep) of word block jb
        vf a[NH][kSweep];
        const float* wr[kSweep];
        for (int i = 0; i < kSweep; ++i) {
          const int c = (p0 + i) * P + jb;
          wr[i] = w + c / group * kPass * kTile;
          for (int h = 0; h < NH; ++h)
            a[h][i] = loadv<N>(acc[h] + c) * splatv<N>(correction[h]) + splatv<N>(zsum[h * kZsum + c / group]);
        }
        for (int j = 0; j < count; ++j) {
          if (jb == 0 && p0 == 0) prefetch_ahead(src, j);  // the first sweep over the rows
          const typename Vec<N>::i word = block_words<BITS, N>(src + j * row_bytes, jb, P);
          for (int i = 0; i < kSweep; ++i) {
            const vf level = plane_levels<BITS, CB, N>(word, p0 + i);
            for (int h = 0; h < NH; ++h) a[h][i] += splatv<N>(wr[i][h * kTile + j]) * level;
          }
        }
        for (int h = 0; h < NH; ++h)
          for (int i = 0; i < kSweep; ++i) storev<N>(acc[h] + (p0 + i) * P + jb, a[h][i]);
      }
  }

  // The values of query heads [0, n_heads) over one tile, per-token groups, codes straight from the
  // cache: what direct_accumulate does for one head, for all heads of a kv head at once.
  // probs[h * kTile + j], correction[h]; heads whose best_of is -inf saw nothing and are skipped.
  void fused_values(Partial* parts, const float* correction, const float* probs, const float* best_of, int n_heads, int count,
                    const Scratch& tmp, int64_t bh, int64_t T, int64_t t0) const;

 private:
  inline float level1(int code) const { return codebook ? levels[code] : static_cast<float>(code); }

  // Calls f with the row unpacker for this operand's width and level kind (both compile-time, so the
  // inner loops carry no branches).
  template <typename F>
  void dispatch(F&& f) const {
    auto with = [&](auto bits_c) {
      constexpr int B = decltype(bits_c)::value;
      if (codebook) f([this](auto... a) { unpack<B, true>(a...); });
      else f([this](auto... a) { unpack<B, false>(a...); });
    };
    switch (bits) {
      case 2: with(std::integral_constant<int, 2>{}); break;
      case 3: with(std::integral_constant<int, 3>{}); break;
      case 4: with(std::integral_constant<int, 4>{}); break;
      default: with(std::integral_constant<int, 8>{}); break;
    }
  }

  template <typename U>
  void tile_with(U unpack_row, int64_t bh, int64_t T, int64_t t0, int count, float* out, Scratch& tmp) const {
    const uint8_t* src = reinterpret_cast<const uint8_t*>(codes_p) + (bh * T + t0) * row_bytes;
    const int groups = per_channel ? 0 : dim / group;
    if (!per_channel) token_meta(bh, T, t0, count, tmp);
    for (int i = 0; i < count; ++i) {
      if (per_channel) {  // per-channel groups of `group` tokens: one scale/zero row [dim] per group
        load_scale_row(bh * (T / group) + (t0 + i) / group, tmp);
      } else {  // spread the token's group scales over its channels
        for (int g = 0; g < groups; ++g) {
          const float sc = tmp.tile_scale[g * kTile + i], z = tmp.tile_zero[g * kTile + i];
          for (int c = g * group; c < (g + 1) * group; ++c) {
            tmp.scale[c] = sc;
            tmp.zero[c] = z;
          }
        }
        tmp.meta_row = -1;
      }
      prefetch_ahead(src, i);
      unpack_row(src + i * row_bytes, out + i * kRow, tmp.scale, tmp.zero, std::true_type{});
    }
  }

  // N channels from N codes: levels (the integer grid, or the codebook), scaled if SCALED.
  template <int N, int BITS, bool CB, bool SCALED>
  inline void emit(typename Vec<N>::i code, float* out, const float* sc, const float* zc) const {
    typename Vec<N>::f v = CB ? lookupv<N, BITS>(code, levels) : __builtin_convertvector(code, typename Vec<N>::f);
    if constexpr (SCALED) v = v * loadv<N>(sc) + loadv<N>(zc);
    storev<N>(out, v);
  }

  // Planar packing (kvq_ao/quant/packing.py): a row of `dim` codes is `planes` planes of P codes;
  // word j holds code j of every plane. Values come out in channel order: bare levels, or with
  // per-channel scale `sc` and zero `zc` (SCALED).
  template <int BITS, bool CB, bool SCALED>
  inline void unpack(const uint8_t* src, float* out, const float* sc, const float* zc, std::integral_constant<bool, SCALED>) const {
    auto at = [](const float* p, int c) { return SCALED ? p + c : p; };
    if constexpr (BITS == 8) {
      int c = 0;
      if constexpr (kWide == 16)
        for (; c + 16 <= dim; c += 16) emit<16, BITS, CB, SCALED>(bytesv<16>(src + c), out + c, at(sc, c), at(zc, c));
      for (; c + 8 <= dim; c += 8) emit<8, BITS, CB, SCALED>(bytesv<8>(src + c), out + c, at(sc, c), at(zc, c));
      for (; c < dim; ++c) out[c] = SCALED ? level1(src[c]) * sc[c] + zc[c] : level1(src[c]);
    } else {
      constexpr int planes = kvq_format::codes_per_word(BITS);
      constexpr int mask = (1 << BITS) - 1;
      const int P = dim / planes;
      auto words = [&](auto n_c, int j) {
        constexpr int N = decltype(n_c)::value;
        typename Vec<N>::i word = bytesv<N>(src + j);
        if constexpr (BITS == 3) word = word | (bytesv<N>(src + P + j) << 8) | (bytesv<N>(src + 2 * P + j) << 16);
        for (int i = 0; i < planes; ++i) emit<N, BITS, CB, SCALED>((word >> (i * BITS)) & mask, out + i * P + j, at(sc, i * P + j), at(zc, i * P + j));
      };
      int j = 0;
      if constexpr (kWide == 16)
        for (; j + 16 <= P; j += 16) words(std::integral_constant<int, 16>{}, j);
      for (; j + 8 <= P; j += 8) words(std::integral_constant<int, 8>{}, j);
      for (; j < P; ++j) {
        int32_t word = src[j];
        if constexpr (BITS == 3) word |= (src[P + j] << 8) | (src[2 * P + j] << 16);
        for (int i = 0; i < planes; ++i) {
          const int c = i * P + j;
          const float level = level1((word >> (i * BITS)) & mask);
          out[c] = SCALED ? level * sc[c] + zc[c] : level;
        }
      }
    }
  }
};

inline Operand make_operand(const char* name, const OperandArgs& in, int64_t dim, int64_t B, int64_t H, int64_t T) {
  using namespace kvq_format;
  const View &codes = in.codes, &scale = in.scale, &zero = in.zero, &codebook = in.codebook;
  const View &out_val = in.out_val, &out_idx = in.out_idx;
  const int64_t bits = in.bits, axis = in.axis;
  int64_t group = in.group;
  Operand o;
  o.bits = static_cast<int>(bits);
  o.is_float = kvq_format::is_float(bits);
  o.per_channel = axis == kAxisChannel;
  o.dim = static_cast<int>(dim);
  check(o.is_float || is_packed_bits(bits), name, " bits must be one of ", kPackedBitsText, " or ", kFloatBits, " (float), got ", bits);
  check(axis == kAxisToken || axis == kAxisChannel, name, " axis must be ", kAxisToken, " (token) or ", kAxisChannel,
        " (channel), got ", axis);
  check(group > 0 || is_one_row(axis, group), name, " group must be positive (or ", kOneRow, " with the channel axis: one "
        "scale/zero row for every position), got ", group);
  // calibrated key ranges: one per-channel group spanning the whole body
  if (is_one_row(axis, group)) group = T > 0 ? T : 1;
  o.group = static_cast<int>(group);
  check(in.query_bits == kFloatQuery || query_levels(in.query_bits) > 0, name, " query_bits must be ", kFloatQuery,
        " (float scores), ", kInt8Query, " (int8 query) or ", kInt16Query, " (int16 query), got ", in.query_bits);
  o.int_query = in.query_bits != kFloatQuery;
  o.query_levels = query_levels(in.query_bits);
  check(!o.int_query || (!o.is_float && o.per_channel && !in.codebook.present), "an integer query (query_bits ", in.query_bits,
        ") scores packed codes with uniform levels in per-channel groups; ", name, " is not");
  check(dim > 0 && dim <= kMaxHeadDim, "head_dim must be in [1, ", kMaxHeadDim, "], got ", dim);
  check(codes.dim == 4 && codes.size(0) == B && codes.size(1) == H && codes.size(2) == T,
        name, " codes must be [", B, ", ", H, ", ", T, ", bytes], got ", codes.shape());
  if (o.is_float) {
    check(is_float(codes.dtype) && codes.size(3) == dim, "a float ", name, " body must be floating point [batch, heads, tokens, ",
          dim, "], got ", codes.shape(), " ", dtype_name(codes.dtype));
    o.row_bytes = dim;
  } else {
    const int planes = codes_per_word(bits);
    check(dim % planes == 0, bits, "-bit ", name, " codes need head_dim a multiple of ", planes, ", got ", dim);
    o.row_bytes = packed_row_bytes(dim, bits);
    check(codes.dtype == DType::Byte && codes.size(3) == o.row_bytes, bits, "-bit ", name, "_codes must be uint8 [..., ",
          o.row_bytes, "], got ", dtype_name(codes.dtype), " ", codes.shape());
    check(scale.present && zero.present, bits, "-bit ", name, " codes need a scale and a zero");
    check(o.per_channel ? T % group == 0 : dim % group == 0, name, " group ", group,
          o.per_channel ? " does not divide the cache length " : " does not divide head_dim ", o.per_channel ? T : dim);
    const int64_t meta[4] = {B, H, o.per_channel ? T / group : T, o.per_channel ? dim : dim / group};
    auto is_meta = [&](const View& v) {
      return v.dim == 4 && v.sizes[0] == meta[0] && v.sizes[1] == meta[1] && v.sizes[2] == meta[2] && v.sizes[3] == meta[3];
    };
    o.meta8 = kvq_format::is_meta8(in.meta);
    check(kvq_format::is_valid_meta(in.meta) && (!o.meta8 || !o.per_channel), name, " meta must be ", kFloatMeta,
          " (float scale and zero) or ", kvq_format::kMetaOffset, " + e, |e| <= ", kvq_format::kMetaExponentBound,
          ", with per-token groups (8-bit), got ", in.meta, " with axis ", axis);
    const bool meta_dtypes = o.meta8 ? scale.dtype == DType::Byte && zero.dtype == DType::Byte : is_float(scale.dtype) && is_float(zero.dtype);
    check(is_meta(scale) && is_meta(zero) && meta_dtypes, name, "_scale and ", name, "_zero must be ", o.meta8 ? "uint8" : "float", " [",
          meta[0], ", ", meta[1], ", ", meta[2], ", ", meta[3], "], got ", scale.shape(), " ", dtype_name(scale.dtype), " and ",
          zero.shape(), " ", dtype_name(zero.dtype));
    if (codebook.present) {
      check(bits <= 4 && codebook.dim == 1 && codebook.numel() == (1 << bits) && is_float(codebook.dtype), "a ", bits, "-bit ", name,
            " codebook must hold ", (1 << bits), " float levels, got ", codebook.shape());
      load_floats(codebook.data, codebook.dtype, 1 << bits, o.levels);
      o.codebook = true;
    }
    if (o.meta8) o.meta_table = kvq_format::MetaTable(in.meta, kvq_format::range_levels(bits, o.codebook));
    o.scale_p = scale.bytes();
    o.zero_p = zero.bytes();
    o.scale_t = scale.dtype;
    o.zero_t = zero.dtype;
    o.scale_size = dtype_size(scale.dtype);
    o.zero_size = dtype_size(zero.dtype);
  }
  check(out_val.present == out_idx.present, name, "'s out_val and out_idx come together");
  if (out_val.present) {
    bool same = out_val.dim == 4 && out_idx.dim == 4;
    for (int i = 0; same && i < 4; ++i) same = out_val.sizes[i] == out_idx.sizes[i];
    check(out_idx.dtype == DType::Byte && is_float(out_val.dtype) && same && out_val.size(0) == B && out_val.size(1) == H &&
              out_val.size(2) == T && out_val.size(3) <= dim,
          name, " outliers must be [", B, ", ", H, ", ", T, ", k] float values and uint8 indices, got ", out_val.shape(), " and ",
          out_idx.shape(), " ", dtype_name(out_idx.dtype));
    check(dim <= kMaxOutlierHeadDim, "outlier slots need head_dim <= ", kMaxOutlierHeadDim, " (uint8 channel indices), got ", dim);
    o.n_out = static_cast<int>(out_val.size(3));
    o.out_val_p = out_val.bytes();
    o.out_val_t = out_val.dtype;
    o.out_val_size = dtype_size(out_val.dtype);
    o.out_idx_p = static_cast<const uint8_t*>(out_idx.data);
  }
  o.codes_p = codes.bytes();
  o.codes_t = codes.dtype;
  o.codes_size = dtype_size(codes.dtype);
  return o;
}

// RoPE of a key row at its position, as kvq_ao.quant.rope.rotate: channel pairs (i, i + D/2), with
// the tables of `angles` (the rope scale already in them).
KVQ_PROFILED inline void rotate_row(float* x, const float* cos, const float* sin, int dim) {
  const int half = dim / 2;
  for (int i = 0; i < half; ++i) {
    const float c = cos[i], s = sin[i], a = x[i], b = x[i + half];
    x[i] = a * c - b * s;
    x[i + half] = b * c + a * s;
  }
}

// cos and sin of position `pos` at each frequency, times the rope scale (attention scaling of
// scaled RoPE variants; 1 for plain RoPE), as every rotation here takes them.
KVQ_PROFILED inline void angles(int64_t pos, const float* inv_freq, int half, float scale, float* cos, float* sin) {
  const float p = static_cast<float>(pos);
  int i = 0;
  for (; i + 8 <= half; i += 8) {  // float32 angles p * inv_freq, as torch computes them
    v8f s, c;
    sincos8(splat(p) * load8(inv_freq + i), &s, &c);
    store8(sin + i, s);
    store8(cos + i, c);
  }
  for (; i < half; ++i) sincos1(p * inv_freq[i], sin + i, cos + i);
  if (scale != 1.f)  // skipped at scale 1, and kept out of the sincos loop (inside it, kvquant timed ~2% slower)
    for (i = 0; i < half; ++i) sin[i] *= scale, cos[i] *= scale;
}

// p * f - fl(p * f), exactly (the rounding error of a float product is a float): one FMA where
// the target has it, else in double (the product of two floats is exact there).
inline v8f product_error(v8f p, v8f f, v8f a) {
#if defined(__FMA__)
  return reinterpret_cast<v8f>(_mm256_fmsub_ps(reinterpret_cast<__m256>(p), reinterpret_cast<__m256>(f), reinterpret_cast<__m256>(a)));
#elif defined(__ARM_NEON) && defined(__ARM_FEATURE_FMA)
  float32x4_t p2[2], f2[2], a2[2];
  std::memcpy(p2, &p, 32), std::memcpy(f2, &f, 32), std::memcpy(a2, &a, 32);
  const float32x4_t e[2] = {vfmaq_f32(vnegq_f32(a2[0]), p2[0], f2[0]), vfmaq_f32(vnegq_f32(a2[1]), p2[1], f2[1])};
  v8f out;
  std::memcpy(&out, e, 32);
  return out;
#else
  const v8d pd = __builtin_convertvector(p, v8d), fd = __builtin_convertvector(f, v8d), ad = __builtin_convertvector(a, v8d);
  return __builtin_convertvector(pd * fd - ad, v8f);
#endif
}
#if defined(__AVX512F__)
inline Vec<16>::f product_error(Vec<16>::f p, Vec<16>::f f, Vec<16>::f a) {
  return reinterpret_cast<Vec<16>::f>(_mm512_fmsub_ps(reinterpret_cast<__m512>(p), reinterpret_cast<__m512>(f), reinterpret_cast<__m512>(a)));
}
#endif

// The cos/sin tables of `angles` for runs of consecutive positions (a tile of pre-RoPE keys), without
// a sin/cos per angle. The angle RoPE uses is the float product a = fl(p * f), as torch computes it.
// With p = p0 + k (k < kTile) and d = a - p * f (exact, |d| <= half an ulp of a):
//   sin a = sin(pf) cos d + cos(pf) sin d,  sin(pf) = sin(p0 f) cos(kf) + cos(p0 f) sin(kf)
// (cos alike). cos/sin(kf) are a table made once per call; cos/sin(p0 f) are carried from tile to
// tile by a rotation in double (drift ~1e-16 a tile); cos d and sin d are short Taylor series, to
// 1e-8 while a < 2^20 (|d| <= 2^-4). Within ~1.5e-7 of double sin/cos of a, as `sincos8` is, at
// about half its instructions: `angles` was a fifth of a kvquant preset's kernel time. Past 2^20
// radians, or for positions that do not follow the last run, the tile falls back to `angles`.
struct AngleRuns {
  static constexpr double kExactBelow = 1048576.0;  // 2^20
  int half = 0;
  const float* inv_freq = nullptr;
  float max_freq = 0.f;
  int64_t next = -1;  // the position whose cos/sin(p0 f) `seed_c/seed_s` hold (-1: none)
  std::vector<double> step_c, step_s, seed_c, seed_s;  // cos/sin(kTile f); cos/sin(next f)
  std::vector<float> run_c, run_s;                     // [k][i]: cos/sin(k f_i), k < kTile
  std::vector<float> lane_c, lane_s;                   // [i][k]: the same, for fill_lanes
  alignas(32) float c0[kMaxHeadDim / 2], s0[kMaxHeadDim / 2];  // cos/sin(p0 f) of the tile being filled

  AngleRuns(const float* freq, int half_dim) : half(half_dim), inv_freq(freq) {
    step_c.resize(half), step_s.resize(half), seed_c.resize(half), seed_s.resize(half);
    run_c.resize(static_cast<size_t>(kTile) * half), run_s.resize(static_cast<size_t>(kTile) * half);
    lane_c.resize(static_cast<size_t>(kTile) * half), lane_s.resize(static_cast<size_t>(kTile) * half);
    for (int i = 0; i < half; ++i) {
      max_freq = std::max(max_freq, std::fabs(freq[i]));
      const double f = freq[i], c1 = std::cos(f), s1 = std::sin(f);
      double c = 1.0, sn = 0.0;
      for (int k = 0; k < kTile; ++k) {  // k f by rotations in double: exact to ~1e-15 over a tile
        run_c[k * half + i] = lane_c[i * kTile + k] = static_cast<float>(c);
        run_s[k * half + i] = lane_s[i * kTile + k] = static_cast<float>(sn);
        const double c_next = c * c1 - sn * s1;
        sn = sn * c1 + c * s1, c = c_next;
      }
      step_c[i] = std::cos(kTile * f), step_s[i] = std::sin(kTile * f);
    }
  }

  // Seeds c0/s0 for positions p0 .. p0 + count - 1; false when those angles are too large for the
  // series (the caller uses `angles`).
  bool start(int64_t p0, int count) {
    if (p0 < 0 || static_cast<double>(p0 + count) * max_freq >= kExactBelow) return false;
    if (p0 != next)  // a new run: its seed from the angles themselves
      for (int i = 0; i < half; ++i) {
        const double angle = p0 * static_cast<double>(inv_freq[i]);
        seed_c[i] = std::cos(angle), seed_s[i] = std::sin(angle);
      }
    for (int i = 0; i < half; ++i) c0[i] = static_cast<float>(seed_c[i]), s0[i] = static_cast<float>(seed_s[i]);
    return true;
  }
  // cos/sin((p0 + kTile) f): the next tile's seed.
  void finish(int64_t p0) {
    for (int i = 0; i < half; ++i) {
      const double c = seed_c[i] * step_c[i] - seed_s[i] * step_s[i];
      seed_s[i] = seed_s[i] * step_c[i] + seed_c[i] * step_s[i], seed_c[i] = c;
    }
    next = p0 + kTile;
  }

  // sin and cos of a = fl(pf * f) from sin/cos(p0 f) (S0, C0) and sin/cos((pf - p0) f) (sn, c),
  // times `scale`: the series above, in N lanes.
  template <int N>
  static void series(typename Vec<N>::f c, typename Vec<N>::f sn, typename Vec<N>::f C0, typename Vec<N>::f S0,
                     typename Vec<N>::f pf, typename Vec<N>::f f, float scale, typename Vec<N>::f* cv,
                     typename Vec<N>::f* sv) {
    typedef typename Vec<N>::f vf;
    const vf sin_pf = S0 * c + C0 * sn, cos_pf = C0 * c - S0 * sn;
    const vf a = pf * f;
    const vf e = product_error(pf, f, a);  // p f - a = -d
    const vf e2 = e * e;
    const vf cos_d = splatv<N>(1.f) + e2 * (splatv<N>(-0.5f) + e2 * splatv<N>(1.f / 24.f)), sin_d = -(e - e2 * e * splatv<N>(1.f / 6.f));
    *sv = sin_pf * cos_d + cos_pf * sin_d, *cv = cos_pf * cos_d - sin_pf * sin_d;
    if (scale != 1.f) *sv *= splatv<N>(scale), *cv *= splatv<N>(scale);
  }

#if defined(__AVX512F__)
  // fill's tables with a lane a token: cos_out[i * kTile + k] for k < count rounded up to 16 (the
  // token-lane key scores read whole registers of 16 tokens). Same arithmetic, so the same floats.
  bool fill_lanes(int64_t p0, int count, float scale, float* cos_out, float* sin_out) {
    const int padded = (count + 15) / 16 * 16;
    if (!start(p0, padded)) return false;
    if (p0 + padded >= (int64_t{1} << 31)) return false;  // positions as int32 below
    typedef Vec<16>::f vf;
    const __m512i k16 = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int i = 0; i < half; ++i) {
      const vf C0 = splatv<16>(c0[i]), S0 = splatv<16>(s0[i]), f = splatv<16>(inv_freq[i]);
      for (int k = 0; k < padded; k += 16) {
        vf cv, sv;  // each position rounded to float as fill rounds it
        const vf pf = reinterpret_cast<vf>(_mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_set1_epi32(static_cast<int32_t>(p0 + k)), k16)));
        series<16>(loadv<16>(lane_c.data() + i * kTile + k), loadv<16>(lane_s.data() + i * kTile + k), C0, S0, pf, f,
                   scale, &cv, &sv);
        storev<16>(cos_out + i * kTile + k, cv);
        storev<16>(sin_out + i * kTile + k, sv);
      }
    }
    finish(p0);
    return true;
  }
#endif

  // Fills cos/sin [count][half] (times `scale`) for positions p0 .. p0 + count - 1; false when
  // those angles are too large for the series (the caller uses `angles`).
  bool fill(int64_t p0, int count, float scale, float* cos_out, float* sin_out) {
    if (!start(p0, count)) return false;
    for (int k = 0; k < count; ++k) {
      const float pf = static_cast<float>(p0 + k);
      const float *ck = run_c.data() + k * half, *sk = run_s.data() + k * half;
      float *co = cos_out + k * half, *so = sin_out + k * half;
      int i = 0;
      auto lanes = [&](auto n_c) {  // N angles a step: 16 where AVX-512 has them (at 8 these tables took a seventh of kvquant-3's time)
        constexpr int N = decltype(n_c)::value;
        typedef typename Vec<N>::f vf;
        for (; i + N <= half; i += N) {
          vf cv, sv;
          series<N>(loadv<N>(ck + i), loadv<N>(sk + i), loadv<N>(c0 + i), loadv<N>(s0 + i), splatv<N>(pf), loadv<N>(inv_freq + i), scale, &cv, &sv);
          storev<N>(so + i, sv);
          storev<N>(co + i, cv);
        }
      };
      lanes(std::integral_constant<int, kWide>{});
      lanes(std::integral_constant<int, 8>{});  // the rest (with kWide 8: nothing)
      for (; i < half; ++i) {  // the same arithmetic, one lane
        const float c = ck[i], sn = sk[i], f = inv_freq[i];
        const float sin_pf = s0[i] * c + c0[i] * sn, cos_pf = c0[i] * c - s0[i] * sn;
        const float a = pf * f, e = std::fma(pf, f, -a), e2 = e * e;
        const float cos_d = 1.f + e2 * (-0.5f + e2 * (1.f / 24.f)), sin_d = -(e - e2 * e * (1.f / 6.f));
        so[i] = (sin_pf * cos_d + cos_pf * sin_d) * scale;
        co[i] = (cos_pf * cos_d - sin_pf * sin_d) * scale;
      }
    }
    finish(p0);
    return true;
  }
};

// Running softmax state of one query head over one task's tokens.
struct Partial {
  float* acc;  // [dv] sum of p * v
  float max;   // running max of the scores (-inf: nothing seen)
  float sum;   // sum of p
};

inline float dot(const float* a, const float* b, int dim) {
  int c = 0;
  v8f a0 = splat(0.f), a1 = splat(0.f);
  for (; c + 16 <= dim; c += 16) {
    a0 += load8(a + c) * load8(b + c);
    a1 += load8(a + c + 8) * load8(b + c + 8);
  }
  for (; c + 8 <= dim; c += 8) a0 += load8(a + c) * load8(b + c);
  float s = hsum(a0 + a1);
  for (; c < dim; ++c) s += a[c] * b[c];
  return s;
}

// Four dot products of q with rows k, k + kRow, ... (dim a multiple of 8).
inline void dot4(const float* q, const float* k, int dim, float* out) {
  v8f a0 = splat(0.f), a1 = splat(0.f), a2 = splat(0.f), a3 = splat(0.f);
  for (int c = 0; c < dim; c += 8) {
    const v8f qv = load8(q + c);
    a0 += qv * load8(k + c);
    a1 += qv * load8(k + kRow + c);
    a2 += qv * load8(k + 2 * kRow + c);
    a3 += qv * load8(k + 3 * kRow + c);
  }
#if defined(__AVX2__)
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(reinterpret_cast<__m256>(a0), reinterpret_cast<__m256>(a1)),
                                  _mm256_hadd_ps(reinterpret_cast<__m256>(a2), reinterpret_cast<__m256>(a3)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1)));
#else
  out[0] = hsum(a0), out[1] = hsum(a1), out[2] = hsum(a2), out[3] = hsum(a3);
#endif
}

// acc[c] = acc[c] * correction + sum_j w[c / group][j] * values[j][c] for c < dv: one weight per
// token and group of channels (weight rows kTile apart; group = dv for a single weight per token),
// value rows kRow apart. Blocks of four vectors, with even and odd tokens in separate
// accumulators, so eight independent FMA chains hide the FMA latency. The vector blocks need
// every lane of a vector in one group (group a multiple of the lane count, or >= dv).
template <int N>
inline int accumulate_blocks(float* acc, float correction, const float* w, int group, const float* values, int count, int dv, int c) {
  typedef typename Vec<N>::f vf;
  if (group < dv && group % N != 0) return c;
  for (; c + 4 * N <= dv; c += 4 * N) {
    const float* wr[4];
    vf a[4], b[4];
    for (int k = 0; k < 4; ++k) {
      wr[k] = w + (c + k * N) / group * kTile;
      a[k] = loadv<N>(acc + c + k * N) * splatv<N>(correction);
      b[k] = splatv<N>(0.f);
    }
    int j = 0;
    if (wr[0] == wr[3]) {  // the block lies in one group: one broadcast weight per token
      for (; j + 2 <= count; j += 2) {
        const float* v = values + j * kRow + c;
        const vf w0 = splatv<N>(wr[0][j]), w1 = splatv<N>(wr[0][j + 1]);
        for (int k = 0; k < 4; ++k) {
          a[k] += w0 * loadv<N>(v + k * N);
          b[k] += w1 * loadv<N>(v + kRow + k * N);
        }
      }
    }
    for (; j + 2 <= count; j += 2) {
      const float* v = values + j * kRow + c;
      for (int k = 0; k < 4; ++k) {
        a[k] += splatv<N>(wr[k][j]) * loadv<N>(v + k * N);
        b[k] += splatv<N>(wr[k][j + 1]) * loadv<N>(v + kRow + k * N);
      }
    }
    if (j < count)
      for (int k = 0; k < 4; ++k) a[k] += splatv<N>(wr[k][j]) * loadv<N>(values + j * kRow + c + k * N);
    for (int k = 0; k < 4; ++k) storev<N>(acc + c + k * N, a[k] + b[k]);
  }
  for (; c + N <= dv; c += N) {
    const float* wr = w + c / group * kTile;
    vf a = loadv<N>(acc + c) * splatv<N>(correction);
    for (int j = 0; j < count; ++j) a += splatv<N>(wr[j]) * loadv<N>(values + j * kRow + c);
    storev<N>(acc + c, a);
  }
  return c;
}

inline void accumulate(float* acc, float correction, const float* w, int group, const float* values, int count, int dv) {
  int c = 0;
  if constexpr (kWide == 16) c = accumulate_blocks<16>(acc, correction, w, group, values, count, dv, c);
  c = accumulate_blocks<8>(acc, correction, w, group, values, count, dv, c);
  for (; c < dv; ++c) {
    const float* wr = w + c / group * kTile;
    float a = acc[c] * correction;
    for (int j = 0; j < count; ++j) a += wr[j] * values[j * kRow + c];
    acc[c] = a;
  }
}

// Eight dot products of q with rows k, k + kRow, ... (dim a multiple of kWide).
inline void dot8(const float* q, const float* k, int dim, float* out) {
  typedef Vec<kWide>::f vf;
  vf a[8];
  for (int r = 0; r < 8; ++r) a[r] = splatv<kWide>(0.f);
  for (int c = 0; c < dim; c += kWide) {
    const vf qv = loadv<kWide>(q + c);
    for (int r = 0; r < 8; ++r) a[r] += qv * loadv<kWide>(k + r * kRow + c);
  }
  v8f h[8];
  for (int r = 0; r < 8; ++r) h[r] = fold16(a[r]);
  hsum8x8(h, out);
}

// Scores of `n_heads` query heads (rows `dim` apart at q) against `count` float key rows
// (kRow apart): scores[h * kTile + i].
KVQ_PROFILED inline void score_rows(const float* q, int n_heads, int dim, int count, const float* keys, float* scores) {
  for (int h = 0; h < n_heads; ++h) {
    const float* qh = q + h * dim;
    float* sh = scores + h * kTile;
    int i = 0;
    if (dim % kWide == 0)
      for (; i + 8 <= count; i += 8) dot8(qh, keys + i * kRow, dim, sh + i);
    if (dim % 8 == 0)
      for (; i + 4 <= count; i += 4) dot4(qh, keys + i * kRow, dim, sh + i);
    for (; i < count; ++i) sh[i] = dot(qh, keys + i * kRow, dim);
  }
}

// Raw scores -> scaled, soft-capped and masked (`visible[h * vis_stride + i]`, nonzero: seen); each
// head's best score in best_of. False when no head of the group sees any token of the tile.
KVQ_PROFILED inline bool mask_scores(float* scores, int n_heads, int count, const uint8_t* visible, int64_t vis_stride, float scaling,
                                     float softcap, float* best_of) {
  bool any = false;
  for (int h = 0; h < n_heads; ++h) {
    float* sh = scores + h * kTile;
    const uint8_t* vis = visible + h * vis_stride;
    if (softcap > 0.f)
      for (int i = 0; i < count; ++i) sh[i] = softcap * std::tanh(sh[i] * scaling / softcap) / scaling;
    v8f best8 = splat(kNegInf);
    int i = 0;
    auto lanes = [&](auto n_c) {  // N scores a step: kWide (16 on AVX-512), then 8
      constexpr int N = decltype(n_c)::value;
      typedef typename Vec<N>::f vf;
      vf best = splatv<N>(kNegInf);
      for (; i + N <= count; i += N) {
        const vf s = (bytesv<N>(vis + i) != 0) ? loadv<N>(sh + i) * splatv<N>(scaling) : splatv<N>(kNegInf);
        storev<N>(sh + i, s);
        best = best > s ? best : s;
      }
      const v8f b8 = max8(best);
      best8 = best8 > b8 ? best8 : b8;
    };
    lanes(std::integral_constant<int, kWide>{});
    lanes(std::integral_constant<int, 8>{});
    v8f m4 = __builtin_shufflevector(best8, best8, 4, 5, 6, 7, 0, 1, 2, 3);
    best8 = best8 > m4 ? best8 : m4;
    m4 = __builtin_shufflevector(best8, best8, 2, 3, 0, 1, 6, 7, 4, 5);
    best8 = best8 > m4 ? best8 : m4;
    m4 = __builtin_shufflevector(best8, best8, 1, 0, 3, 2, 5, 4, 7, 6);
    best8 = best8 > m4 ? best8 : m4;
    float best = best8[0];
    for (; i < count; ++i) {
      const float s = vis[i] ? sh[i] * scaling : kNegInf;
      sh[i] = s;
      best = std::max(best, s);
    }
    best_of[h] = best;
    any = any || best > kNegInf;
  }
  return any;
}

// Online softmax over one tile of one head: probs = exp(score - new max), the running max and sum
// updated; returns the factor the head's accumulated values must be rescaled by.
KVQ_PROFILED inline float softmax_step(const float* sh, int count, float best, Partial& part, float* probs) {
  const float new_max = std::max(part.max, best);
  const float correction = part.max == kNegInf ? 0.f : std::exp(part.max - new_max);
  int i = 0;
  typedef typename Vec<kWide>::f vf;
  vf sum = splatv<kWide>(0.f);
  for (; i + kWide <= count; i += kWide) {  // 16 lanes on AVX-512: half the exp polynomials' steps
    const vf s = loadv<kWide>(sh + i);
    const vf p = s == splatv<kWide>(kNegInf) ? splatv<kWide>(0.f) : expv<kWide>(s - splatv<kWide>(new_max));
    storev<kWide>(probs + i, p);
    sum += p;
  }
  v8f sum8 = fold16(sum);
  for (; i + 8 <= count; i += 8) {
    const v8f s = load8(sh + i);
    const v8f p = s == splat(kNegInf) ? splat(0.f) : expv<8>(s - splat(new_max));
    store8(probs + i, p);
    sum8 += p;
  }
  float tile_sum = hsum(sum8);
  for (; i < count; ++i) {
    probs[i] = sh[i] == kNegInf ? 0.f : std::exp(sh[i] - new_max);
    tile_sum += probs[i];
  }
  part.sum = part.sum * correction + tile_sum;
  part.max = new_max;
  return correction;
}

// Keys quantized in per-channel groups share one scale/zero row over `group` tokens, so
//   q . (scale * level + zero) = (q * scale) . level + q . zero:
// the query heads are scaled once per row and scored against the bare levels. An outlier replaces
// its channel's dense value, so its score changes by q[d] * (exact - dense).
// (Outlier indices of a token are distinct, as the quantizer writes them.)
void Operand::direct_key_scores(const float* q, int n_heads, int64_t bh, int64_t T, int64_t t0, int count, float* lv,
                                float* scores, Scratch& tmp) const {
  const bool fused = fusable();
  if (!fused && !int_query) levels_tile(bh, T, t0, count, lv);
  const uint8_t* rows = reinterpret_cast<const uint8_t*>(codes_p) + (bh * T + t0) * row_bytes;
  for (int i = 0; i < count;) {
    const int64_t row = (t0 + i) / group;
    const int end = static_cast<int>(std::min<int64_t>(count, (row + 1) * group - t0));
    if (load_scale_row(bh * (T / group) + row, tmp)) {
      for (int h = 0; h < n_heads; ++h) {
        for (int d = 0; d < dim; ++d) tmp.qs[h * dim + d] = q[h * dim + d] * tmp.scale[d];
        tmp.bias[h] = dot(q + h * dim, tmp.zero, dim);
      }
      if (int_query) quantize_query(n_heads, tmp);
    }
    if (int_query) {
      with_format([&](auto bits_c, auto) {
        constexpr int B = decltype(bits_c)::value;
        if (query_levels > 127) int_scores<B, true>(tmp, n_heads, bh * T + t0 + i, end - i, scores + i);
        else int_scores<B, false>(tmp, n_heads, bh * T + t0 + i, end - i, scores + i);
      });
    } else if (fused) {
      fused_scores_of_heads(tmp.qs, n_heads, bh * T + t0 + i, end - i, scores + i);
    } else {
      score_rows(tmp.qs, n_heads, dim, end - i, lv + i * kRow, scores + i);
    }
    for (int h = 0; h < n_heads; ++h)
      for (int j = i; j < end; ++j) scores[h * kTile + j] += tmp.bias[h];
    for_each_outlier(bh * T + t0 + i, end - i, [&](int jj, int d, float exact) {
      const int j = i + jj;
      const float level = fused || int_query ? level_at(rows + j * row_bytes, d) : lv[j * kRow + d];
      const float delta = exact - (tmp.scale[d] * level + tmp.zero[d]);
      for (int h = 0; h < n_heads; ++h) scores[h * kTile + j] += q[h * dim + d] * delta;
    });
    i = end;
  }
}

// Keys in per-token groups of one group a vector (the rotated formats): q . (s_j level_j + z_j) =
// s_j (q . level_j) + z_j sum(q), so the bare levels are scored straight from the codes, as keys in
// per-channel groups are (fused_scores, q itself in place of q times a scale row), and each score
// then takes one multiply-add (before: the tile dequantized into floats, then scored).
void Operand::vector_key_scores(const float* q, int n_heads, int64_t bh, int64_t T, int64_t t0, int count, float* scores,
                                Scratch& tmp) const {
  token_meta(bh, T, t0, count, tmp);
  const int64_t first = bh * T + t0;
  fused_scores_of_heads(q, n_heads, first, count, scores);
  struct Ones {
    alignas(64) float v[kMaxHeadDim] = {};
    constexpr Ones() {
      for (float& x : v) x = 1.f;
    }
  };
  static constexpr Ones ones{};
  for (int h = 0; h < n_heads; ++h) {
    float* sh = scores + h * kTile;
    const float q_sum = dot(q + h * dim, ones.v, dim);
    for (int j = 0; j < count; ++j) sh[j] = tmp.tile_scale[j] * sh[j] + tmp.tile_zero[j] * q_sum;
  }
  const uint8_t* rows = reinterpret_cast<const uint8_t*>(codes_p) + first * row_bytes;
  for_each_outlier(first, count, [&](int j, int d, float exact) {
    const float delta = exact - (tmp.tile_scale[j] * level_at(rows + j * row_bytes, d) + tmp.tile_zero[j]);
    for (int h = 0; h < n_heads; ++h) scores[h * kTile + j] += q[h * dim + d] * delta;
  });
}

// Pre-RoPE keys in per-channel groups (tile t0, `count` tokens; cos/sin tables times rope_scale) as
// rotated float rows `kRow` apart, exact outliers patched in registers before the rotation
// (rope_rows), segment by segment of one scale row: one pass instead of dequantize, patch, rotate.
void Operand::rope_tile(int64_t bh, int64_t T, int64_t t0, int count, const float* cos_t, const float* sin_t, float* out,
                        Scratch& tmp) const {
  const int half = dim / 2;
  alignas(64) float out_vals[kTile * kMaxRopeSlots];
  for (int i = 0; i < count;) {
    const int64_t row = (t0 + i) / group;
    const int end = static_cast<int>(std::min<int64_t>(count, (row + 1) * group - t0));
    load_scale_row(bh * (T / group) + row, tmp);
    const int64_t first = bh * T + t0 + i;
    if (n_out) load_floats(out_val_p + first * n_out * out_val_size, out_val_t, int64_t{end - i} * n_out, out_vals);
    with_format([&](auto bits_c, auto cb_c) {
      constexpr int B = decltype(bits_c)::value;
      constexpr bool CB = decltype(cb_c)::value;
      const float *cr = cos_t + i * half, *sr = sin_t + i * half;
      float* o = out + i * kRow;
      auto rows = [&](auto lanes_c) {
        constexpr int N = decltype(lanes_c)::value;
        if (n_out == 0) rope_rows<B, CB, 0, N>(first, end - i, cr, sr, tmp.scale, tmp.zero, out_vals, o);
        else if (n_out == 1) rope_rows<B, CB, 1, N>(first, end - i, cr, sr, tmp.scale, tmp.zero, out_vals, o);
        else rope_rows<B, CB, 2, N>(first, end - i, cr, sr, tmp.scale, tmp.zero, out_vals, o);
      };
      if (wide_rope<B>()) rows(std::integral_constant<int, kWide>{});
      else rows(std::integral_constant<int, 8>{});
    });
    i = end;
  }
}

// Scores of pre-RoPE keys with a lane a token (rope_lanes; tile t0, `count` tokens, cos/sin with a
// lane a token, times rope_scale): rope_lane_scores over blocks of 16 tokens, segment by segment of
// one scale row, in passes of up to 4 query heads.
void Operand::rope_lane_tile(const float* q, int n_heads, int64_t bh, int64_t T, int64_t t0, int count, const float* cos_l,
                             const float* sin_l, float* scores, Scratch& tmp) const {
#if defined(__AVX512VBMI__)
  alignas(64) float out_vals[kTile * kMaxRopeSlots];
  for (int i = 0; i < count;) {
    const int64_t row = (t0 + i) / group;
    const int end = static_cast<int>(std::min<int64_t>(count, (row + 1) * group - t0));
    const int64_t meta = bh * (T / group) + row;
    const int slot = static_cast<int>(meta % Scratch::kLaneTables);
    float* table = tmp.lane_table[slot];
    if (tmp.table_row[slot] != meta) {
      load_scale_row(meta, tmp);
      alignas(64) float rep[16];
      for (int l = 0; l < 16; ++l) rep[l] = codebook ? levels[l % (1 << bits)] : static_cast<float>(l % (1 << bits));
      const __m512 lv = _mm512_load_ps(rep);
      for (int c = 0; c < dim; ++c)
        _mm512_store_ps(table + 16 * c, _mm512_fmadd_ps(lv, _mm512_set1_ps(tmp.scale[c]), _mm512_set1_ps(tmp.zero[c])));
      tmp.table_row[slot] = meta;
    }
    const int64_t first = bh * T + t0 + i;
    if (n_out) load_floats(out_val_p + first * n_out * out_val_size, out_val_t, int64_t{end - i} * n_out, out_vals);
    const uint8_t* src = reinterpret_cast<const uint8_t*>(codes_p) + first * row_bytes;
    auto blocks = [&](auto bits_c, auto ns_c) {
      constexpr int B = decltype(bits_c)::value;
      constexpr int NS = decltype(ns_c)::value;
      for (int b = 0; b < end - i; b += 16) {
        const int n = std::min(16, end - i - b);
        prefetch_lines_starting(reinterpret_cast<uintptr_t>(src) + (b + kPrefetchRows) * row_bytes, 16 * row_bytes);
        const uint8_t* rows = src + b * row_bytes;
        const uint8_t* idx = NS ? out_idx_p + (first + b) * NS : nullptr;
        const float* ex = out_vals + b * NS;
        const float *cl = cos_l + i + b, *sl = sin_l + i + b;
        for (int h = 0; h < n_heads;) {
          const float* qh = q + h * dim;
          float* sh = scores + h * kTile + i + b;
          const int left = n_heads - h;
          if (left >= 4) rope_lane_scores<B, NS, 4>(qh, rows, n, idx, ex, cl, sl, table, sh), h += 4;
          else if (left == 3) rope_lane_scores<B, NS, 3>(qh, rows, n, idx, ex, cl, sl, table, sh), h += 3;
          else if (left == 2) rope_lane_scores<B, NS, 2>(qh, rows, n, idx, ex, cl, sl, table, sh), h += 2;
          else rope_lane_scores<B, NS, 1>(qh, rows, n, idx, ex, cl, sl, table, sh), h += 1;
        }
      }
    };
    // (the levels, codebook or grid, are in the tables: no instance per kind, which cost compile time)
    auto with_slots = [&](auto bits_c) {
      if (n_out == 0) blocks(bits_c, std::integral_constant<int, 0>{});
      else if (n_out == 1) blocks(bits_c, std::integral_constant<int, 1>{});
      else blocks(bits_c, std::integral_constant<int, 2>{});
    };
    if (bits == 3) with_slots(std::integral_constant<int, 3>{});
    else with_slots(std::integral_constant<int, 2>{});
    i = end;
  }
#else
  (void)q, (void)n_heads, (void)bh, (void)T, (void)t0, (void)count, (void)cos_l, (void)sin_l, (void)scores, (void)tmp;
  check(false, "rope_lane_tile needs AVX-512 VBMI (rope_lanes)");
#endif
}

// The softmax weights of a tile's values in per-token groups: w[g][j] = p_j * scale_jg (rows kTile
// apart) and zsum[g] = sum_j p_j * zero_jg. Hidden tokens (p = 0) contribute nothing, whatever
// their scale.
void Operand::token_weights(const float* probs, int count, const Scratch& tmp, float* w, float* zsum, int group_stride) const {
  for (int g = 0; g < dim / group; ++g) {
    const float* sc = tmp.tile_scale + g * kTile;
    const float* zc = tmp.tile_zero + g * kTile;
    float* wg = w + g * group_stride;
    v8f z8 = splat(0.f);
    int j = 0;
    auto lanes = [&](auto n_c) {  // N tokens a step: kWide (16 on AVX-512), then 8
      constexpr int N = decltype(n_c)::value;
      typedef typename Vec<N>::f vf;
      vf z = splatv<N>(0.f);
      for (; j + N <= count; j += N) {
        const vf p = loadv<N>(probs + j);
        const auto seen = p != splatv<N>(0.f);
        storev<N>(wg + j, seen ? p * loadv<N>(sc + j) : splatv<N>(0.f));
        z += seen ? p * loadv<N>(zc + j) : splatv<N>(0.f);
      }
      z8 += fold16(z);
    };
    lanes(std::integral_constant<int, kWide>{});
    lanes(std::integral_constant<int, 8>{});
    float zs = hsum(z8);
    for (; j < count; ++j) {
      const float p = probs[j];
      wg[j] = p == 0.f ? 0.f : p * sc[j];
      zs += p == 0.f ? 0.f : p * zc[j];
    }
    zsum[g] = zs;
  }
}

// acc[c] += zsum[c / group]: the zeros' share of the weighted values.
void Operand::add_zero_sums(float* acc, const float* zsum) const {
  for (int g = 0; g < dim / group; ++g)
    for (int c = g * group; c < (g + 1) * group; ++c) acc[c] += zsum[g];
}

// Values quantized in per-token groups of channels:
//   sum_j p_j (s_jg * level_j + z_jg) = sum_j (p_j s_jg) level_j + sum_j p_j z_jg, group by group,
// so the tile stays bare levels and the scales ride on the softmax weights. Outliers are corrected
// afterwards by p_j * (exact - dense). `tmp` holds the tile's per-token scale/zero (token_meta).
void Operand::direct_accumulate(float* acc, float correction, const float* probs, int count, const float* lv,
                                const Scratch& tmp, int64_t bh, int64_t T, int64_t t0) const {
  alignas(64) float w[kMaxHeadDim / 8 * kTile];  // [group][token]
  float zsum[kMaxHeadDim / 8];
  token_weights(probs, count, tmp, w, zsum);
  accumulate(acc, correction, w, group, lv, count, dim);
  add_zero_sums(acc, zsum);
  correct_value_outliers(acc, probs, count, tmp, bh * T + t0, [&](int j, int d) { return lv[j * kRow + d]; });
}

void Operand::fused_values(Partial* parts, const float* correction, const float* probs, const float* best_of, int n_heads,
                           int count, const Scratch& tmp, int64_t bh, int64_t T, int64_t t0) const {
  const int groups = dim / group;
  alignas(64) float w[kPass * kMaxHeadDim / 8 * kTile];  // [group][head of the pass][token]
  float zsum[kPass][kZsum];
  const uint8_t* rows = reinterpret_cast<const uint8_t*>(codes_p) + (bh * T + t0) * row_bytes;
  with_format([&](auto bits_c, auto cb_c) {
    constexpr int B = decltype(bits_c)::value, kMax = max_pass_heads<B>();
    constexpr bool CB = decltype(cb_c)::value;
    int heads[kPass];
    for (int h = 0; h < n_heads;) {
      int n = 0;  // the next pass: up to kMax heads that saw something in this tile
      for (; h < n_heads && n < kMax; ++h)
        if (best_of[h] != kNegInf) heads[n++] = h;
      if (n == 0) break;
      float* acc[kPass];
      float corr[kPass];
      for (int k = 0; k < n; ++k) {
        const float* ph = probs + heads[k] * kTile;
        acc[k] = parts[heads[k]].acc;
        corr[k] = correction[heads[k]];
        token_weights(ph, count, tmp, w + k * kTile, zsum[k], kPass * kTile);
      }
      const int64_t first = bh * T + t0;
      auto pass = [&](auto lanes_c) {
        constexpr int N = decltype(lanes_c)::value;
        switch (n) {
          case 1: fused_accumulate<B, CB, 1, N>(acc, corr, w, &zsum[0][0], first, count); break;
          case 2: if constexpr (kMax >= 2) fused_accumulate<B, CB, 2, N>(acc, corr, w, &zsum[0][0], first, count); break;
          case 3: if constexpr (kMax >= 3) fused_accumulate<B, CB, 3, N>(acc, corr, w, &zsum[0][0], first, count); break;
          default: if constexpr (kMax >= 4) fused_accumulate<B, CB, 4, N>(acc, corr, w, &zsum[0][0], first, count); break;
        }
      };
      if (wide_values<B>()) pass(std::integral_constant<int, kWide>{});
      else pass(std::integral_constant<int, 8>{});
      for (int k = 0; k < n; ++k) {
        correct_value_outliers(acc[k], probs + heads[k] * kTile, count, tmp, first,
                               [&](int j, int d) { return level_at(rows + j * row_bytes, d); });
      }
    }
  });
}

// Output sizes [B, Hq, Dv] of a valid call, read before running it (for allocating `out`).
inline void output_sizes(const Args& a, int64_t* sizes) {
  check(a.q.dim == 4 && a.v.side.dim == 4, "q and v's side must be 4-D, got ", a.q.shape(), " and ", a.v.side.shape());
  sizes[0] = a.q.size(0);
  sizes[1] = a.q.size(1);
  sizes[2] = a.v.side.size(3);
}

// One query token attending over one layer's quantized cache: out [B, Hq, Dv] float32. Checks
// every argument first (std::invalid_argument). `parallel_for(n, fn)` runs fn(begin, end) over
// [0, n) on up to `threads` threads, each thread one contiguous range.
template <typename ParallelFor>
// `lse` (optional, [B * Hq]) receives each row's log-sum-exp of its scaled scores (-inf where it
// read nothing): what merging shards of one sequence exactly needs (context parallelism).
void decode_attention(const Args& a, float* out, int64_t threads, ParallelFor&& parallel_for, float* lse = nullptr) {
  const View& q = a.q;
  check(q.dim == 4 && q.size(2) == 1, "takes one query token q [batch, heads, 1, head_dim], got ", q.shape());
  check(q.dtype == DType::Float, "q must be float32 here (the PyTorch layer converts it), got ", dtype_name(q.dtype));
  check(a.softcap >= 0.0, "softcap must be >= 0 (0 = no soft-capping), got ", a.softcap);
  const int64_t B = q.size(0), Hq = q.size(1), D = q.size(3);
  check(a.k.codes.dim == 4 && a.v.codes.dim == 4, "the cache must be 4-D [batch, heads, tokens, bytes]");
  const int64_t Hkv = a.k.codes.size(1), T = a.k.codes.size(2);
  check(Hkv > 0 && Hq % Hkv == 0, Hq, " query heads is not a multiple of ", Hkv, " key/value heads");
  const int64_t n_heads = Hq / Hkv;
  check(n_heads <= kMaxGroupHeads, "at most 64 query heads per kv head, got ", n_heads);
  const View &side_k = a.k.side, &side_v = a.v.side;
  check(side_k.dim == 4 && side_v.dim == 4 && side_k.size(0) == B && side_k.size(1) == Hkv && side_k.size(3) == D &&
            side_v.size(0) == B && side_v.size(1) == Hkv && side_v.size(2) == side_k.size(2) && is_float(side_k.dtype) &&
            is_float(side_v.dtype),
        "side_k [", B, ", ", Hkv, ", S, ", D, "] and side_v [", B, ", ", Hkv, ", S, Dv] float expected, got ", side_k.shape(), " and ",
        side_v.shape());
  const int64_t Dv = side_v.size(3), S = side_k.size(2);
  const Operand K = make_operand("k", a.k, D, B, Hkv, T);
  const Operand V = make_operand("v", a.v, Dv, B, Hkv, T);
  const View& mask = a.mask;
  check(mask.dtype == DType::Bool && mask.dim == 4 && mask.size(0) == B && (mask.size(1) == 1 || mask.size(1) == Hq) &&
            mask.size(2) == 1 && mask.size(3) == T,
        "mask must be bool [", B, ", 1 or ", Hq, ", 1, ", T, "], got ", dtype_name(mask.dtype), " ", mask.shape());
  check(a.side_pos.dtype == DType::Long && a.side_pos.dim == 1 && a.side_pos.size(0) == S, "side_pos must be int64 [", S, "], got ",
        dtype_name(a.side_pos.dtype), " ", a.side_pos.shape());
  check(a.body_end.numel() == 1 && a.body_end.dtype == DType::Long, "body_end must be a 0-dim int64 tensor");
  const bool pre_rope = a.rope_inv_freq.present;
  std::vector<float> inv_freq;
  if (pre_rope) {
    check(a.rope_inv_freq.dim == 1 && a.rope_inv_freq.numel() == D / 2 && D % 2 == 0 && is_float(a.rope_inv_freq.dtype),
          "rope_inv_freq must be None or head_dim/2 = ", D / 2, " floats, got ", a.rope_inv_freq.shape());
    inv_freq.resize(D / 2);
    load_floats(a.rope_inv_freq.data, a.rope_inv_freq.dtype, D / 2, inv_freq.data());
  }
  const int64_t* pos = static_cast<const int64_t*>(a.side_pos.data);
  for (int64_t s = 0; s < S; ++s)
    check(pos[s] < T, "side entry ", s, " is at position ", pos[s], " beyond the cache's ", T, " positions");
  const int64_t lo = std::clamp<int64_t>(a.body_start, 0, T);
  const int64_t hi = std::clamp<int64_t>(*static_cast<const int64_t*>(a.body_end.data), lo, T);

  const bool* mask_data = static_cast<const bool*>(mask.data);
  const float* q_data = static_cast<const float*>(q.data);
  const int64_t m_b = mask.strides[0], m_h = mask.size(1) == 1 ? 0 : mask.strides[1], m_t = mask.strides[3];
  const float scaling = static_cast<float>(a.scaling), softcap = static_cast<float>(a.softcap);
  const int64_t body_start = a.body_start;

  const int64_t n_tiles = (hi - lo + kTile - 1) / kTile;
  // One chunk of tiles per thread (parallel_for hands each thread one contiguous range, so more
  // chunks than threads would leave some threads a chunk more than others); the side store is done
  // by the last chunk's task and keeps its own partial state (slot n_chunks).
  const int64_t n_chunks = std::max<int64_t>(1, std::min<int64_t>(n_tiles, threads));
  const int64_t slots = n_chunks + 1;
  const int64_t rows = B * Hq;
  std::vector<float> acc(slots * rows * Dv, 0.f), maxes(slots * rows, kNegInf), sums(slots * rows, 0.f);
  const float scale_f = scaling, softcap_f = softcap, rope_f = static_cast<float>(a.rope_scale);
  const int half = static_cast<int>(D / 2);
  const int nh = static_cast<int>(n_heads), dk = static_cast<int>(D), dv = static_cast<int>(Dv);
  check(!V.int_query, "values take query_bits ", kvq_format::kFloatQuery, " (an integer query scores keys)");
  check(!(K.int_query && pre_rope), "an integer query needs post-RoPE keys (rope_inv_freq None)");
  const bool direct_k = !K.is_float && K.per_channel && !pre_rope;
  const bool rope_k = !K.is_float && K.per_channel && pre_rope && K.rope_fusable();
  const bool rope_lanes = rope_k && K.rope_lanes();  // then cos/sin tables with a lane a token
  const bool vector_k = !pre_rope && K.vector_keys();
  const bool direct_v = !V.is_float && !V.per_channel && V.group % 8 == 0;
  const bool fused_v = direct_v && V.fusable();

  parallel_for(n_chunks, [&](int64_t begin, int64_t end) {
    Workspace& ws = Workspace::of_this_thread();
    float* ktile = ws.ktile;
    float* vtile = ws.vtile;
    Scratch* k_tmp = &ws.k_tmp;
    Scratch* v_tmp = &ws.v_tmp;
    k_tmp->meta_row = v_tmp->meta_row = -1;  // cached rows belong to the last call's tensors
    for (int64_t& r : k_tmp->table_row) r = -1;
    float* cos_t = ws.cos_t;
    float* sin_t = ws.sin_t;
    float* scores = ws.scores;
    uint8_t* visible = ws.visible;
    float* probs = ws.probs;
    float best_of[kMaxGroupHeads];
    std::vector<Partial> parts(n_heads);
    auto state = [&](int64_t slot, int64_t b, int64_t hkv) {
      for (int64_t h = 0; h < n_heads; ++h) {
        const int64_t row = slot * rows + b * Hq + hkv * n_heads + h;
        parts[h] = Partial{acc.data() + row * Dv, maxes[row], sums[row]};
      }
    };
    auto save = [&](int64_t slot, int64_t b, int64_t hkv) {
      for (int64_t h = 0; h < n_heads; ++h) {
        const int64_t row = slot * rows + b * Hq + hkv * n_heads + h;
        maxes[row] = parts[h].max;
        sums[row] = parts[h].sum;
      }
    };
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t_begin = lo + task * n_tiles / n_chunks * kTile;
      const int64_t t_end = std::min(hi, lo + (task + 1) * n_tiles / n_chunks * kTile);
      // One tile of one (batch row, kv head): scores, online softmax, weighted values.
      auto one_tile = [&](int64_t t0, int count, int64_t b, int64_t hkv) {
            // The tile's mask rows, a head's `vis_stride` apart (0: one row for every head): read in
            // place where the mask's tokens are contiguous, else gathered into `visible` (copying
            // them for every head and tile was 3% of a kvquant preset's time)
            const int vis_heads = m_h == 0 ? 1 : nh;
            const uint8_t* vis_rows = visible;
            int64_t vis_stride = m_h == 0 ? 0 : kTile;
            if (m_t == 1) {
              vis_rows = reinterpret_cast<const uint8_t*>(mask_data + b * m_b + hkv * n_heads * m_h + t0);
              vis_stride = m_h;
            } else {
              for (int h = 0; h < vis_heads; ++h) {
                const bool* m = mask_data + b * m_b + (hkv * n_heads + h) * m_h + t0 * m_t;
                for (int i = 0; i < count; ++i) visible[h * kTile + i] = m[i * m_t];
              }
            }
            bool seen = false;
            for (int h = 0; h < vis_heads && !seen; ++h) {  // any visible token? 8 mask bytes at a time
              const uint8_t* vis = vis_rows + h * vis_stride;
              uint64_t any = 0;
              int i = 0;
              for (; i + 8 <= count; i += 8) { uint64_t w8; std::memcpy(&w8, vis + i, 8); any |= w8; }
              for (; i < count; ++i) any |= vis[i];
              seen = any != 0;
            }
            if (!seen) return;
            const int64_t bh = b * Hkv + hkv;
            const float* qg = q_data + (b * Hq + hkv * n_heads) * D;
            if (direct_k) {
              K.direct_key_scores(qg, nh, bh, T, t0, count, ktile, scores, *k_tmp);
            } else if (vector_k) {
              K.vector_key_scores(qg, nh, bh, T, t0, count, scores, *k_tmp);
            } else if (rope_lanes) {
              K.rope_lane_tile(qg, nh, bh, T, t0, count, cos_t, sin_t, scores, *k_tmp);
            } else if (rope_k) {
              K.rope_tile(bh, T, t0, count, cos_t, sin_t, ktile, *k_tmp);
              score_rows(qg, nh, dk, count, ktile, scores);
            } else {
              K.tile(bh, T, t0, count, ktile, *k_tmp);
              if (pre_rope)
                for (int i = 0; i < count; ++i)
                  rotate_row(ktile + i * kRow, cos_t + i * half, sin_t + i * half, dk);
              score_rows(qg, nh, dk, count, ktile, scores);
            }
            if (!mask_scores(scores, nh, count, vis_rows, vis_stride, scale_f, softcap_f, best_of)) return;
            if (fused_v) {  // softmax of every head, then the values of all heads in one pass over the codes
              V.token_meta(bh, T, t0, count, *v_tmp);
              state(task, b, hkv);
              float correction[kMaxGroupHeads];
              for (int h = 0; h < nh; ++h)
                if (best_of[h] != kNegInf)
                  correction[h] = softmax_step(scores + h * kTile, count, best_of[h], parts[h], probs + h * kTile);
              V.fused_values(parts.data(), correction, probs, best_of, nh, count, *v_tmp, bh, T, t0);
              save(task, b, hkv);
              return;
            }
            if (direct_v) {
              V.levels_tile(bh, T, t0, count, vtile);
              V.token_meta(bh, T, t0, count, *v_tmp);
            } else {
              V.tile(bh, T, t0, count, vtile, *v_tmp);
            }
            state(task, b, hkv);
            for (int h = 0; h < nh; ++h) {
              if (best_of[h] == kNegInf) continue;
              const float correction = softmax_step(scores + h * kTile, count, best_of[h], parts[h], probs);
              if (direct_v) V.direct_accumulate(parts[h].acc, correction, probs, count, vtile, *v_tmp, bh, T, t0);
              else accumulate(parts[h].acc, correction, probs, dv, vtile, count, dv);
            }
            save(task, b, hkv);
      };
      auto tile_count = [&](int64_t t0) { return static_cast<int>(std::min<int64_t>(kTile, t_end - t0)); };
      if (pre_rope) {  // tile-major: one table of cos/sin per tile, shared by every batch row and kv head
        AngleRuns runs(inv_freq.data(), half);
        for (int64_t t0 = t_begin; t0 < t_end; t0 += kTile) {
          const int count = tile_count(t0);
          if (rope_lanes) {
#if defined(__AVX512F__)
            if (!runs.fill_lanes(a.position_offset + t0, count, rope_f, cos_t, sin_t)) {
              float *row_c = ktile, *row_s = ktile + kTile * half;  // `angles` by rows, then a lane a token
              for (int i = 0; i < count; ++i) {
                angles(a.position_offset + t0 + i, inv_freq.data(), half, rope_f, row_c + i * half, row_s + i * half);
                for (int c = 0; c < half; ++c) cos_t[c * kTile + i] = row_c[i * half + c], sin_t[c * kTile + i] = row_s[i * half + c];
              }
            }
#endif
          } else if (!runs.fill(a.position_offset + t0, count, rope_f, cos_t, sin_t)) {
            for (int i = 0; i < count; ++i)
              angles(a.position_offset + t0 + i, inv_freq.data(), half, rope_f, cos_t + i * half, sin_t + i * half);
          }
          for (int64_t b = 0; b < B; ++b)
            for (int64_t hkv = 0; hkv < Hkv; ++hkv) one_tile(t0, count, b, hkv);
        }
      } else {  // head-major: a kv head's codes and scales are a few long streams the prefetchers follow
        for (int64_t b = 0; b < B; ++b)
          for (int64_t hkv = 0; hkv < Hkv; ++hkv)
            for (int64_t t0 = t_begin; t0 < t_end; t0 += kTile) one_tile(t0, tile_count(t0), b, hkv);
      }
      if (task != n_chunks - 1) continue;
      // The side store: full-precision entries outside [body_start, body_end), gathered into tiles
      // of up to kTile readable entries (one at a time cost a tenth of a 2k-token step's attention).
      for (int64_t b = 0; b < B; ++b)
        for (int64_t hkv = 0; hkv < Hkv; ++hkv) {
          state(n_chunks, b, hkv);
          const int64_t bh = b * Hkv + hkv;
          const float* qg = q_data + (b * Hq + hkv * n_heads) * D;
          int count = 0;
          auto flush = [&] {
            if (count == 0) return;
            score_rows(qg, nh, dk, count, ktile, scores);
            if (mask_scores(scores, nh, count, visible, kTile, scale_f, softcap_f, best_of))
              for (int h = 0; h < nh; ++h) {
                if (best_of[h] == kNegInf) continue;
                const float correction = softmax_step(scores + h * kTile, count, best_of[h], parts[h], probs);
                accumulate(parts[h].acc, correction, probs, dv, vtile, count, dv);
              }
            count = 0;
          };
          for (int64_t s = 0; s < S; ++s) {
            const int64_t p = pos[s];
            if (p < 0 || (p >= body_start && p < hi)) continue;
            bool seen = false;
            for (int64_t h = 0; h < n_heads; ++h) {
              visible[h * kTile + count] = mask_data[b * m_b + (hkv * n_heads + h) * m_h + p * m_t];
              seen = seen || visible[h * kTile + count];
            }
            if (!seen) continue;
            float* krow = ktile + count * kRow;
            load_floats(side_k.bytes() + (bh * S + s) * D * dtype_size(side_k.dtype), side_k.dtype, D, krow);
            load_floats(side_v.bytes() + (bh * S + s) * Dv * dtype_size(side_v.dtype), side_v.dtype, Dv, vtile + count * kRow);
            if (pre_rope) {
              angles(a.position_offset + p, inv_freq.data(), half, rope_f, cos_t, sin_t);
              rotate_row(krow, cos_t, sin_t, dk);
            }
            if (++count == kTile) flush();
          }
          flush();
          save(n_chunks, b, hkv);
        }
    }
  });

  // Merge the tasks' partial softmaxes (log-sum-exp); rows that saw nothing stay zero.
  for (int64_t row = 0; row < rows; ++row) {
    float* o = out + row * Dv;
    std::fill(o, o + Dv, 0.f);
    float best = kNegInf;
    for (int64_t t = 0; t < slots; ++t) best = std::max(best, maxes[t * rows + row]);
    if (lse) lse[row] = kNegInf;
    if (best == kNegInf) continue;
    float total = 0.f;
    for (int64_t t = 0; t < slots; ++t) {
      const float m = maxes[t * rows + row];
      if (m == kNegInf) continue;
      const float w = std::exp(m - best);
      total += w * sums[t * rows + row];
      const float* acc_t = acc.data() + (t * rows + row) * Dv;
      for (int64_t c = 0; c < Dv; ++c) o[c] += w * acc_t[c];
    }
    for (int64_t c = 0; c < Dv; ++c) o[c] /= total;
    if (lse) lse[row] = best + std::log(total);
  }
}

}  // namespace kvq_core
