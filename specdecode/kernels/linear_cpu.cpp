// Float-weight linear layer for CPUs with AVX2 + FMA: y[M, N] = x[M, K] @ W[N, K]^T, x and y float32.
// (Quantized weights run on quant_cpu.cpp's integer kernels.)
//
// Two properties the engine needs and stock kernels lack on such CPUs:
//  * Flat in M. Decoding is memory-bound: each weight is read from memory and decoded to float32 in a register
//    once per tile of up to six activation rows, then used for all of them. Verifying k draft tokens (M = k + 1)
//    costs far less than k + 1 one-token forwards (on a 2-core AVX2 CPU, M = 5 costs ~1.5x M = 1), which is what
//    makes speculation pay.
//  * Batch-invariant. Every output y[m, n] is reduced in one fixed order (eight float32 lanes along K, then a fixed
//    horizontal sum), whatever M is, whichever tile row m falls in and however rows are split across threads. So a
//    verify forward produces bit for bit the numbers a one-token forward would, and speculative greedy output is
//    token-identical to plain decoding.
//
// Where the CPU has AVX-512 and K is a multiple of 16 the same tiles run sixteen lanes wide (block16).
//
// Weight formats: fp32, float32 [N, K]; bf16, uint16 [N, K], the upper half of a float32; f16, IEEE half [N, K]
// (F16C widens it exactly).
#include "aten_lite.h"
#include <immintrin.h>

#include <algorithm>
#include <type_traits>

#include "simd.h"

namespace {

using specdecode::lane_sum;
using specdecode::load_bf16x8;

constexpr int kMaxTile = 6;

enum class Format { fp32, bf16, f16 };

struct Weights {
  Format format;
  const void* data;
  int64_t K;
};

// Eight weights w[n, k .. k + 8) as float32 in a register.
template <Format F>
inline __m256 decode8(const Weights& w, int64_t n, int64_t k) {
  if constexpr (F == Format::fp32) {
    return _mm256_loadu_ps(static_cast<const float*>(w.data) + n * w.K + k);
  } else if constexpr (F == Format::bf16) {
    return load_bf16x8(static_cast<const uint16_t*>(w.data) + n * w.K + k);
  } else {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(w.data) + n * w.K + k)));
  }
}

// y[m, n0 + r] for TILE activation rows and ROWS weight rows, each weight register decoded once for the tile.
// acc[m][r] lane l sums k = l (mod 8) in increasing k: the same chain for every tile shape, hence invariance.
template <Format F, int TILE, int ROWS>
void tile(const float* x, const Weights& w, float* y, int64_t N, int64_t n0) {
  const int64_t K = w.K;
  __m256 acc[TILE][ROWS];
  for (int m = 0; m < TILE; ++m)
    for (int r = 0; r < ROWS; ++r) acc[m][r] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[ROWS];
    for (int r = 0; r < ROWS; ++r) wv[r] = decode8<F>(w, n0 + r, k);
    for (int m = 0; m < TILE; ++m) {
      __m256 xv = _mm256_loadu_ps(x + m * K + k);
      for (int r = 0; r < ROWS; ++r) acc[m][r] = _mm256_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < TILE; ++m)
    for (int r = 0; r < ROWS; ++r) {
      y[m * N + n0 + r] = lane_sum(acc[m][r]);
    }
}

// f(std::integral_constant<int, T>{}) for the tile height T = tile_rows (1 .. kMaxTile): the kernels are
// instantiated per height, so that every accumulator stays in a register.
template <typename Fn>
void with_height(int tile_rows, Fn&& f) {
  switch (tile_rows) {
    case 1: return f(std::integral_constant<int, 1>{});
    case 2: return f(std::integral_constant<int, 2>{});
    case 3: return f(std::integral_constant<int, 3>{});
    case 4: return f(std::integral_constant<int, 4>{});
    case 5: return f(std::integral_constant<int, 5>{});
    default: return f(std::integral_constant<int, 6>{});
  }
}

// Any tile height up to kMaxTile. block() keeps TILE * ROWS accumulators + ROWS weights + one activation within
// the 16 ymm registers: four weight rows only for tiles of one or two activation rows.
template <Format F, int ROWS>
void tile_any(int tile_rows, const float* x, const Weights& w, float* y, int64_t N, int64_t n0) {
  with_height(tile_rows, [&](auto height) { tile<F, decltype(height)::value, ROWS>(x, w, y, N, n0); });
}

// All M rows for weight rows [n0, n0 + 4): at most two activation rows with four weight rows, more with two.
template <Format F>
void block(const float* x, int64_t M, const Weights& w, float* y, int64_t N, int64_t n0) {
  const int rows = static_cast<int>(std::min<int64_t>(4, N - n0));
  for (int64_t m = 0; m < M; m += kMaxTile) {
    const int t = static_cast<int>(std::min<int64_t>(kMaxTile, M - m));
    const float* xm = x + m * w.K;
    float* ym = y + m * N;
    if (rows == 4 && t <= 2) {
      tile_any<F, 4>(t, xm, w, ym, N, n0);
    } else if (rows == 4) {  // wider tiles take two weight rows at a time
      tile_any<F, 2>(t, xm, w, ym, N, n0);
      tile_any<F, 2>(t, xm, w, ym, N, n0 + 2);
    } else {
      for (int r = 0; r < rows; ++r) tile_any<F, 1>(t, xm, w, ym, N, n0 + r);
    }
  }
}

#if defined(__AVX512F__)
// The same kernel sixteen lanes wide, where the CPU has AVX-512 and K is a multiple of 16: half the instructions a
// weight, and four weight rows for tiles of up to six activation rows (32 registers). A layer takes one of the two
// paths for every row count (K decides), so rows stay invariant; the reduction order is the wide path's own.
template <Format F>
inline __m512 decode16(const Weights& w, int64_t n, int64_t k) {
  if constexpr (F == Format::fp32) {
    return _mm512_loadu_ps(static_cast<const float*>(w.data) + n * w.K + k);
  } else {
    const __m256i halves =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(w.data) + n * w.K + k));
    if constexpr (F == Format::bf16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
    else return _mm512_cvtph_ps(halves);
  }
}

template <Format F>
inline const char* row_bytes(const Weights& w, int64_t n, int64_t k) {
  constexpr int64_t size = F == Format::fp32 ? 4 : 2;
  return static_cast<const char*>(w.data) + (n * w.K + k) * size;
}

// The one fixed horizontal sum of sixteen lanes: the upper eight added onto the lower, then lane_sum.
inline float lane_sum16(__m512 v) {
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
  return lane_sum(_mm256_add_ps(_mm512_castps512_ps256(v), hi));
}

template <Format F, int TILE, int ROWS>
void tile16(const float* x, const Weights& w, float* y, int64_t N, int64_t n0) {
  constexpr int64_t kAhead = 1024;  // bytes ahead of the loads that each weight row is asked for
  const int64_t K = w.K;
  __m512 acc[TILE][ROWS];
  for (int m = 0; m < TILE; ++m)
    for (int r = 0; r < ROWS; ++r) acc[m][r] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    __m512 wv[ROWS];
    for (int r = 0; r < ROWS; ++r) {
      specdecode::prefetch_weights(row_bytes<F>(w, n0 + r, k) + kAhead);
      wv[r] = decode16<F>(w, n0 + r, k);
    }
    for (int m = 0; m < TILE; ++m) {
      const __m512 xv = _mm512_loadu_ps(x + m * K + k);
      for (int r = 0; r < ROWS; ++r) acc[m][r] = _mm512_fmadd_ps(xv, wv[r], acc[m][r]);
    }
  }
  for (int m = 0; m < TILE; ++m)
    for (int r = 0; r < ROWS; ++r) y[m * N + n0 + r] = lane_sum16(acc[m][r]);
}

template <Format F, int ROWS>
void tile16_any(int tile_rows, const float* x, const Weights& w, float* y, int64_t N, int64_t n0) {
  with_height(tile_rows, [&](auto height) { tile16<F, decltype(height)::value, ROWS>(x, w, y, N, n0); });
}

template <Format F>
void block16(const float* x, int64_t M, const Weights& w, float* y, int64_t N, int64_t n0) {
  const int rows = static_cast<int>(std::min<int64_t>(4, N - n0));
  for (int64_t m = 0; m < M; m += kMaxTile) {
    const int t = static_cast<int>(std::min<int64_t>(kMaxTile, M - m));
    if (rows == 4) {
      tile16_any<F, 4>(t, x + m * w.K, w, y + m * N, N, n0);
    } else {
      for (int r = 0; r < rows; ++r) tile16_any<F, 1>(t, x + m * w.K, w, y + m * N, N, n0 + r);
    }
  }
}
constexpr bool kWide = true;
#else
template <Format F>
void block16(const float*, int64_t, const Weights&, float*, int64_t, int64_t) {}
constexpr bool kWide = false;
#endif

at::Tensor run(const at::Tensor& x, const Weights& w, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [M, K] float32");
  TORCH_CHECK(x.size(1) == w.K && w.K % 8 == 0, "K must match the weights and be a multiple of 8");
  const int64_t M = x.size(0);
  auto y = at::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const bool wide = kWide && w.K % 16 == 0;  // the layer's path, the same for every M
  at::parallel_for(0, (N + 3) / 4, 16, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      switch (w.format) {
        case Format::fp32:
          wide ? block16<Format::fp32>(xp, M, w, yp, N, 4 * b) : block<Format::fp32>(xp, M, w, yp, N, 4 * b);
          break;
        case Format::bf16:
          wide ? block16<Format::bf16>(xp, M, w, yp, N, 4 * b) : block<Format::bf16>(xp, M, w, yp, N, 4 * b);
          break;
        case Format::f16:
          wide ? block16<Format::f16>(xp, M, w, yp, N, 4 * b) : block<Format::f16>(xp, M, w, yp, N, 4 * b);
          break;
      }
    }
  });
  return y;
}


}  // namespace

at::Tensor linear_fp32(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kFloat && weight.is_contiguous(), "weight must be float32 [N, K]");
  return run(x, {Format::fp32, weight.data_ptr(), weight.size(1)}, weight.size(0));
}

at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(), "weight must be bfloat16 [N, K]");
  return run(x, {Format::bf16, weight.data_ptr(), weight.size(1)}, weight.size(0));
}

at::Tensor linear_f16(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kHalf && weight.is_contiguous(), "weight must be float16 [N, K]");
  return run(x, {Format::f16, weight.data_ptr(), weight.size(1)}, weight.size(0));
}
