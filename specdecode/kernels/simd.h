// AVX2 helpers shared by the CPU kernels. The fixed horizontal sum is part of their batch-invariance contract:
// every reduction ends with this one sequence of adds.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace specdecode {

// Prefetch helpers are always inlined: GCC 12 takes a function that only prefetches for one without effects and
// drops its calls. Mark any function made of prefetches alone with this.
#define SPECDECODE_PREFETCHES __attribute__((always_inline)) inline

// Ask for the cache line at p, weights read once per forward, with the hint the build chose for this CPU's
// maker (kernels/__init__.py, prefetch_hint): non-temporal on AMD, into L2 on Intel.
#ifndef SPECDECODE_PREFETCH_HINT
#define SPECDECODE_PREFETCH_HINT _MM_HINT_NTA
#endif
SPECDECODE_PREFETCHES void prefetch_weights(const void* p) {
  _mm_prefetch(static_cast<const char*>(p), SPECDECODE_PREFETCH_HINT);
}

// Eight bfloat16 values (the upper halves of float32) widened to float32.
inline __m256 load_bf16x8(const uint16_t* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// Four int8 values at p, repeated in every 32-bit lane.
inline __m256i broadcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

// Four bytes at p as one word (byte i of p in bits 8 i .. 8 i + 7, x86 being little-endian), and back: a repack
// moves four bytes of one channel at a time.
inline uint32_t load_word(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}
inline void store_word(uint8_t* p, uint32_t v) { std::memcpy(p, &v, 4); }

// The eight bits of b spread over eight bytes: byte t of the result is bit t of b.
inline uint64_t spread_bits(uint8_t b) {
  static const auto table = [] {
    struct Table {
      uint64_t v[256];
    } t{};
    for (int b = 0; b < 256; ++b)
      for (int bit = 0; bit < 8; ++bit) t.v[b] |= static_cast<uint64_t>((b >> bit) & 1) << (8 * bit);
    return t;
  }();
  return table.v[b];
}

// An empty barrier on v: the compiler must treat it as computed here. A running sum of vpmaddubsw products,
// otherwise re-associated into a tree, kept every product of a sub-block live at once and spilled them to the
// stack (AVX2 has 16 vector registers).
inline void pin(__m256i& v) { asm("" : "+x"(v)); }

// The one fixed horizontal sum of eight lanes.
inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // lanes i + (i + 4)
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                          // + (i + 2)
  s = _mm_add_ss(s, _mm_movehdup_ps(s));                                           // + (i + 1)
  return _mm_cvtss_f32(s);
}

// x[0, n) -> int8 codes round(x / scale) with scale = amax / 127 (0 for a block of zeros): the one activation
// rounding of every integer kernel, so that any of them computes the same model. Returns the scale. Eight lanes
// at a time where n allows: the maximum is exact in any order, and the product and the rounding (to nearest,
// ties to even, as nearbyint in the default mode) are the scalar ones lane by lane, so the codes are the same.
inline float quantize_block(const float* x, int64_t n, int8_t* q) {
  if (n % 8 != 0) {
    float amax = 0.f;
    for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(x[i]));
    const float scale = amax / 127.f, inv = scale > 0.f ? 1.f / scale : 0.f;
    for (int64_t i = 0; i < n; ++i) q[i] = static_cast<int8_t>(std::nearbyint(x[i] * inv));
    return scale;
  }
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  __m256 top = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) top = _mm256_max_ps(top, _mm256_and_ps(_mm256_loadu_ps(x + i), magnitude));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  const float scale = _mm_cvtss_f32(m) / 127.f, inv = scale > 0.f ? 1.f / scale : 0.f;
  const __m256 vinv = _mm256_set1_ps(inv);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 rounded = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), vinv),
                                           _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i codes = _mm256_cvtps_epi32(rounded);  // exact: already whole numbers in [-127, 127]
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(q + i), _mm_packs_epi16(words, words));
  }
  return scale;
}

// The row's largest value; `nan` set when it holds a NaN (then the largest value means nothing).
inline float row_max(const float* x, int64_t V, bool& nan) {
  int64_t i = 0;
  float best = -INFINITY;
#if defined(__AVX512F__)
  __m512 top[4];
  for (auto& t : top) t = _mm512_set1_ps(-INFINITY);
  __mmask16 unordered = 0;
  for (; i + 64 <= V; i += 64)
    for (int c = 0; c < 4; ++c) {
      const __m512 v = _mm512_loadu_ps(x + i + 16 * c);
      unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      top[c] = _mm512_max_ps(top[c], v);
    }
  for (; i + 16 <= V; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    unordered |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    top[0] = _mm512_max_ps(top[0], v);
  }
  best = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(top[0], top[1]), _mm512_max_ps(top[2], top[3])));
  nan = unordered != 0;
#else
  __m256 top[4];
  for (auto& t : top) t = _mm256_set1_ps(-INFINITY);
  __m256 unordered = _mm256_setzero_ps();
  for (; i + 32 <= V; i += 32)
    for (int c = 0; c < 4; ++c) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * c);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      top[c] = _mm256_max_ps(top[c], v);
    }
  for (; i + 8 <= V; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    top[0] = _mm256_max_ps(top[0], v);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(top[0], top[1]), _mm256_max_ps(top[2], top[3])));
  for (float lane : lanes) best = std::max(best, lane);
  nan = _mm256_movemask_ps(unordered) != 0;
#endif
  for (; i < V; ++i) {
    nan = nan || std::isnan(x[i]);
    best = std::max(best, x[i]);
  }
  return best;
}

// exp(x) of eight lanes, for x <= 0 (softmax after subtracting the maximum): exp(x) = 2^n exp(r), r = x - n ln 2,
// exp(r) by a degree-7 polynomial; within ~2 ulp of expf. Lane by lane, so a row's weights do not depend on
// where its scores sit in a vector.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));  // below this expf is denormal or 0: 2^-126 is close enough to 0
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts: r stays exact
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

}  // namespace specdecode
