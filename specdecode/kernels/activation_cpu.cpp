// SwiGLU's activation, silu(g) * u, in float32. The native decoder layers apply it to each 16-channel unit of
// gate and up as soon as a thread has computed both, and model.py's loop calls the same function on the CPU, so
// the two give the same bits. Each value by one fixed sequence of operations, lane by lane: a row's values never
// depend on the other rows or on which thread computes them.
#include "aten_lite.h"
#include <immintrin.h>

#include "kernels.h"
#include "simd.h"

namespace {

// silu(x) = x * sigmoid(x), with sigmoid from t = exp(-|x|) (in (0, 1]: exp8's range, no overflow): 1 / (1 + t)
// for x >= 0, t / (1 + t) below.
inline __m256 silu8(__m256 x) {
  const __m256 magnitude = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
  const __m256 t = specdecode::exp8(_mm256_sub_ps(_mm256_setzero_ps(), magnitude));
  const __m256 one = _mm256_set1_ps(1.f);
  const __m256 numerator = _mm256_blendv_ps(one, t, x);  // the sign bit of x picks t
  return _mm256_mul_ps(x, _mm256_div_ps(numerator, _mm256_add_ps(one, t)));
}

}  // namespace

void silu_mul_rows(float* g, const float* u, int64_t M, int64_t N, int64_t c0, int64_t c1) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = c0; c < c1; c += 8) {
      float* gp = g + m * N + c;
      _mm256_storeu_ps(gp, _mm256_mul_ps(silu8(_mm256_loadu_ps(gp)), _mm256_loadu_ps(u + m * N + c)));
    }
}

at::Tensor silu_mul_(at::Tensor& g, const at::Tensor& u) {
  TORCH_CHECK(g.scalar_type() == at::kFloat && u.scalar_type() == at::kFloat && g.is_contiguous() &&
                  u.is_contiguous() && g.sizes() == u.sizes(),
              "silu_mul_: g and u contiguous float32 of one shape");
  const int64_t N = g.size(-1), M = g.numel() / std::max<int64_t>(N, 1);
  TORCH_CHECK(N % 8 == 0, "silu_mul_: the last dimension must be a multiple of 8");
  silu_mul_rows(g.data_ptr<float>(), u.data_ptr<float>(), M, N, 0, N);
  return g;
}
