// RMSNorm over the last dimension, float32: y = w * (x * (1 / sqrt(mean(x^2) + eps))). One call replaces the
// seven small tensor operations of the eager formula (most of a one-token step's framework overhead is in such
// operations). Each row is reduced in one fixed order (eight lanes, then the fixed horizontal sum), whatever the
// number of rows, so rows stay bit-identical to one-row calls.
#include "aten_lite.h"
#include <immintrin.h>

#include <cmath>

#include "simd.h"

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be contiguous float32");
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous(), "weight must be float32");
  const int64_t D = x.size(-1), M = x.numel() / D;
  TORCH_CHECK(D % 8 == 0 && weight.numel() == D, "the last dimension must match the weight, a multiple of 8");
  auto y = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, M, std::max<int64_t>(1, 65536 / D), [&](int64_t first, int64_t last) {
    for (int64_t m = first; m < last; ++m) {
      const float* row = xp + m * D;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 v = _mm256_loadu_ps(row + d);
        acc = _mm256_fmadd_ps(v, v, acc);
      }
      const float scale = 1.f / std::sqrt(specdecode::lane_sum(acc) / static_cast<float>(D) + feps);
      const __m256 s = _mm256_set1_ps(scale);
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(row + d), s);
        _mm256_storeu_ps(yp + m * D + d, _mm256_mul_ps(_mm256_loadu_ps(wp + d), v));
      }
    }
  });
  return y;
}
