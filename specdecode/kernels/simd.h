// AVX2 helpers shared by the CPU kernels. The fixed horizontal sum is part of their batch-invariance contract:
// every reduction ends with this one sequence of adds.
#pragma once
#include <immintrin.h>

#include <cstdint>

namespace specdecode {

// Eight bfloat16 values (the upper halves of float32) widened to float32.
inline __m256 load_bf16x8(const uint16_t* p) {
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// The one fixed horizontal sum of eight lanes.
inline float lane_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));  // lanes i + (i + 4)
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));                                          // + (i + 2)
  s = _mm_add_ss(s, _mm_movehdup_ps(s));                                           // + (i + 1)
  return _mm_cvtss_f32(s);
}

}  // namespace specdecode
