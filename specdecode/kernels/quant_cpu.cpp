// Quantized linear layer: y[M, N] = x[M, K] @ W[N, K]^T with W in GGUF-style blocks and x quantized per row to
// int8, multiplied with integer dot products: 64 weights per instruction with AVX-512 VNNI, else 32 (AVX-VNNI,
// or AVX2's vpmaddubsw).
//
// Weight layout (blocks.py builds it from a GGUF file or a float tensor, one layout for every block type):
//   codes, unsigned, BITS = 4, 5 or 6: `qs` uint8 [N, K / 2] in runs of R codes, byte j of a run = code[j] |
//     code[j + R / 2] << 4, R = 32 for 32-weight blocks, 128 for the k-quants (one 64-byte load = 128 codes);
//     the high bits as bit planes along the row: `qh` uint8 [N, BITS - 4, K / 8], bit k of plane p = bit 4 + p
//     of code k (so any 64 consecutive codes' high bits are one 64-bit mask).
//   codes, signed, BITS = 8: `qs` int8 [N, K].
//   superblocks of S = 32 or 256 weights along K: `d`, `dmin` float16 [N, K / S];
//   optional sub-blocks of G = 16 or 32 weights: `scales`, `mins` int8 [N, K / G].
//   w = d * scale * code - dmin * min   (no sub-blocks: scale = min = 1; no `dmin`: no min term)
// Activations are quantized in the same superblocks: xd = amax / 127, xq = round(x / xd), plus sums of xq per 16.
//
// Per output: y[m, n] = sum over superblocks of xd * (d * sum_g scale_g * dot_g - dmin * sum_g min_g * xsum_g).
// Integer sums are exact; float sums run in one fixed order (vector lanes, then a fixed horizontal sum) whatever
// M is and whichever tile row m falls in. So a verify forward gives bit for bit the numbers of one-token forwards,
// and each weight group is decoded once per tile of activation rows (flat-ish in M).
//
// Work per 256 weights and activation row (the cost of every extra row in a verify forward): K-quants load,
// multiply-accumulate and scale 4 (AVX-512) or 8 vectors, plus one vpmaddwd for all the min terms at once.
#include "aten_lite.h"
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>

#include "simd.h"

namespace {

using specdecode::lane_sum;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define SPECDECODE_ZMM 1
constexpr int kStep = 64;  // weights per vector step
constexpr int kMaxTile = 8;
#else
constexpr int kStep = 32;
constexpr int kMaxTile = 4;  // 16 vector registers: an accumulator and an integer sum per row, plus temporaries
#endif
constexpr int64_t kRowBlock = 16;  // weight rows per work item: their blocks stay in L1 while every tile passes

struct QuantWeight {
  int bits, S, G;
  const uint8_t* qs;
  const uint8_t* qh;
  const int8_t* scales;
  const int8_t* mins;
  const uint16_t* d;
  const uint16_t* dmin;
  int64_t K;
};

struct QuantActs {
  const int8_t* q;      // [M, K]
  const float* d;       // [M, K / S]
  const int16_t* sums;  // [M, K / 16]
};

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// ---- 32 weights at a time (every x86-64 CPU with AVX2) -------------------------------------------------------

// u8 x s8 products, four adjacent pairs summed into each of eight int32 lanes (lane i: bytes 4i .. 4i + 3).
inline __m256i dot32(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else  // no int16 saturation: codes < 64 and |xq| <= 127, or |code| <= 128 for the signed 8-bit form
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// 32 bits -> 32 bytes, byte i = `value` where bit i is set, else 0.
inline __m256i bits_to_bytes(uint32_t bits, int8_t value) {
  const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)),
                                             _mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL,
                                                                0x0303030303030303LL));
  const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
  return _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit), _mm256_set1_epi8(value));
}

inline uint32_t plane32(const QuantWeight& w, int64_t n, int plane, int64_t k) {
  uint32_t h;
  std::memcpy(&h, w.qh + (n * (w.bits - 4) + plane) * (w.K / 8) + k / 8, 4);
  return h;
}

// The 32 codes of weights k .. k + 32 of row n (k a multiple of 32), one per byte (8 bits: signed).
// RUN: codes per nibble run (see the layout above).
template <int BITS, int RUN>
inline __m256i codes32(const QuantWeight& w, int64_t n, int64_t k) {
  if constexpr (BITS == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs + n * w.K + k));
  } else {
    __m256i q;
    if constexpr (RUN == 32) {
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + n * (w.K / 2) + k / 2));
      q = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
    } else {  // run of 128: codes 0-63 in the low nibbles of its 64 bytes, 64-127 in the high ones
      const int64_t r = k % 128;
      __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs + n * (w.K / 2) + (k - r) / 2 + r % 64));
      if (r >= 64) b = _mm256_srli_epi16(b, 4);
      q = _mm256_and_si256(b, _mm256_set1_epi8(0x0F));
    }
    if constexpr (BITS >= 5) q = _mm256_or_si256(q, bits_to_bytes(plane32(w, n, 0, k), 0x10));
    if constexpr (BITS == 6) q = _mm256_or_si256(q, bits_to_bytes(plane32(w, n, 1, k), 0x20));
    return q;
  }
}

// ---- 64 weights at a time (AVX-512 VNNI) ---------------------------------------------------------------------
#ifdef SPECDECODE_ZMM
template <int BITS, int RUN>
inline __m512i codes64(const QuantWeight& w, int64_t n, int64_t k) {
  if constexpr (BITS == 8) {
    return _mm512_loadu_si512(w.qs + n * w.K + k);
  } else {
    __m512i q;
    if constexpr (RUN == 32) {  // two runs' 32 nibble bytes -> 128-bit lanes [low(g), high(g), low(g+1), high(g+1)]
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs + n * (w.K / 2) + k / 2));
      q = _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 1, 0, 1, 2, 3, 2, 3), _mm512_castsi256_si512(b));
      q = _mm512_and_si512(_mm512_mask_blend_epi64(0xCC, q, _mm512_srli_epi16(q, 4)), _mm512_set1_epi8(0x0F));
    } else {  // a run of 128: one load, low nibbles for its first 64 codes, high nibbles for the rest
      q = _mm512_loadu_si512(w.qs + n * (w.K / 2) + (k / 128) * 64);
      if (k % 128) q = _mm512_srli_epi16(q, 4);
      q = _mm512_and_si512(q, _mm512_set1_epi8(0x0F));
    }
    for (int p = 0; p < BITS - 4; ++p) {
      uint64_t h;
      std::memcpy(&h, w.qh + (n * (BITS - 4) + p) * (w.K / 8) + k / 8, 8);
      q = _mm512_or_si512(q, _mm512_maskz_mov_epi8(h, _mm512_set1_epi8(static_cast<char>(0x10 << p))));
    }
    return q;
  }
}

// Each 32-bit lane's sub-block index within a 256-weight superblock, for step j (64 weights) of G-weight blocks.
template <int G>
inline __m512i sub_index(int j) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_srli_epi32(_mm512_add_epi32(_mm512_set1_epi32(64 * j), _mm512_slli_epi32(lane, 2)), G == 32 ? 5 : 4);
}
#endif

// ---- the tile: one weight row against TILE activation rows -----------------------------------------------------

// K-quants (S = 256, G = 16 or 32 sub-scales and mins).
template <int BITS, int G, int TILE>
void tile_k(const QuantActs& a, const QuantWeight& w, float* y, int64_t N, int64_t n, int64_t m0) {
  const int64_t K = w.K, nsb = K / 256;
#ifdef SPECDECODE_ZMM
  __m512 acc[TILE];
  for (int t = 0; t < TILE; ++t) acc[t] = _mm512_setzero_ps();
#else
  __m256 acc[TILE];
  for (int t = 0; t < TILE; ++t) acc[t] = _mm256_setzero_ps();
#endif
  for (int64_t sb = 0; sb < nsb; ++sb) {
    const int8_t* sc = w.scales + n * (K / G) + sb * (256 / G);
#ifdef SPECDECODE_ZMM
    const __m512i all_scales = _mm512_cvtepi8_epi32(G == 16 ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(sc))
                                                            : _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)));
    __m512i isum[TILE];
    for (int t = 0; t < TILE; ++t) isum[t] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const int64_t k = sb * 256 + 64 * j;
      const __m512i u = codes64<BITS, 128>(w, n, k);
      const __m512i scale = _mm512_permutexvar_epi32(sub_index<G>(j), all_scales);
      for (int t = 0; t < TILE; ++t) {
        const __m512i x = _mm512_loadu_si512(a.q + (m0 + t) * K + k);
        isum[t] = _mm512_add_epi32(isum[t], _mm512_mullo_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x), scale));
      }
    }
#else
    const __m256i scales_lo = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc)));
    const __m256i scales_hi = G == 16 ? _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sc + 8)))
                                      : scales_lo;
    __m256i isum[TILE];
    for (int t = 0; t < TILE; ++t) isum[t] = _mm256_setzero_si256();
    for (int j = 0; j < 8; ++j) {
      const int64_t k = sb * 256 + 32 * j;
      const __m256i u = codes32<BITS, 128>(w, n, k);
      __m256i scale;
      if constexpr (G == 32) {
        scale = _mm256_permutevar8x32_epi32(scales_lo, _mm256_set1_epi32(j));
      } else {  // lanes 0-3: sub-block 2j, lanes 4-7: 2j + 1
        const __m256i idx = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
        scale = _mm256_permutevar8x32_epi32(j < 4 ? scales_lo : scales_hi,
                                            _mm256_add_epi32(idx, _mm256_set1_epi32((2 * j) % 8)));
      }
      for (int t = 0; t < TILE; ++t) {
        const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + (m0 + t) * K + k));
        isum[t] = _mm256_add_epi32(isum[t], _mm256_mullo_epi32(dot32(u, x), scale));
      }
    }
#endif
    // Min terms of the whole superblock in one vpmaddwd per row: mins (per 16 weights) x activation sums per 16.
    const int8_t* mn = w.mins + n * (K / G) + sb * (256 / G);
    __m256i mins16;
    if constexpr (G == 16) {
      mins16 = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(mn)));
    } else {
      const __m128i m8 = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(mn)));
      mins16 = _mm256_set_m128i(_mm_unpackhi_epi16(m8, m8), _mm_unpacklo_epi16(m8, m8));
    }
    const float d = half_to_float(w.d[n * nsb + sb]), dmin = half_to_float(w.dmin[n * nsb + sb]);
    for (int t = 0; t < TILE; ++t) {
      const float xd = a.d[(m0 + t) * nsb + sb];
      const __m256i xs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.sums + (m0 + t) * (K / 16) + sb * 16));
      const __m256 minf = _mm256_cvtepi32_ps(_mm256_madd_epi16(xs, mins16));
#ifdef SPECDECODE_ZMM
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_set1_ps(d * xd), acc[t]);
      acc[t] = _mm512_fnmadd_ps(_mm512_zextps256_ps512(minf), _mm512_set1_ps(dmin * xd), acc[t]);
#else
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_set1_ps(d * xd), acc[t]);
      acc[t] = _mm256_fnmadd_ps(minf, _mm256_set1_ps(dmin * xd), acc[t]);
#endif
    }
  }
  for (int t = 0; t < TILE; ++t) {
#ifdef SPECDECODE_ZMM
    y[(m0 + t) * N + n] = lane_sum(_mm256_add_ps(_mm512_castps512_ps256(acc[t]), _mm512_extractf32x8_ps(acc[t], 1)));
#else
    y[(m0 + t) * N + n] = lane_sum(acc[t]);
#endif
  }
}

// Legacy blocks (S = 32: Q4_0, Q4_1, Q5_0, Q5_1 with a min term; Q8_0 signed without one).
template <int BITS, bool MIN, int TILE>
void tile_legacy(const QuantActs& a, const QuantWeight& w, float* y, int64_t N, int64_t n, int64_t m0) {
  const int64_t K = w.K, nsb = K / 32;
  __m256 acc[TILE];
  for (int t = 0; t < TILE; ++t) acc[t] = _mm256_setzero_ps();
  int64_t g = 0;
#ifdef SPECDECODE_ZMM
  __m512 acc2[TILE];
  for (int t = 0; t < TILE; ++t) acc2[t] = _mm512_setzero_ps();
  const __m512i halves = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
  for (; g + 2 <= nsb; g += 2) {  // two blocks per step
    __m512i u = codes64<BITS, 32>(w, n, 32 * g);
    __mmask64 negative = 0;
    if constexpr (BITS == 8) negative = _mm512_movepi8_mask(u), u = _mm512_abs_epi8(u);
    int two_halves;
    std::memcpy(&two_halves, w.d + n * nsb + g, 4);
    const __m512 dw = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_cvtph_ps(_mm_cvtsi32_si128(two_halves))));
    for (int t = 0; t < TILE; ++t) {
      __m512i x = _mm512_loadu_si512(a.q + (m0 + t) * K + 32 * g);
      if constexpr (BITS == 8) x = _mm512_mask_sub_epi8(x, negative, _mm512_setzero_si512(), x);  // |w| * (x sign(w))
      const __m512 xd = _mm512_permutexvar_ps(halves, _mm512_castps128_ps512(_mm_castpd_ps(
          _mm_load_sd(reinterpret_cast<const double*>(a.d + (m0 + t) * nsb + g)))));
      const __m512 p = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x));
      acc2[t] = _mm512_fmadd_ps(p, _mm512_mul_ps(dw, xd), acc2[t]);
    }
  }
  for (int t = 0; t < TILE; ++t)
    acc[t] = _mm256_add_ps(_mm512_castps512_ps256(acc2[t]), _mm512_extractf32x8_ps(acc2[t], 1));
#endif
  for (; g < nsb; ++g) {  // one block per step
    __m256i u = codes32<BITS, 32>(w, n, 32 * g);
    const __m256i u_abs = BITS == 8 ? _mm256_abs_epi8(u) : u;
    const float dw = half_to_float(w.d[n * nsb + g]);
    for (int t = 0; t < TILE; ++t) {
      __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + (m0 + t) * K + 32 * g));
      if constexpr (BITS == 8) x = _mm256_sign_epi8(x, u);
      const __m256 p = _mm256_cvtepi32_ps(dot32(u_abs, x));
      acc[t] = _mm256_fmadd_ps(p, _mm256_set1_ps(dw * a.d[(m0 + t) * nsb + g]), acc[t]);
    }
  }
  if constexpr (MIN) {  // sum over blocks of dmin * xd * (sum of the block's activations), eight blocks a vector
    for (int t = 0; t < TILE; ++t) {
      __m256 mins = _mm256_setzero_ps();
      int64_t b = 0;
      for (; b + 8 <= nsb; b += 8) {
        const __m256i xs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.sums + (m0 + t) * (K / 16) + 2 * b));
        const __m256 block_sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(xs, _mm256_set1_epi16(1)));
        const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.dmin + n * nsb + b)));
        const __m256 xd = _mm256_loadu_ps(a.d + (m0 + t) * nsb + b);
        mins = _mm256_fmadd_ps(block_sums, _mm256_mul_ps(dmin, xd), mins);
      }
      float tail = 0.f;
      for (; b < nsb; ++b) {
        const int16_t* xs = a.sums + (m0 + t) * (K / 16) + 2 * b;
        tail += half_to_float(w.dmin[n * nsb + b]) * a.d[(m0 + t) * nsb + b] * static_cast<float>(xs[0] + xs[1]);
      }
      y[(m0 + t) * N + n] = lane_sum(acc[t]) - (lane_sum(mins) + tail);
    }
  } else {
    for (int t = 0; t < TILE; ++t) y[(m0 + t) * N + n] = lane_sum(acc[t]);
  }
}

// Ask for weight row n's bytes ahead of use: the hardware prefetcher alone keeps too few misses in flight to
// stream memory at full bandwidth through this many arrays.
SPECDECODE_PREFETCHES void prefetch_row(const QuantWeight& w, int64_t n) {
  const int64_t code_bytes = w.bits == 8 ? w.K : w.K / 2;
  for (int64_t off = 0; off < code_bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(w.qs + n * code_bytes + off), _MM_HINT_T0);
  if (w.bits == 5 || w.bits == 6) {
    const int64_t hb = w.K / 8 * (w.bits - 4);
    for (int64_t off = 0; off < hb; off += 64) _mm_prefetch(reinterpret_cast<const char*>(w.qh + n * hb + off), _MM_HINT_T0);
  }
  if (w.scales != nullptr) {
    _mm_prefetch(reinterpret_cast<const char*>(w.scales + n * (w.K / w.G)), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w.mins + n * (w.K / w.G)), _MM_HINT_T0);
  }
  _mm_prefetch(reinterpret_cast<const char*>(w.d + n * (w.K / w.S)), _MM_HINT_T0);
  if (w.dmin != nullptr) _mm_prefetch(reinterpret_cast<const char*>(w.dmin + n * (w.K / w.S)), _MM_HINT_T0);
}
constexpr int64_t kPrefetchRows = 8;  // measured: 2 rows ahead 33 ms, 8 rows 30 ms for the 1.5B model at M = 1

using TileFn = void (*)(const QuantActs&, const QuantWeight&, float*, int64_t, int64_t, int64_t);

struct Kernel {
  TileFn tiles[kMaxTile];  // tiles[t - 1]: the tile for t activation rows
};

template <int BITS, int G, int... T>
Kernel k_kernel(std::integer_sequence<int, T...>) {
  return Kernel{{&tile_k<BITS, G, T + 1>...}};
}

template <int BITS, bool MIN, int... T>
Kernel legacy_kernel(std::integer_sequence<int, T...>) {
  return Kernel{{&tile_legacy<BITS, MIN, T + 1>...}};
}

// The kernels that exist: one per (bits, superblock, sub-block, mins) that a block type maps to.
const Kernel* pick(const QuantWeight& w, bool has_min) {
  using Tiles = std::make_integer_sequence<int, kMaxTile>;
  static const Kernel q4 = legacy_kernel<4, true>(Tiles{});   // Q4_0, Q4_1
  static const Kernel q5 = legacy_kernel<5, true>(Tiles{});   // Q5_0, Q5_1
  static const Kernel q8 = legacy_kernel<8, false>(Tiles{});  // Q8_0
  static const Kernel q4k = k_kernel<4, 32>(Tiles{});         // Q4_K
  static const Kernel q5k = k_kernel<5, 32>(Tiles{});         // Q5_K
  static const Kernel q6k = k_kernel<6, 16>(Tiles{});         // Q6_K
  const bool sub = w.scales != nullptr;
  if (w.S == 32 && !sub) {
    if (w.bits == 4 && has_min) return &q4;
    if (w.bits == 5 && has_min) return &q5;
    if (w.bits == 8 && !has_min) return &q8;
  }
  if (w.S == 256 && sub && has_min) {
    if (w.bits == 4 && w.G == 32) return &q4k;
    if (w.bits == 5 && w.G == 32) return &q5k;
    if (w.bits == 6 && w.G == 16) return &q6k;
  }
  return nullptr;
}

// x [M, K] float32 -> int8 codes, one scale per superblock of S, sums of codes per 16 (same rounding as torch).
void quantize_acts(const float* x, int64_t M, int64_t K, int64_t S, int8_t* q, float* d, int16_t* sums) {
  at::parallel_for(0, M, 1, [&](int64_t first, int64_t last) {
    for (int64_t m = first; m < last; ++m) {
      for (int64_t sb = 0; sb < K / S; ++sb)
        d[m * (K / S) + sb] = specdecode::quantize_block(x + m * K + sb * S, S, q + m * K + sb * S);
      for (int64_t b = 0; b < K / 16; ++b) {
        int32_t s = 0;
        for (int i = 0; i < 16; ++i) s += q[m * K + 16 * b + i];
        sums[m * (K / 16) + b] = static_cast<int16_t>(s);
      }
    }
  });
}

const uint8_t* bytes_or_null(const at::Tensor& t) {
  return t.numel() ? static_cast<const uint8_t*>(t.data_ptr()) : nullptr;
}

}  // namespace

at::Tensor linear_quant(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& qh,
                        const at::Tensor& scales, const at::Tensor& mins, const at::Tensor& d,
                        const at::Tensor& dmin, const at::Tensor& bias, int64_t bits, int64_t S, int64_t G) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [M, K] float32");
  TORCH_CHECK(d.dim() == 2 && d.scalar_type() == at::kHalf && d.is_contiguous(), "d: float16 [N, K / S]");
  const int64_t M = x.size(0), K = x.size(1), N = d.size(0);
  TORCH_CHECK(K % S == 0 && d.size(1) == K / S, "K must be a whole number of superblocks");
  for (const auto* t : {&qs, &qh, &scales, &mins, &dmin}) TORCH_CHECK(t->is_contiguous(), "tensors must be contiguous");
  TORCH_CHECK(qs.numel() == (bits == 8 ? N * K : N * K / 2), "qs has the wrong size");
  TORCH_CHECK(qh.numel() == (bits == 5 || bits == 6 ? N * (bits - 4) * K / 8 : 0), "qh has the wrong size");
  const QuantWeight w{static_cast<int>(bits), static_cast<int>(S), static_cast<int>(G), bytes_or_null(qs),
                      bytes_or_null(qh), reinterpret_cast<const int8_t*>(bytes_or_null(scales)),
                      reinterpret_cast<const int8_t*>(bytes_or_null(mins)),
                      reinterpret_cast<const uint16_t*>(d.data_ptr()),
                      reinterpret_cast<const uint16_t*>(bytes_or_null(dmin)), K};
  const Kernel* kernel = pick(w, dmin.numel() > 0);
  TORCH_CHECK(kernel != nullptr, "no kernel for bits=", bits, " S=", S, " G=", G);
  auto q = at::empty({M, K}, x.options().dtype(at::kChar));
  auto xd = at::empty({M, K / S}, x.options());
  auto sums = at::empty({M, K / 16}, x.options().dtype(at::kShort));
  quantize_acts(x.data_ptr<float>(), M, K, S, q.data_ptr<int8_t>(), xd.data_ptr<float>(), sums.data_ptr<int16_t>());
  const QuantActs a{q.data_ptr<int8_t>(), xd.data_ptr<float>(), sums.data_ptr<int16_t>()};
  auto y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + kRowBlock - 1) / kRowBlock, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) {
      const int64_t n0 = b * kRowBlock, n1 = std::min(N, n0 + kRowBlock);
      for (int64_t m = 0; m < M; m += kMaxTile) {  // every tile passes over this block's weight rows in cache
        const int t = static_cast<int>(std::min<int64_t>(kMaxTile, M - m));
        for (int64_t n = n0; n < n1; ++n) {
          if (m == 0 && n + kPrefetchRows < N) prefetch_row(w, n + kPrefetchRows);
          kernel->tiles[t - 1](a, w, yp, N, n, m);
        }
      }
    }
  });
  if (bias.numel()) y.add_(bias);  // here, not in Python: one framework call less per layer
  return y;
}
