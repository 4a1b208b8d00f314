// bfloat16 weights on AMX tiles: y[M, N] = x[M, K] @ W[N, K]^T + b, x rounded to bfloat16 (to nearest, ties to
// even, as llama.cpp's and torch's bfloat16 matrix products round their inputs), products summed in float32.
//
// linear_cpu.cpp widens each weight to float32 and multiplies on the vector units: a one-token forward reached ~2/3
// of the memory's speed there, and a verify forward of 8 rows cost 2.6x one row. A tile product (TDPBF16PS) takes
// 16 rows x 32 weights x 16 channels at once, so up to 16 rows cost what one row does: a decode step reads the
// weights at the memory's speed, and a verify forward's extra rows are nearly free.
//
// One path for every row count: a row's outputs are its tile products over K in one fixed order (32 weights a
// product, C += A B), and a tile computes each of its rows from that row alone. So every row of a verify forward is
// bit for bit what a one-token forward gives, and speculative output equals plain decoding. Where this does not run
// (no AMX, or SPECDECODE_AMX=0 when the model loads) the layer stays on linear_cpu.cpp for every row count.
//
// Layout (bf16_tiles in quantize.py, once at load): unit u = output channels [16 u, 16 u + 16); its K / 32 B tiles
// in order of k, each [16 pairs (k, k + 1)][16 channels][2]: the pair layout the tile product reads. A unit's
// weights are contiguous, K * 32 bytes, so a thread streams them in order.
#include "aten_lite.h"
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "kernels.h"
#include "simd.h"

namespace {

constexpr int64_t kActsKey = -16;  // QuantizedActs' entry for bfloat16 rows (the integer formats use their group)
constexpr int64_t kAheadBytes = 4096;  // how far ahead of the tile products a unit's weights are asked for

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512F__)
constexpr bool kBuilt = true;

// Every tile 16 rows of 64 bytes: A [16 rows, 32 bf16], B [16 pairs, 16 channels x 2 bf16], C [16 rows, 16 float].
void configure() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
}

// x [M, K] float32 -> out [Mp, K] bfloat16, Mp = M up to a multiple of 16, the rows past M zero.
void round_rows(const float* x, int64_t M, int64_t Mp, int64_t K, uint16_t* out) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; k += 32) {
      const __m512 lo = _mm512_loadu_ps(x + m * K + k), hi = _mm512_loadu_ps(x + m * K + k + 16);
      _mm512_storeu_si512(out + m * K + k, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
    }
  std::memset(out + M * K, 0, static_cast<size_t>((Mp - M) * K) * sizeof(uint16_t));
}

// Tile t of a unit's weights at b, kAheadBytes on: asked for before the products reach it.
inline void ask_ahead(const uint16_t* b, int64_t t) {
  const char* ahead = reinterpret_cast<const char*>(b + t * 512) + kAheadBytes;
  for (int line = 0; line < 1024; line += 64) specdecode::prefetch_weights(ahead + line);
}

// Rows [m0, m0 + 16) of units u and u + 1 (PAIR) or u alone, into `c` (row stride ldc floats, 16 per unit).
template <bool PAIR>
void unit_rows(const uint16_t* a, const uint16_t* w, int64_t K, int64_t u, int64_t m0, float* c, int64_t ldc) {
  const int64_t depth = K / 32, unit = K * 16;  // tiles a unit; bf16 values a unit
  const uint16_t* b0 = w + u * unit;
  const uint16_t* b1 = b0 + unit;
  const uint16_t* rows = a + m0 * K;
  _tile_zero(0);
  if constexpr (PAIR) _tile_zero(1);
  for (int64_t t = 0; t < depth; ++t) {
    ask_ahead(b0, t);
    if constexpr (PAIR) ask_ahead(b1, t);
    _tile_loadd(2, rows + t * 32, K * 2);
    _tile_loadd(3, b0 + t * 512, 64);
    _tile_dpbf16ps(0, 2, 3);
    if constexpr (PAIR) {
      _tile_loadd(4, b1 + t * 512, 64);
      _tile_dpbf16ps(1, 2, 4);
    }
  }
  _tile_stored(0, c, ldc * 4);
  if constexpr (PAIR) _tile_stored(1, c + 16, ldc * 4);
}

// Rows [m0, m0 + 32) of units u and u + 1, straight into y: four sums, each A and B tile loaded once for two
// products (a prompt's chunk: the tiles' loads, not their products, bounded the two-tile loop). Each sum runs over
// k in the same order as unit_rows: the same bits.
void quad_rows(const uint16_t* a, const uint16_t* w, int64_t K, int64_t u, int64_t m0, float* y, int64_t N) {
  const int64_t depth = K / 32, unit = K * 16;
  const uint16_t* b0 = w + u * unit;
  const uint16_t* b1 = b0 + unit;
  const uint16_t* r0 = a + m0 * K;
  const uint16_t* r1 = r0 + 16 * K;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t t = 0; t < depth; ++t) {
    ask_ahead(b0, t);
    ask_ahead(b1, t);
    _tile_loadd(4, r0 + t * 32, K * 2);
    _tile_loadd(5, r1 + t * 32, K * 2);
    _tile_loadd(6, b0 + t * 512, 64);
    _tile_loadd(7, b1 + t * 512, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  float* c = y + m0 * N + u * 16;
  _tile_stored(0, c, N * 4);
  _tile_stored(1, c + 16, N * 4);
  _tile_stored(2, c + 16 * N, N * 4);
  _tile_stored(3, c + 16 * N + 16, N * 4);
}

// Units [first, last) for all M rows of y [M, N]; a last partial block of rows goes through `spill`.
void run_units_tiles(const uint16_t* a, const uint16_t* w, int64_t M, int64_t K, int64_t N, float* y,
                     const float* bias, int64_t first, int64_t last) {
  configure();
  alignas(64) float spill[16 * 32];
  const int64_t whole = M / 16 * 16;
  for (int64_t u = first; u < last;) {
    const bool pair = u + 1 < last;
    int64_t m0 = 0;
    if (pair)
      for (; m0 + 32 <= whole; m0 += 32) quad_rows(a, w, K, u, m0, y, N);
    for (; m0 < M; m0 += 16) {
      float* c = m0 < whole ? y + m0 * N + u * 16 : spill;
      const int64_t ldc = m0 < whole ? N : 32;
      pair ? unit_rows<true>(a, w, K, u, m0, c, ldc) : unit_rows<false>(a, w, K, u, m0, c, ldc);
      if (m0 >= whole)
        for (int64_t m = m0; m < M; ++m)
          std::memcpy(y + m * N + u * 16, spill + (m - m0) * 32, (pair ? 32 : 16) * sizeof(float));
    }
    const int64_t units = pair ? 2 : 1;
    if (bias != nullptr)  // one float add per output after the product, as the other kernels add it
      for (int64_t m = 0; m < M; ++m)
        for (int64_t n = u * 16; n < (u + units) * 16; ++n) y[m * N + n] += bias[n];
    u += units;
  }
  _tile_release();
}

// Floating-point operations a second of back-to-back tile products on tiles already loaded, every thread of the
// team at once: this machine's bfloat16 peak, what a prompt's forward is measured against (profile_step.py).
double tile_peak(int64_t products) {
  const int64_t threads = at::get_num_threads();
  const auto began = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    alignas(64) static const uint16_t zeros[16 * 32] = {};
    configure();
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    _tile_loadd(4, zeros, 64);
    _tile_loadd(5, zeros, 64);
    _tile_loadd(6, zeros, 64);
    _tile_loadd(7, zeros, 64);
    for (int64_t i = 0; i < products; i += 4) {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_release();
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
  return static_cast<double>(threads) * static_cast<double>(products) * 16 * 16 * 32 * 2 / seconds;
}
#else
double tile_peak(int64_t) { return 0.0; }
constexpr bool kBuilt = false;
void round_rows(const float*, int64_t, int64_t, int64_t, uint16_t*) {}
void run_units_tiles(const uint16_t*, const uint16_t*, int64_t, int64_t, int64_t, float*, const float*, int64_t,
                     int64_t) {}
#endif

}  // namespace

bool bf16_tiles_on() { return kBuilt && amx_on(); }

double bf16_tile_peak_flops(int64_t products) { return bf16_tiles_on() ? tile_peak(products) : 0.0; }

LinearWork linear_bf16_tiles_work(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& bias,
                                  QuantizedActs& acts) {
  TORCH_CHECK(kBuilt && amx_on(), "bfloat16 tiles need AMX (built with it, granted by the system, not turned off)");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [M, K] float32");
  TORCH_CHECK(tiles.dim() == 5 && tiles.scalar_type() == at::kBFloat16 && tiles.is_contiguous() &&
                  tiles.size(2) == 16 && tiles.size(3) == 16 && tiles.size(4) == 2,
              "tiles must be [N / 16, K / 32, 16, 16, 2] bfloat16 (quantize.bf16_tiles)");
  const int64_t M = x.size(0), K = tiles.size(1) * 32, units = tiles.size(0), N = units * 16;
  TORCH_CHECK(x.size(1) == K, "x has ", x.size(1), " columns, the weight ", K);
  TORCH_CHECK(!bias.numel() || (bias.numel() == N && bias.scalar_type() == at::kFloat && bias.is_contiguous()),
              "bias must be float32 with one value per output");
  auto& rounded = acts.by_format[kActsKey];  // rounded once for every layer of a group that reads x
  if (rounded.empty()) {
    const int64_t Mp = (M + 15) / 16 * 16;
    rounded = {at::empty({Mp, K}, x.options().dtype(at::kBFloat16))};
    round_rows(x.data_ptr<float>(), M, Mp, K, reinterpret_cast<uint16_t*>(rounded[0].data_ptr()));
  }
  auto y = at::empty({M, N}, x.options());
  const auto* a = reinterpret_cast<const uint16_t*>(rounded[0].data_ptr());
  const auto* w = reinterpret_cast<const uint16_t*>(tiles.data_ptr());
  float* yp = y.data_ptr<float>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  LinearWork work;
  work.units = units;
  // the tensors behind a and w are held by the caller (the rounded rows by `acts`) until the work is done
  work.run = [a, w, M, K, N, yp, bp](int64_t first, int64_t last) {
    run_units_tiles(a, w, M, K, N, yp, bp, first, last);
  };
  work.done = [y] { return y; };
  work.y = yp, work.rows = M, work.cols = N;
  return work;
}

at::Tensor linear_bf16_tiles(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& bias) {
  QuantizedActs acts;
  return run_alone(linear_bf16_tiles_work(x, tiles, bias, acts));
}
