// Quantized linear layer: y[M, N] = x[M, K] @ W[N, K]^T with W in GGUF-style blocks and x quantized per row to
// int8, multiplied with integer dot products (AVX2 vpmaddubsw, or VNNI vpdpbusd where the CPU has it).
//
// Weight layout (quant_formats.py builds it from a GGUF file or a float tensor, one layout for every block type):
//   codes, unsigned, BITS = 4, 5 or 6: `qs` uint8 [N, K / 2], per 32-group byte j = code[j] | code[j + 16] << 4;
//     5 bits: `qh` uint8 [N, K / 8], per group 4 bytes, the high bit of code[i] is bit i / 4 of byte i % 4;
//     6 bits: `qh` uint8 [N, K / 4], per group 8 bytes, the high two bits of code[i] are bits 2 (i / 8) of byte i % 8.
//   codes, signed, BITS = 8: `qs` int8 [N, K].
//   superblocks of S = 32 or 256 weights along K: `d`, `dmin` float16 [N, K / S];
//   optional sub-blocks of G = 16 or 32 weights: `scales`, `mins` int8 [N, K / G].
//   w = d * scale * code - dmin * min   (no sub-blocks: scale = min = 1; no `dmin`: no min term)
// Activations are quantized in the same superblocks: xd = amax / 127, xq = round(x / xd), plus sums of xq per 16.
//
// Per output y[m, n] = sum over superblocks of  xd * (d * sum_g scale_g * dot_g - dmin * sum_g min_g * xsum_g):
// the integer sums are exact, and the float sums run in one fixed order (eight lanes, then a fixed horizontal
// sum) whatever M is and whichever tile row m falls in. So a verify forward gives bit for bit the numbers of
// one-token forwards, and each weight group is decoded once per tile of activation rows (flat in M).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "simd.h"

namespace {

using specdecode::lane_sum;

#if defined(__AVX512VL__)
constexpr int kMaxTile = 8;  // 32 vector registers: two accumulators per activation row fit
#else
constexpr int kMaxTile = 5;
#endif
constexpr int64_t kRowBlock = 16;  // weight rows per work item: their blocks stay in L1 while every tile passes

struct QuantWeight {
  int bits, S, G;
  bool has_sub, has_min;
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
  const int32_t* sums;  // [M, K / 16]
};

inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

// u8 x s8 products, four adjacent pairs summed into each of eight int32 lanes (lane i: bytes 4i .. 4i + 3).
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(__AVXVNNI__)
  return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else  // no int16 saturation: codes < 64 and |xq| <= 127, or |code| <= 128 for the signed 8-bit form
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// The 32 codes of group g of weight row n, one per byte.
template <int BITS>
inline __m256i codes32(const QuantWeight& w, int64_t n, int64_t g) {
  if constexpr (BITS == 8) {
    return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.qs + n * w.K + 32 * g));
  } else {
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + n * (w.K / 2) + 16 * g));
    __m256i lo = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(b, 4), b), _mm256_set1_epi8(0x0F));
    if constexpr (BITS == 4) {
      return lo;
    } else if constexpr (BITS == 5) {
      uint32_t h;
      std::memcpy(&h, w.qh + n * (w.K / 8) + 4 * g, 4);
      __m256i hv = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(h)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
      return _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(hv, _mm256_set1_epi8(1)), 4));
    } else {
      uint64_t h;
      std::memcpy(&h, w.qh + n * (w.K / 4) + 8 * g, 8);
      __m256i hv = _mm256_srlv_epi64(_mm256_set1_epi64x(static_cast<long long>(h)), _mm256_setr_epi64x(0, 2, 4, 6));
      return _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(hv, _mm256_set1_epi8(3)), 4));
    }
  }
}

// Sub-block scales of group g as int32 lanes matching dot_u8s8's: one scale (G = 32) or two halves (G = 16).
template <int G>
inline __m256i scale_lanes(const QuantWeight& w, int64_t n, int64_t g) {
  const int8_t* sc = w.scales + n * (w.K / G) + g * (32 / G);
  if constexpr (G == 32) return _mm256_set1_epi32(sc[0]);
  return _mm256_setr_epi32(sc[0], sc[0], sc[0], sc[0], sc[1], sc[1], sc[1], sc[1]);
}

// y[m0 + t, n] for t < TILE: weight row n against TILE activation rows, each group's codes decoded once.
template <int BITS, int S, int G, bool SUB, bool MIN, int TILE>
void tile(const QuantActs& a, const QuantWeight& w, float* y, int64_t N, int64_t n, int64_t m0) {
  const int64_t K = w.K, nsb = K / S;
  __m256 acc[TILE];
  float min_acc[TILE];
  for (int t = 0; t < TILE; ++t) acc[t] = _mm256_setzero_ps(), min_acc[t] = 0.f;
  for (int64_t sb = 0; sb < nsb; ++sb) {
    __m256i isum[TILE];
    for (int t = 0; t < TILE; ++t) isum[t] = _mm256_setzero_si256();
    for (int64_t j = 0; j < S / 32; ++j) {
      const int64_t g = sb * (S / 32) + j;
      const __m256i u = codes32<BITS>(w, n, g);
      __m256i sc;
      if constexpr (SUB) sc = scale_lanes<G>(w, n, g);
      const __m256i u_abs = BITS == 8 ? _mm256_abs_epi8(u) : u;
      for (int t = 0; t < TILE; ++t) {
        __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.q + (m0 + t) * K + 32 * g));
        if constexpr (BITS == 8) x = _mm256_sign_epi8(x, u);  // signed codes: |w| * (x * sign(w))
        __m256i p = dot_u8s8(u_abs, x);
        if constexpr (SUB) p = _mm256_mullo_epi32(p, sc);
        isum[t] = _mm256_add_epi32(isum[t], p);
      }
    }
    const float d = half_to_float(w.d[n * nsb + sb]);
    for (int t = 0; t < TILE; ++t) {
      const float xd = a.d[(m0 + t) * nsb + sb];
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[t]), _mm256_set1_ps(d * xd), acc[t]);
    }
    if constexpr (MIN) {
      const float dmin = half_to_float(w.dmin[n * nsb + sb]);
      for (int t = 0; t < TILE; ++t) {
        const int32_t* xs = a.sums + (m0 + t) * (K / 16) + sb * (S / 16);
        int32_t imin = 0;
        if constexpr (SUB) {
          const int8_t* mn = w.mins + n * (K / G) + sb * (S / G);
          for (int h = 0; h < S / G; ++h)
            imin += mn[h] * (G == 16 ? xs[h] : xs[2 * h] + xs[2 * h + 1]);
        } else {
          for (int h = 0; h < S / 16; ++h) imin += xs[h];
        }
        min_acc[t] += dmin * a.d[(m0 + t) * nsb + sb] * static_cast<float>(imin);
      }
    }
  }
  for (int t = 0; t < TILE; ++t) y[(m0 + t) * N + n] = lane_sum(acc[t]) - min_acc[t];
}

// Ask for weight row n's bytes ahead of use: the hardware prefetcher alone keeps too few misses in flight to
// stream memory at full bandwidth through this many arrays.
inline void prefetch_row(const QuantWeight& w, int64_t n) {
  const int64_t code_bytes = w.bits == 8 ? w.K : w.K / 2;
  for (int64_t off = 0; off < code_bytes; off += 64) _mm_prefetch(reinterpret_cast<const char*>(w.qs + n * code_bytes + off), _MM_HINT_T0);
  if (w.qh != nullptr) {
    const int64_t hb = w.K / 32 * (w.bits - 4);
    for (int64_t off = 0; off < hb; off += 64) _mm_prefetch(reinterpret_cast<const char*>(w.qh + n * hb + off), _MM_HINT_T0);
  }
  if (w.scales != nullptr) {
    _mm_prefetch(reinterpret_cast<const char*>(w.scales + n * (w.K / w.G)), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w.mins + n * (w.K / w.G)), _MM_HINT_T0);
  }
  _mm_prefetch(reinterpret_cast<const char*>(w.d + n * (w.K / w.S)), _MM_HINT_T0);
  if (w.dmin != nullptr) _mm_prefetch(reinterpret_cast<const char*>(w.dmin + n * (w.K / w.S)), _MM_HINT_T0);
}
constexpr int64_t kPrefetchRows = 2;

template <int BITS, int S, int G, bool SUB, bool MIN>
void rows(const QuantActs& a, int64_t M, const QuantWeight& w, float* y, int64_t N, int64_t n0, int64_t n1) {
  for (int64_t m = 0; m < M; m += kMaxTile) {
    const int t = static_cast<int>(std::min<int64_t>(kMaxTile, M - m));
    for (int64_t n = n0; n < n1; ++n) {
      if (m == 0 && n + kPrefetchRows < N) prefetch_row(w, n + kPrefetchRows);
      switch (t) {
        case 1: tile<BITS, S, G, SUB, MIN, 1>(a, w, y, N, n, m); break;
        case 2: tile<BITS, S, G, SUB, MIN, 2>(a, w, y, N, n, m); break;
        case 3: tile<BITS, S, G, SUB, MIN, 3>(a, w, y, N, n, m); break;
        case 4: tile<BITS, S, G, SUB, MIN, 4>(a, w, y, N, n, m); break;
#if defined(__AVX512VL__)
        case 5: tile<BITS, S, G, SUB, MIN, 5>(a, w, y, N, n, m); break;
        case 6: tile<BITS, S, G, SUB, MIN, 6>(a, w, y, N, n, m); break;
        case 7: tile<BITS, S, G, SUB, MIN, 7>(a, w, y, N, n, m); break;
        default: tile<BITS, S, G, SUB, MIN, 8>(a, w, y, N, n, m); break;
#else
        default: tile<BITS, S, G, SUB, MIN, 5>(a, w, y, N, n, m); break;
#endif
      }
    }
  }
}

using RowsFn = void (*)(const QuantActs&, int64_t, const QuantWeight&, float*, int64_t, int64_t, int64_t);

// The kernels that exist: one per (bits, superblock, sub-block, sub-scales, mins) that a block type maps to.
RowsFn pick(const QuantWeight& w) {
  const bool sub = w.has_sub, mn = w.has_min;
  if (w.S == 32 && !sub) {
    if (w.bits == 4 && mn) return rows<4, 32, 32, false, true>;   // Q4_0, Q4_1
    if (w.bits == 5 && mn) return rows<5, 32, 32, false, true>;   // Q5_0, Q5_1
    if (w.bits == 8 && !mn) return rows<8, 32, 32, false, false>;  // Q8_0
  }
  if (w.S == 256 && sub && mn) {
    if (w.bits == 4 && w.G == 32) return rows<4, 256, 32, true, true>;  // Q4_K
    if (w.bits == 5 && w.G == 32) return rows<5, 256, 32, true, true>;  // Q5_K
    if (w.bits == 6 && w.G == 16) return rows<6, 256, 16, true, true>;  // Q6_K
  }
  return nullptr;
}

// x [M, K] float32 -> int8 codes, one scale per superblock of S, sums of codes per 16 (same rounding as numpy).
void quantize_acts(const float* x, int64_t M, int64_t K, int64_t S, int8_t* q, float* d, int32_t* sums) {
  at::parallel_for(0, M, 1, [&](int64_t first, int64_t last) {
    for (int64_t m = first; m < last; ++m) {
      for (int64_t sb = 0; sb < K / S; ++sb) {
        const float* xs = x + m * K + sb * S;
        float amax = 0.f;
        for (int64_t i = 0; i < S; ++i) amax = std::max(amax, std::fabs(xs[i]));
        const float scale = amax / 127.f, inv = scale > 0.f ? 1.f / scale : 0.f;
        d[m * (K / S) + sb] = scale;
        int8_t* qs = q + m * K + sb * S;
        for (int64_t i = 0; i < S; ++i) qs[i] = static_cast<int8_t>(std::nearbyint(xs[i] * inv));
      }
      for (int64_t b = 0; b < K / 16; ++b) {
        int32_t s = 0;
        for (int i = 0; i < 16; ++i) s += q[m * K + 16 * b + i];
        sums[m * (K / 16) + b] = s;
      }
    }
  });
}

const uint8_t* bytes_or_null(const torch::Tensor& t) {
  return t.numel() ? static_cast<const uint8_t*>(t.data_ptr()) : nullptr;
}

}  // namespace

torch::Tensor linear_quant(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& qh,
                           const torch::Tensor& scales, const torch::Tensor& mins, const torch::Tensor& d,
                           const torch::Tensor& dmin, int64_t bits, int64_t S, int64_t G) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be [M, K] float32");
  TORCH_CHECK(d.dim() == 2 && d.scalar_type() == torch::kFloat16 && d.is_contiguous(), "d: float16 [N, K / S]");
  const int64_t M = x.size(0), K = x.size(1), N = d.size(0);
  TORCH_CHECK(K % S == 0 && d.size(1) == K / S, "K must be a whole number of superblocks");
  for (const auto* t : {&qs, &qh, &scales, &mins, &dmin}) TORCH_CHECK(t->is_contiguous(), "tensors must be contiguous");
  TORCH_CHECK(qs.numel() == (bits == 8 ? N * K : N * K / 2), "qs has the wrong size");
  const QuantWeight w{static_cast<int>(bits), static_cast<int>(S), static_cast<int>(G), scales.numel() > 0,
                      dmin.numel() > 0, bytes_or_null(qs), bytes_or_null(qh),
                      reinterpret_cast<const int8_t*>(bytes_or_null(scales)),
                      reinterpret_cast<const int8_t*>(bytes_or_null(mins)),
                      reinterpret_cast<const uint16_t*>(d.data_ptr()),
                      reinterpret_cast<const uint16_t*>(bytes_or_null(dmin)), K};
  const RowsFn fn = pick(w);
  TORCH_CHECK(fn != nullptr, "no kernel for bits=", bits, " S=", S, " G=", G);
  auto q = torch::empty({M, K}, x.options().dtype(torch::kInt8));
  auto xd = torch::empty({M, K / S}, x.options());
  auto sums = torch::empty({M, K / 16}, x.options().dtype(torch::kInt32));
  quantize_acts(x.data_ptr<float>(), M, K, S, q.data_ptr<int8_t>(), xd.data_ptr<float>(), sums.data_ptr<int32_t>());
  const QuantActs a{q.data_ptr<int8_t>(), xd.data_ptr<float>(), sums.data_ptr<int32_t>()};
  auto y = torch::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, (N + kRowBlock - 1) / kRowBlock, 1, [&](int64_t first, int64_t last) {
    for (int64_t b = first; b < last; ++b) fn(a, M, w, yp, N, b * kRowBlock, std::min(N, (b + 1) * kRowBlock));
  });
  return y;
}
