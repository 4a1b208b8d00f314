// K-quant linear layers (Q4_K, Q5_K, Q6_K) with 16 output channels per vector: one AVX-512 VNNI register, or two
// AVX2 halves of 8 channels (the same layout, the same integer sums and the same float steps on both).
//
// quant_cpu.cpp walks one weight row at a time, so every sub-block scale, min and superblock scale is applied
// once per weight row and activation row: at several rows (prefill, a verify forward) that bookkeeping costs as
// much as the dot products. Here the weights are repacked so that one 64-byte vector holds 4 consecutive codes of
// 16 output channels: one vpdpbusd with 4 broadcast activation bytes advances 16 dot products, and each scale, min
// and d is a 16-lane vector applied once per 16 channels. Per activation row that is about 40 multiply-adds per
// instruction instead of about 10.
//
// Repacked layout, per group of 16 channels (cg) and superblock of 256 weights (sb), all arrays [N / 16, K / 256, ...]:
//   lo:  32 vectors of 64 bytes; vector p, byte 4 c + i = code[c][8 p + i] & 15 | (code[c][8 p + 4 + i] & 15) << 4
//   hi:  the high bits, 2-bit fields: vector q, byte 4 c + i, bits 2 j, 2 j + 1 = bits 4, 5 of code[c][4 (4 q + j) + i]
//        (5 bits: only the lower bit of each field is set), 16 vectors
//   sc:  [256 / G][16] int8 sub-block scales;  mn: [256 / G / 2][16][2] int8 mins, sub-blocks in pairs
//   d, dmin: [16] float16, as the file has them
// Q6_K has no mins: its offset of 32 comes off as 32 x (sum over sub-blocks of scale x the sub-block's activation
// codes), an integer term like Q4_K's min term, so it keeps neither mn nor dmin. Per 256 x 16 weights that is
// 3,360 bytes for Q6_K and 2,368 for Q4_K (the file: 3,360 and 2,304): a one-token forward reads about what
// llama.cpp reads. Activations: int8 codes per 256 (scale xd), and sums of the codes per sub-block as int16 pairs.
//
// Every output y[m, n] is reduced in one fixed order (superblocks in order, integer sums exact), whatever M is, so
// rows are bit-identical to one-row calls.
#include "aten_lite.h"
#include "amx_tiles.h"
#include <immintrin.h>

#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "huge_pages.h"
#include "kernels.h"
#include "simd.h"

namespace {

// The 256 codes of superblock sb of row n, from quant_cpu.cpp's row layout (128-code nibble runs, bit planes).
inline void row_codes(const uint8_t* qs, const uint8_t* qh, int bits, int64_t K, int64_t n, int64_t sb,
                      uint8_t* codes) {
  const uint8_t* run = qs + n * (K / 2) + sb * 128;
  for (int r = 0; r < 2; ++r)
    for (int j = 0; j < 64; ++j) codes[128 * r + j] = run[64 * r + j] & 15, codes[128 * r + 64 + j] = run[64 * r + j] >> 4;
  for (int p = 0; p < bits - 4; ++p) {  // code k's bit 4 + p is bit k % 8 of the plane's byte k / 8
    const uint8_t* plane = qh + (n * (bits - 4) + p) * (K / 8) + sb * 32;
    for (int w = 0; w < 32; ++w) {
      uint64_t eight;
      std::memcpy(&eight, codes + 8 * w, 8);
      eight |= specdecode::spread_bits(plane[w]) << (4 + p);
      std::memcpy(codes + 8 * w, &eight, 8);
    }
  }
}

}  // namespace

// Row layout (blocks.py) -> the channel layout above. N must be a multiple of 16, K of 256. Four codes of a channel
// move as one word (byte-wise masks and shifts that carry nothing across bytes): a load of the target repacks its
// ~1 GB of blocks at every start.
std::vector<at::Tensor> repack_c16(const at::Tensor& qs, const at::Tensor& qh, const at::Tensor& scales,
                                   const at::Tensor& mins, const at::Tensor& d, const at::Tensor& dmin,
                                   int64_t bits, int64_t G) {
  using specdecode::load_word;
  using specdecode::store_word;
  const int64_t N = d.size(0), nsb = d.size(1), K = nsb * 256, ng = N / 16, nsub = 256 / G;
  TORCH_CHECK(N % 16 == 0, "repack_c16: N must be a multiple of 16");
  auto opts = at::TensorOptions().dtype(at::kByte);
  auto lo = empty_in_huge_pages({ng, nsb, 32, 64}, opts);
  const bool with_mins = bits != 6;
  auto hi = empty_in_huge_pages({ng, nsb, bits > 4 ? 16 : 0, 64}, opts);
  auto sc = empty_in_huge_pages({ng, nsb, nsub, 16}, opts.dtype(at::kChar));
  auto mn = empty_in_huge_pages({ng, with_mins ? nsb : 0, nsub / 2, 16, 2}, opts.dtype(at::kChar));
  auto dd = empty_in_huge_pages({ng, nsb, 16}, opts.dtype(at::kHalf));
  auto dm = empty_in_huge_pages({ng, with_mins ? nsb : 0, 16}, opts.dtype(at::kHalf));
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const uint8_t* h = bits > 4 ? qh.data_ptr<uint8_t>() : nullptr;
  const int8_t* s = scales.data_ptr<int8_t>();
  const int8_t* m = mins.data_ptr<int8_t>();
  const at::Half* d16 = d.data_ptr<at::Half>();
  const at::Half* m16 = dmin.data_ptr<at::Half>();
  uint8_t* lo_all = lo.data_ptr<uint8_t>();
  uint8_t* hi_all = bits > 4 ? hi.data_ptr<uint8_t>() : nullptr;
  int8_t* sc_all = sc.data_ptr<int8_t>();
  int8_t* mn_all = with_mins ? mn.data_ptr<int8_t>() : nullptr;
  at::Half* dd_all = dd.data_ptr<at::Half>();
  at::Half* dm_all = with_mins ? dm.data_ptr<at::Half>() : nullptr;
  at::parallel_for(0, ng, 1, [&](int64_t first, int64_t last) {
    for (int64_t cg = first; cg < last; ++cg) {
      for (int64_t sb = 0; sb < nsb; ++sb) {
        const int64_t at = cg * nsb + sb;
        uint8_t* lo_p = lo_all + at * 32 * 64;
        uint8_t* hi_p = bits > 4 ? hi_all + at * 16 * 64 : nullptr;
        for (int c = 0; c < 16; ++c) {
          const int64_t n = cg * 16 + c;
          alignas(8) uint8_t row[256];
          row_codes(q, h, static_cast<int>(bits), K, n, sb, row);
          for (int p = 0; p < 32; ++p)  // codes 8 p + i and 8 p + 4 + i: the low and high nibble of byte i
            store_word(lo_p + p * 64 + 4 * c, (load_word(row + 8 * p) & 0x0F0F0F0Fu) |
                                                  (load_word(row + 8 * p + 4) & 0x0F0F0F0Fu) << 4);
          if (hi_p != nullptr)
            for (int v = 0; v < 16; ++v) {  // bits 4, 5 of code 16 v + 4 j + i in bits 2 j, 2 j + 1 of byte i
              uint32_t word = 0;
              for (int j = 0; j < 4; ++j) word |= (load_word(row + 16 * v + 4 * j) >> 4 & 0x03030303u) << (2 * j);
              store_word(hi_p + v * 64 + 4 * c, word);
            }
          for (int64_t u = 0; u < nsub; ++u) {
            sc_all[(at * nsub + u) * 16 + c] = s[n * (K / G) + sb * nsub + u];
            if (with_mins) mn_all[((at * (nsub / 2) + u / 2) * 16 + c) * 2 + u % 2] = m[n * (K / G) + sb * nsub + u];
          }
          dd_all[at * 16 + c] = d16[n * nsb + sb];
          if (with_mins) dm_all[at * 16 + c] = m16[n * nsb + sb];
        }
      }
    }
  });
  return {lo, hi, sc, mn, dd, dm};
}

namespace {

struct C16Weight {
  const uint8_t* lo;
  const uint8_t* hi;
  const int8_t* sc;
  const int8_t* mn;     // none for Q6_K
  const uint16_t* d;    // float16
  const uint16_t* dmin;  // float16; none for Q6_K
  int64_t nsb;
};

struct C16Acts {
  const int8_t* q;       // [M, K]
  const float* xd;       // [M, K / 256]
  const int32_t* pairs;  // [M, K / G / 2]: int16 sums of the codes of sub-blocks 2 u and 2 u + 1
  int64_t K;
};

// The bytes of superblock `at`, asked for kAhead superblocks before use: without it a forward over several rows
// pays the memory's latency on top of its arithmetic (its own loads run too few superblocks ahead to hide it).
// Spread over the sub-blocks, a share of the codes per sub-block, rather than all at once: measured on a Zen 3
// EPYC, the 1.5B target, 2 threads, ms for its linear layers at M = 1 / 4 / 8: one superblock ahead into L1 at
// once 29 / - / 49; three ahead, non-temporal, at once 24 / 34 / 45; spread 19 / 26 / 39. The hint (non-temporal
// there, into L2 on Intel) is the build's, by the CPU's maker (simd.h). Prefetches never fault, so the last
// superblocks of a tensor may point past its end.
constexpr int kAhead = 3;
using specdecode::prefetch_weights;

template <int BITS, int nsub>  // scales, mins and d: once per superblock
SPECDECODE_PREFETCHES void prefetch_scales(const C16Weight& w, int64_t at) {
  for (int line = 0; line < nsub * 16 / 64; ++line) prefetch_weights(w.sc + at * nsub * 16 + line * 64);
  prefetch_weights(w.d + at * 16);
  if constexpr (BITS != 6) {
    for (int line = 0; line < nsub * 16 / 64; ++line) prefetch_weights(w.mn + at * nsub * 16 + line * 64);
    prefetch_weights(w.dmin + at * 16);
  }
}

template <int BITS, int nsub>  // sub-block u's share of the codes' 32 (+ 16) lines
SPECDECODE_PREFETCHES void prefetch_codes(const C16Weight& w, int64_t at, int u) {
  for (int line = 0; line < 32 / nsub; ++line) prefetch_weights(w.lo + (at * 32 + u * (32 / nsub) + line) * 64);
  if constexpr (BITS > 4)
    for (int line = 0; line < 16 / nsub; ++line) prefetch_weights(w.hi + (at * 16 + u * (16 / nsub) + line) * 64);
}

// Activation rows per pass over a channel group. AVX-512: 3 accumulators each, in 32 registers; AVX2: the int16
// sums of all 8 rows stay in 16 registers, the int32 sums spill once per sub-block.
constexpr int kTile = 8;

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)

inline __m512 load_f16x16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

constexpr int kJointRows = 0;  // one vector holds all 16 channels: nothing to join

// The codes of chunk j (4 weights of 16 channels) of a run of `lo` vectors and, above 4 bits, `hi` vectors.
template <int BITS>
__attribute__((always_inline)) inline __m512i chunk_codes(const uint8_t* lo, const uint8_t* hi, int j) {
  const __m512i low4 = _mm512_set1_epi8(0x0F), bits45 = _mm512_set1_epi8(0x30);
  const __m512i packed = _mm512_loadu_si512(lo + (j / 2) * 64);
  __m512i codes = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(packed, 4) : packed, low4);
  if constexpr (BITS > 4) {
    const __m512i high = _mm512_loadu_si512(hi + (j / 4) * 64);
    // field j of each byte moved to bits 4, 5 (one shift, none for j = 2; 16-bit lanes carry nothing
    // into bits 4, 5 of the other byte), then codes | (that & 0x30) in one ternary-logic instruction
    const int f = j % 4;
    const __m512i moved = f == 0 ? _mm512_slli_epi16(high, 4) : f == 1 ? _mm512_slli_epi16(high, 2)
                          : f == 2 ? high : _mm512_srli_epi16(high, 2);
    codes = _mm512_ternarylogic_epi32(codes, moved, bits45, 0xF8);  // a | (b & c)
  }
  return codes;
}

template <int BITS, int G, int TILE>
void tile(const C16Acts& a, const C16Weight& w, int64_t cg, int64_t m0, float* y, int64_t N) {
  constexpr int nsub = 256 / G, chunks = G / 4;
  const int8_t* rows[TILE];  // each activation row's codes and sub-block sums
  const int32_t* row_pairs[TILE];
  for (int t = 0; t < TILE; ++t) rows[t] = a.q + (m0 + t) * a.K, row_pairs[t] = a.pairs + (m0 + t) * (a.K / G / 2);
  __m512 acc[TILE];
  for (int t = 0; t < TILE; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t sb = 0; sb < w.nsb; ++sb) {
    const int64_t at = cg * w.nsb + sb;
    const uint8_t* lo = w.lo + at * 32 * 64;
    const uint8_t* hi = BITS > 4 ? w.hi + at * 16 * 64 : nullptr;
    const int8_t* sc = w.sc + at * nsub * 16;
    if (m0 == 0) prefetch_scales<BITS, nsub>(w, at + kAhead);
    __m512i isum[TILE];
    for (int t = 0; t < TILE; ++t) isum[t] = _mm512_setzero_si512();
    if constexpr (BITS == 6) {
      // Q6_K's codes are stored + 32: sum over u of scale[u] (S[u] - 32 codes_sum[u]) = sum of scale[u] S[u] - 32 x
      // (sum of scale[u] codes_sum[u]). That last sum goes first, two sub-blocks a step as Q4_K's min terms do,
      // with the scales of sub-blocks 2 p, 2 p + 1 interleaved per channel; integer sums, the result unchanged.
      const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
                                                  23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
      for (int p = 0; p < nsub / 2; ++p) {
        const __m512i both = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(sc + p * 32)));
        const __m512i scales = _mm512_permutexvar_epi16(interleave, both);
        for (int t = 0; t < TILE; ++t)
          isum[t] = _mm512_dpwssd_epi32(isum[t], scales, _mm512_set1_epi32(row_pairs[t][sb * (nsub / 2) + p]));
      }
      for (int t = 0; t < TILE; ++t) isum[t] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(isum[t], 5));
    }
    for (int u = 0; u < nsub; ++u) {
      // Few rows: two accumulators per row (even and odd chunks), so vpdpbusd's latency is not one long chain.
      // Q4_K at any rows: each half's sum (16 weights) fits the low int16 of its lane (below). Integer sums: the
      // split changes no bit of the result.
      constexpr bool kHalvesFit = BITS == 4;
      constexpr int kSplit = TILE <= 4 || kHalvesFit ? 2 : 1;
      __m512i part[kSplit][TILE];
      for (int h = 0; h < kSplit; ++h)
        for (int t = 0; t < TILE; ++t) part[h][t] = _mm512_setzero_si512();
      // this sub-block's vectors and activations; offsets within it are constants once the loop below unrolls
      const uint8_t* lo_u = lo + static_cast<size_t>(u) * (chunks / 2) * 64;
      const uint8_t* hi_u = BITS > 4 ? hi + static_cast<size_t>(u) * (chunks / 4) * 64 : nullptr;
      const size_t col = static_cast<size_t>(sb) * 256 + static_cast<size_t>(u) * G;
      if (m0 == 0) prefetch_codes<BITS, nsub>(w, at + kAhead, u);
      // Unrolled in full, whatever TILE: left to itself the compiler stops unrolling at 7 rows, and the chunk
      // arithmetic it then does at run time cost those rows a sixth more.
#pragma GCC unroll 16
      for (int j = 0; j < chunks; ++j) {  // chunks is a multiple of 4: chunk % 2 and chunk % 4 are j's
        const __m512i codes = chunk_codes<BITS>(lo_u, hi_u, j);
#pragma GCC unroll 16
        for (int t = 0; t < TILE; ++t)
          part[j % kSplit][t] = _mm512_dpbusd_epi32(part[j % kSplit][t], codes, bcast4(rows[t] + col + 4 * j));
      }
      if constexpr (kHalvesFit) {
        // A half's sum is at most 16 x 15 x 128 < 2^15 in magnitude: its lane is that int16, sign-extended. One
        // vpdpwssd against (scale, 0) pairs scales it and adds it in, exactly: two instructions a row where vpmulld
        // (two micro-ops) and two adds were four. Several rows are bound by these instructions, not by the
        // weights' read (BENCHMARKS.md, "Eight rows at the instructions' rate").
        const __m512i scale = _mm512_cvtepu16_epi32(
            _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + u * 16))));
        for (int t = 0; t < TILE; ++t)
          isum[t] = _mm512_dpwssd_epi32(_mm512_dpwssd_epi32(isum[t], part[0][t], scale), part[1][t], scale);
        continue;
      }
      // Q5_K, Q6_K: a sub-block's sum s (|s| < 2^23) is 256 h + l with l its low byte and h = s >> 8 (< 2^15 in
      // magnitude): one byte shuffle puts l and h in the two int16 halves of the lane, and one vpdpwssd against
      // (scale, 256 scale) pairs adds l scale + h 256 scale = s scale, exactly, where vpmulld and an add took three
      // micro-ops. Scales are int8: 256 scale fits an int16.
      const __m512i scale = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + u * 16)));
      const __m512i scale_pairs = _mm512_mask_blend_epi16(0xAAAAAAAA, scale, _mm512_slli_epi32(scale, 24));
      const __m512i low_high = _mm512_broadcast_i32x4(
          _mm_setr_epi8(0, -128, 1, 2, 4, -128, 5, 6, 8, -128, 9, 10, 12, -128, 13, 14));  // bytes (0, zero, 1, 2)
      for (int t = 0; t < TILE; ++t) {
        const __m512i sum = kSplit == 2 ? _mm512_add_epi32(part[0][t], part[kSplit - 1][t]) : part[0][t];
        isum[t] = _mm512_dpwssd_epi32(isum[t], _mm512_shuffle_epi8(sum, low_high), scale_pairs);
      }
    }
    const __m512 d = load_f16x16(w.d + at * 16);
    if constexpr (BITS == 6) {
      for (int t = 0; t < TILE; ++t)
        acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]),
                                 _mm512_mul_ps(d, _mm512_set1_ps(a.xd[(m0 + t) * (a.K / 256) + sb])), acc[t]);
      continue;
    }
    // min terms: sum over sub-blocks of min[c][u] * (sum of the row's codes in sub-block u), two sub-blocks a step
    __m512i imin[TILE];
    for (int t = 0; t < TILE; ++t) imin[t] = _mm512_setzero_si512();
    for (int p = 0; p < nsub / 2; ++p) {
      const __m512i mins = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.mn + (at * (nsub / 2) + p) * 32)));
      for (int t = 0; t < TILE; ++t)
        imin[t] = _mm512_dpwssd_epi32(imin[t], mins, _mm512_set1_epi32(row_pairs[t][sb * (nsub / 2) + p]));
    }
    const __m512 dmin = load_f16x16(w.dmin + at * 16);
    for (int t = 0; t < TILE; ++t) {
      const __m512 xd = _mm512_set1_ps(a.xd[(m0 + t) * (a.K / 256) + sb]);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[t]), _mm512_mul_ps(d, xd), acc[t]);
      acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(imin[t]), _mm512_mul_ps(dmin, xd), acc[t]);
    }
  }
  for (int t = 0; t < TILE; ++t) _mm512_storeu_ps(y + (m0 + t) * N + cg * 16, acc[t]);
}

#else
// AVX2: each 64-byte vector as two 32-byte halves of 8 channels. No vpdpbusd: vpmaddubsw multiplies code and
// activation bytes and adds pairs into int16, and those int16 sums of kRun chunks add up without overflow (at most
// 2 x 127 x (2^BITS - 1) each), so one vpmaddwd per kRun chunks applies the sub-block's scale to a channel's two
// int16 lanes and sums them into int32: the integer sum vpdpbusd and a multiply by the scale give, exactly. The
// float steps are AVX-512's, lane by lane.

// Eight channels' int8 values at p, each as an int16 pair (v, v): the operand that scales a channel's two lanes.
inline __m256i pairs_of(const int8_t* p) {
  const __m128i v = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  return _mm256_set_m128i(_mm_unpackhi_epi16(v, v), _mm_unpacklo_epi16(v, v));
}

// Eight channels' values from two int8 rows a, b as int16 pairs (a, b).
inline __m256i pairs_of(const int8_t* a, const int8_t* b) {
  const __m128i va = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(a)));
  const __m128i vb = _mm_cvtepi8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b)));
  return _mm256_set_m128i(_mm_unpackhi_epi16(va, vb), _mm_unpacklo_epi16(va, vb));
}

inline __m256 load_f16x8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// The codes of chunk j for 8 channels (bytes 32 h .. 32 h + 31 of each vector: h is folded into lo_u and hi_u).
template <int BITS>
inline __m256i chunk_codes(const uint8_t* lo_u, const uint8_t* hi_u, int j) {
  const __m256i low4 = _mm256_set1_epi8(0x0F), bits45 = _mm256_set1_epi8(0x30);
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo_u + (j / 2) * 64));
  __m256i codes = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(packed, 4) : packed, low4);
  if constexpr (BITS > 4) {
    const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hi_u + (j / 4) * 64));
    const int f = j % 4;
    const __m256i moved = f == 0 ? _mm256_slli_epi16(high, 4) : f == 1 ? _mm256_slli_epi16(high, 2)
                          : f == 2 ? high : _mm256_srli_epi16(high, 2);
    codes = _mm256_or_si256(codes, _mm256_and_si256(moved, bits45));
  }
  return codes;
}

// HALVES: the 8-channel halves one pass over a superblock's codes works on. Zen 3 broadcasts at most ~1.7
// activation words a cycle beside its two vpmaddubsw, and the broadcast, the product and the running add make
// three vector operations a row and chunk: with both halves in one pass each broadcast feeds two products. That
// needs 2 x TILE running sums, so it runs up to 4 rows (16 registers); one half a pass runs up to 8.
template <int BITS, int G, int TILE, int HALVES>
void tile_pass(const C16Acts& a, const C16Weight& w, int64_t cg, int64_t m0, float* y, int64_t N) {
  constexpr int nsub = 256 / G, chunks = G / 4;
  constexpr int kRun = BITS == 4 ? 8 : BITS == 5 ? 4 : 2;  // chunks whose int16 pair sums cannot overflow
  static_assert(chunks % kRun == 0, "a sub-block is a whole number of runs");
  const int8_t* rows[TILE];
  const int32_t* row_pairs[TILE];
  for (int t = 0; t < TILE; ++t) rows[t] = a.q + (m0 + t) * a.K, row_pairs[t] = a.pairs + (m0 + t) * (a.K / G / 2);
  __m256 acc[2][TILE];
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < TILE; ++t) acc[h][t] = _mm256_setzero_ps();
  for (int64_t sb = 0; sb < w.nsb; ++sb) {
    const int64_t at = cg * w.nsb + sb;
    const uint8_t* lo = w.lo + at * 32 * 64;
    const uint8_t* hi = BITS > 4 ? w.hi + at * 16 * 64 : nullptr;
    const int8_t* sc = w.sc + at * nsub * 16;
    if (m0 == 0) prefetch_scales<BITS, nsub>(w, at + kAhead);
    for (int h0 = 0; h0 < 2; h0 += HALVES) {  // channels 8 h .. 8 h + 7: bytes 32 h .. 32 h + 31 of every vector
      __m256i isum[HALVES][TILE];
      for (int e = 0; e < HALVES; ++e)
        for (int t = 0; t < TILE; ++t) isum[e][t] = _mm256_setzero_si256();
      if constexpr (BITS == 6) {  // the offset of 32, as in the AVX-512 tile: -32 x sum of scale[u] codes_sum[u]
        for (int e = 0; e < HALVES; ++e) {
          const int h = h0 + e;
          for (int p = 0; p < nsub / 2; ++p) {
            const __m256i scales = pairs_of(sc + (2 * p) * 16 + 8 * h, sc + (2 * p + 1) * 16 + 8 * h);
            for (int t = 0; t < TILE; ++t)
              isum[e][t] = _mm256_add_epi32(isum[e][t], _mm256_madd_epi16(scales, _mm256_set1_epi32(row_pairs[t][sb * (nsub / 2) + p])));
          }
          for (int t = 0; t < TILE; ++t) isum[e][t] = _mm256_sub_epi32(_mm256_setzero_si256(), _mm256_slli_epi32(isum[e][t], 5));
        }
      }
      for (int u = 0; u < nsub; ++u) {
        const uint8_t* lo_u = lo + static_cast<size_t>(u) * (chunks / 2) * 64 + 32 * h0;
        const uint8_t* hi_u = BITS > 4 ? hi + static_cast<size_t>(u) * (chunks / 4) * 64 + 32 * h0 : nullptr;
        const size_t col = static_cast<size_t>(sb) * 256 + static_cast<size_t>(u) * G;
        if (m0 == 0 && h0 == 0) prefetch_codes<BITS, nsub>(w, at + kAhead, u);
        __m256i part[HALVES][TILE];
#pragma GCC unroll 16
        for (int j = 0; j < chunks; ++j) {
          __m256i codes[HALVES];
          for (int e = 0; e < HALVES; ++e) codes[e] = chunk_codes<BITS>(lo_u + 32 * e, BITS > 4 ? hi_u + 32 * e : nullptr, j);
#pragma GCC unroll 16
          for (int t = 0; t < TILE; ++t) {
            const __m256i act = specdecode::broadcast4(rows[t] + col + 4 * j);
            for (int e = 0; e < HALVES; ++e) {
              const __m256i p = _mm256_maddubs_epi16(codes[e], act);
              part[e][t] = j % kRun == 0 ? p : _mm256_add_epi16(part[e][t], p);
              specdecode::pin(part[e][t]);
            }
          }
          if (j % kRun == kRun - 1)
            for (int e = 0; e < HALVES; ++e) {
              const __m256i scale = pairs_of(sc + u * 16 + 8 * (h0 + e));
              for (int t = 0; t < TILE; ++t) isum[e][t] = _mm256_add_epi32(isum[e][t], _mm256_madd_epi16(part[e][t], scale));
            }
        }
      }
      for (int e = 0; e < HALVES; ++e) {
        const int h = h0 + e;
        const __m256 d = load_f16x8(w.d + at * 16 + 8 * h);
        if constexpr (BITS == 6) {
          for (int t = 0; t < TILE; ++t)
            acc[h][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[e][t]),
                                        _mm256_mul_ps(d, _mm256_set1_ps(a.xd[(m0 + t) * (a.K / 256) + sb])), acc[h][t]);
          continue;
        }
        __m256i imin[TILE];
        for (int t = 0; t < TILE; ++t) imin[t] = _mm256_setzero_si256();
        for (int p = 0; p < nsub / 2; ++p) {  // mins of sub-blocks 2 p, 2 p + 1, paired per channel as stored
          const __m256i mins = _mm256_cvtepi8_epi16(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(w.mn + (at * (nsub / 2) + p) * 32 + 16 * h)));
          for (int t = 0; t < TILE; ++t)
            imin[t] = _mm256_add_epi32(imin[t], _mm256_madd_epi16(mins, _mm256_set1_epi32(row_pairs[t][sb * (nsub / 2) + p])));
        }
        const __m256 dmin = load_f16x8(w.dmin + at * 16 + 8 * h);
        for (int t = 0; t < TILE; ++t) {
          const __m256 xd = _mm256_set1_ps(a.xd[(m0 + t) * (a.K / 256) + sb]);
          acc[h][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[e][t]), _mm256_mul_ps(d, xd), acc[h][t]);
          acc[h][t] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(imin[t]), _mm256_mul_ps(dmin, xd), acc[h][t]);
        }
      }
    }
  }
  for (int t = 0; t < TILE; ++t)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + (m0 + t) * N + cg * 16 + 8 * h, acc[h][t]);
}

template <int BITS, int G, int TILE>
void tile(const C16Acts& a, const C16Weight& w, int64_t cg, int64_t m0, float* y, int64_t N) {
  tile_pass<BITS, G, TILE, 1>(a, w, cg, m0, y, N);
}

// Forwards of at most this many rows run both halves in one pass (Q4_K, Q5_K). Measured on Zen 3, one thread,
// row-chunks per ns, one half a pass -> both: Q4_K 2 rows 1.8-2.1 -> 2.1-2.5, 4 rows 2.6 -> 3.1, 8 rows (4 + 4)
// 3.0 -> 3.1, 5-7 rows lose (4 + a remainder); Q5_K 2-4 rows +5-14%; Q6_K (more unpacking per code) loses at 1
// row and gains nothing at 4, so it keeps one half a pass.
constexpr int kJointRows = 4;

template <int BITS, int G, int TILE>
void joint_tile(const C16Acts& a, const C16Weight& w, int64_t cg, int64_t m0, float* y, int64_t N) {
  tile_pass<BITS, G, TILE, 2>(a, w, cg, m0, y, N);
}
#endif

// AMX on or off for this process: set_amx (SPECDECODE_AMX=0 through settings.py) (an A/B of the two in one process).
std::atomic<bool> amx_wanted{true};

#if defined(__AMX_TILE__) && defined(__AMX_INT8__) && defined(__AVX512F__) && defined(__AVX512BW__) && \
    defined(__AVX512VNNI__)
// Q4_K and Q6_K forwards of many rows (a prompt) on AMX: tile products of 16 rows x 16 channels x 64 weights. A
// tile's depth spans two 32-weight sub-blocks, so the sub-block scales go into the weights, split in two to stay
// bytes: for Q4_K scale = 8 hi + lo (hi, lo <= 7, code x either <= 105), and the sum over a superblock is (codes x
// lo) + 8 x (codes x hi), the same exact integer the VNNI tile sums sub-block by sub-block (Q6_K: four products,
// below). The min terms and the float steps are the VNNI tile's, in its order, so every row is bit for bit what
// that tile (and a one-row forward) gives. A channel group's weights are unpacked once for all the rows.
constexpr bool kAmxKernel = true;
// Fewer rows: the VNNI tile alone. Unpacking a channel group's weights for the tiles is paid once per forward,
// so AMX gains with the rows: on an Emerald Rapids VM (2 vCPUs) a Q4_K or Q6_K layer took 0.74-0.76x VNNI's
// speed at 16 rows, ~1.0x at 32-48, 1.2x at 64 and 1.3-1.4x at 128 (BENCHMARKS.md, "AMX for prompts").
constexpr int64_t kAmxMinRows = 48;

// Linux gives a process the tile state only when asked (arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
bool amx_granted() {
  static const bool granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return granted;
}

// Tile state is per thread: every tile 16 rows of 64 bytes (int8 [16, 64] operands, int32 [16, 16] sums).
void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
}

// The low byte of a 16-bit product depends on the operands' low bytes only, and these products fit a byte: so
// even bytes multiply in place and odd ones one byte up, signed or not.
inline __m512i byte_products(__m512i x, __m512i even_y, __m512i odd_y) {
  const __m512i low_bytes = _mm512_set1_epi16(0x00FF), high_bytes = _mm512_set1_epi16(static_cast<int16_t>(0xFF00));
  return _mm512_or_si512(_mm512_and_si512(_mm512_mullo_epi16(x, even_y), low_bytes),
                         _mm512_mullo_epi16(_mm512_and_si512(x, high_bytes), odd_y));
}

constexpr int64_t kQ4UnpackedPerSuperblock = 8192;  // 4 depths x 2 halves x [16 rows, 64 bytes]

// Superblock sb of channel group cg, its codes x split scales per depth and half: the B operands, rows of 4 weights
// of 16 channels (what the packed `lo` vectors already hold, a nibble each).
void unpack_q4k(const C16Weight& w, int64_t cg, int64_t sb, uint8_t* out) {
  const __m512i seven = _mm512_set1_epi8(0x07), low_bytes = _mm512_set1_epi16(0x00FF);
  const __m512i spread = _mm512_set1_epi32(0x01010101);
  const int64_t at = cg * w.nsb + sb;
  const uint8_t* lo = w.lo + at * 32 * 64;
  const int8_t* sc = w.sc + at * 8 * 16;
  for (int u = 0; u < 8; ++u) {
    // the sub-block's scale of each channel in the 4 bytes of its lane, then its two 3-bit halves
    const __m512i s = _mm512_mullo_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + u * 16))), spread);
    const __m512i halves[2] = {_mm512_and_si512(s, seven), _mm512_and_si512(_mm512_srli_epi16(s, 3), seven)};
    for (int h = 0; h < 2; ++h) {
      const __m512i even_scale = _mm512_and_si512(halves[h], low_bytes), odd_scale = _mm512_srli_epi16(halves[h], 8);
      for (int j = 8 * u; j < 8 * u + 8; ++j) {  // chunk j: 4 weights of 16 channels
        _mm512_storeu_si512(out + ((j / 16) * 2 + h) * 1024 + (j % 16) * 64,
                            byte_products(chunk_codes<4>(lo, nullptr, j), even_scale, odd_scale));
      }
    }
  }
}

// Rows [m0, m0 + 16 ROW_TILES) of channel group cg, from its unpacked weights `b` (every superblock's): per
// superblock the tile products, then the VNNI tile's float steps on their sums.
template <int ROW_TILES>
void amx_q4k_rows(const C16Acts& a, const C16Weight& w, const uint8_t* b, int64_t cg, int64_t m0, float* y,
                  int64_t N) {
  constexpr int R = ROW_TILES * 16;
  alignas(64) int32_t sums[ROW_TILES][2][16][16];
  __m512 acc[R];
  for (int t = 0; t < R; ++t) acc[t] = _mm512_setzero_ps();
  const int8_t* rows = a.q + m0 * a.K;
  for (int64_t sb = 0; sb < w.nsb; ++sb) {
    _tile_zero(4);
    _tile_zero(5);
    if constexpr (ROW_TILES == 2) {
      _tile_zero(6);
      _tile_zero(7);
    }
    const uint8_t* bs = b + sb * kQ4UnpackedPerSuperblock;
    for (int depth = 0; depth < 4; ++depth) {
      const int8_t* col = rows + sb * 256 + depth * 64;
      _tile_loadd(0, col, a.K);
      _tile_loadd(1, bs + (depth * 2) * 1024, 64);
      _tile_loadd(2, bs + (depth * 2 + 1) * 1024, 64);
      _tile_dpbssd(4, 0, 1);
      _tile_dpbssd(5, 0, 2);
      if constexpr (ROW_TILES == 2) {
        _tile_loadd(3, col + 16 * a.K, a.K);
        _tile_dpbssd(6, 3, 1);
        _tile_dpbssd(7, 3, 2);
      }
    }
    _tile_stored(4, sums[0][0], 64);
    _tile_stored(5, sums[0][1], 64);
    if constexpr (ROW_TILES == 2) {
      _tile_stored(6, sums[1][0], 64);
      _tile_stored(7, sums[1][1], 64);
    }
    const int64_t at = cg * w.nsb + sb;
    const __m512 d = load_f16x16(w.d + at * 16), dmin = load_f16x16(w.dmin + at * 16);
    __m512i mins[4];
    for (int p = 0; p < 4; ++p)
      mins[p] = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.mn + (at * 4 + p) * 32)));
    for (int t = 0; t < R; ++t) {
      const int32_t* pairs = a.pairs + (m0 + t) * (a.K / 64) + sb * 4;
      const __m512i isum = _mm512_add_epi32(_mm512_load_si512(sums[t / 16][0][t % 16]),
                                            _mm512_slli_epi32(_mm512_load_si512(sums[t / 16][1][t % 16]), 3));
      __m512i imin = _mm512_setzero_si512();
      for (int p = 0; p < 4; ++p) imin = _mm512_dpwssd_epi32(imin, mins[p], _mm512_set1_epi32(pairs[p]));
      const __m512 xd = _mm512_set1_ps(a.xd[(m0 + t) * (a.K / 256) + sb]);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, xd), acc[t]);
      acc[t] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(imin), _mm512_mul_ps(dmin, xd), acc[t]);
    }
  }
  for (int t = 0; t < R; ++t) _mm512_storeu_ps(y + (m0 + t) * N + cg * 16, acc[t]);
}

// Q6_K: codes c = code - 32 in [-32, 31] and signed 8-bit sub-block scales s (16 weights each), so c x s needs up
// to 13 bits. Both split in two, c = c_lo + 8 c_hi (c_lo in [0, 7], c_hi in [-4, 3]) and s = s_lo + 16 s_hi
// (s_lo in [0, 15], s_hi in [-8, 7]), make four byte products that fit: sum = P(c_lo s_lo) + 16 P(c_lo s_hi)
// + 8 P(c_hi s_lo) + 128 P(c_hi s_hi), exactly the VNNI tile's sum of scale x (code sums - 32 x activation sums).
constexpr int64_t kQ6UnpackedPerSuperblock = 16384;  // 4 depths x 4 products x [16 rows, 64 bytes]

void unpack_q6k(const C16Weight& w, int64_t cg, int64_t sb, uint8_t* out) {
  const __m512i seven = _mm512_set1_epi8(0x07);
  const __m512i four = _mm512_set1_epi8(4), low_bytes = _mm512_set1_epi16(0x00FF);
  const __m512i spread = _mm512_set1_epi32(0x01010101), byte = _mm512_set1_epi32(0xFF);
  const int64_t at = cg * w.nsb + sb;
  const uint8_t* lo = w.lo + at * 32 * 64;
  const uint8_t* hi = w.hi + at * 16 * 64;
  const int8_t* sc = w.sc + at * 16 * 16;
  for (int u = 0; u < 16; ++u) {
    const __m512i s = _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + u * 16)));
    const __m512i halves[2] = {_mm512_mullo_epi32(_mm512_and_si512(s, _mm512_set1_epi32(15)), spread),
                               _mm512_mullo_epi32(_mm512_and_si512(_mm512_srai_epi32(s, 4), byte), spread)};
    __m512i even[2], odd[2];
    for (int h = 0; h < 2; ++h) even[h] = _mm512_and_si512(halves[h], low_bytes), odd[h] = _mm512_srli_epi16(halves[h], 8);
    for (int j = 4 * u; j < 4 * u + 4; ++j) {  // chunk j: 4 weights of 16 channels
      const __m512i codes = chunk_codes<6>(lo, hi, j);
      const __m512i c_lo = _mm512_and_si512(codes, seven);
      const __m512i c_hi = _mm512_sub_epi8(_mm512_and_si512(_mm512_srli_epi16(codes, 3), seven), four);
      uint8_t* d = out + (j / 16) * 4 * 1024 + (j % 16) * 64;
      _mm512_storeu_si512(d, byte_products(c_lo, even[0], odd[0]));
      _mm512_storeu_si512(d + 1024, byte_products(c_lo, even[1], odd[1]));
      _mm512_storeu_si512(d + 2048, byte_products(c_hi, even[0], odd[0]));
      _mm512_storeu_si512(d + 3072, byte_products(c_hi, even[1], odd[1]));
    }
  }
}

// Rows [m0, m0 + 16) of channel group cg of a Q6_K layer (as amx_q4k_rows).
void amx_q6k_rows(const C16Acts& a, const C16Weight& w, const uint8_t* b, int64_t cg, int64_t m0, float* y,
                  int64_t N) {
  alignas(64) int32_t sums[4][16][16];
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  const int8_t* rows = a.q + m0 * a.K;
  for (int64_t sb = 0; sb < w.nsb; ++sb) {
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int depth = 0; depth < 4; ++depth) {
      _tile_loadd(0, rows + sb * 256 + depth * 64, a.K);
      const uint8_t* bd = b + sb * kQ6UnpackedPerSuperblock + depth * 4 * 1024;
      _tile_loadd(1, bd, 64);
      _tile_dpbssd(4, 0, 1);
      _tile_loadd(2, bd + 1024, 64);
      _tile_dpbssd(5, 0, 2);
      _tile_loadd(1, bd + 2048, 64);
      _tile_dpbssd(6, 0, 1);
      _tile_loadd(2, bd + 3072, 64);
      _tile_dpbssd(7, 0, 2);
    }
    _tile_stored(4, sums[0], 64);
    _tile_stored(5, sums[1], 64);
    _tile_stored(6, sums[2], 64);
    _tile_stored(7, sums[3], 64);
    const __m512 d = load_f16x16(w.d + (cg * w.nsb + sb) * 16);
    for (int t = 0; t < 16; ++t) {
      __m512i isum = _mm512_add_epi32(_mm512_load_si512(sums[0][t]), _mm512_slli_epi32(_mm512_load_si512(sums[1][t]), 4));
      isum = _mm512_add_epi32(isum, _mm512_slli_epi32(_mm512_load_si512(sums[2][t]), 3));
      isum = _mm512_add_epi32(isum, _mm512_slli_epi32(_mm512_load_si512(sums[3][t]), 7));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum),
                               _mm512_mul_ps(d, _mm512_set1_ps(a.xd[(m0 + t) * (a.K / 256) + sb])), acc[t]);
    }
  }
  for (int t = 0; t < 16; ++t) _mm512_storeu_ps(y + (m0 + t) * N + cg * 16, acc[t]);
}

// Channel groups [first, last) of a Q4_K or Q6_K layer, its whole 16-row tiles -> the rows done (the VNNI tile
// does the rest, and the bias is added after). A channel group's weights are unpacked once for all its rows.
int64_t amx_rows(const C16Acts& a, const C16Weight& w, int bits, int64_t first, int64_t last, int64_t M, int64_t N,
                 float* y) {
  const int64_t per_superblock = bits == 4 ? kQ4UnpackedPerSuperblock : kQ6UnpackedPerSuperblock;
  uint8_t* b = tile_scratch(static_cast<size_t>(w.nsb * per_superblock));
  const int64_t whole = M / 16 * 16;
  configure_tiles();
  for (int64_t cg = first; cg < last; ++cg) {
    int64_t m = 0;
    if (bits == 4) {
      for (int64_t sb = 0; sb < w.nsb; ++sb) unpack_q4k(w, cg, sb, b + sb * per_superblock);
      for (; m + 32 <= whole; m += 32) amx_q4k_rows<2>(a, w, b, cg, m, y, N);
      if (m < whole) amx_q4k_rows<1>(a, w, b, cg, m, y, N);
    } else {
      for (int64_t sb = 0; sb < w.nsb; ++sb) unpack_q6k(w, cg, sb, b + sb * per_superblock);
      for (; m < whole; m += 16) amx_q6k_rows(a, w, b, cg, m, y, N);
    }
  }
  _tile_release();
  return whole;
}
#else
constexpr bool kAmxKernel = false;
constexpr int64_t kAmxMinRows = 0;
bool amx_granted() { return false; }
int64_t amx_rows(const C16Acts&, const C16Weight&, int, int64_t, int64_t, int64_t, int64_t, float*) { return 0; }
#endif

using TileFn = void (*)(const C16Acts&, const C16Weight&, int64_t, int64_t, float*, int64_t);

template <int BITS, int G, int... T>
std::vector<TileFn> tiles(std::integer_sequence<int, T...>) {
  return {&tile<BITS, G, T + 1>...};
}

template <int BITS, int G, int... T>
std::vector<TileFn> joint_tiles(std::integer_sequence<int, T...>) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  return {};
#else
  return {&joint_tile<BITS, G, T + 1>...};
#endif
}

// x [M, K] -> int8 codes per 256 (as quant_cpu.cpp, the same rounding) and int16 sums per sub-block, in pairs.
void quantize_acts(const float* x, int64_t M, int64_t K, int64_t G, int8_t* q, float* xd, int32_t* pairs) {
  at::parallel_for(0, M, 1, [&](int64_t first, int64_t last) {
    for (int64_t m = first; m < last; ++m) {
      for (int64_t sb = 0; sb < K / 256; ++sb)
        xd[m * (K / 256) + sb] = specdecode::quantize_block(x + m * K + sb * 256, 256, q + m * K + sb * 256);
      for (int64_t p = 0; p < K / G / 2; ++p) {
        int32_t s0 = 0, s1 = 0;
        for (int i = 0; i < G; ++i) s0 += q[m * K + 2 * p * G + i], s1 += q[m * K + (2 * p + 1) * G + i];
        pairs[m * (K / G / 2) + p] = static_cast<int32_t>((static_cast<uint32_t>(static_cast<uint16_t>(s1)) << 16) |
                                                          static_cast<uint16_t>(s0));
      }
    }
  });
}

}  // namespace

LinearWork linear_c16_work(const at::Tensor& x, const at::Tensor& lo, const at::Tensor& hi,
                           const at::Tensor& sc, const at::Tensor& mn, const at::Tensor& d,
                           const at::Tensor& dmin, const at::Tensor& bias, int64_t bits, int64_t G,
                           QuantizedActs& acts) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [M, K] float32");
  const int64_t M = x.size(0), K = x.size(1), ng = lo.size(0), nsb = lo.size(1), N = ng * 16;
  TORCH_CHECK(K == nsb * 256, "x has ", K, " columns, the weight ", nsb * 256);
  static const std::vector<TileFn> q4 = tiles<4, 32>(std::make_integer_sequence<int, kTile>{});
  static const std::vector<TileFn> q5 = tiles<5, 32>(std::make_integer_sequence<int, kTile>{});
  static const std::vector<TileFn> q6 = tiles<6, 16>(std::make_integer_sequence<int, kTile>{});
  static const std::vector<TileFn> q4_joint = joint_tiles<4, 32>(std::make_integer_sequence<int, kJointRows>{});
  static const std::vector<TileFn> q5_joint = joint_tiles<5, 32>(std::make_integer_sequence<int, kJointRows>{});
  const bool joint = bits != 6 && M <= kJointRows;
  const std::vector<TileFn>& fns = joint ? (bits == 4 ? q4_joint : q5_joint) : bits == 4 ? q4 : bits == 5 ? q5 : q6;
  const int64_t max_rows = joint ? kJointRows : kTile;
  TORCH_CHECK((bits == 6) == (G == 16) && bits >= 4 && bits <= 6, "no kernel for bits=", bits, " G=", G);
  TORCH_CHECK(!bias.numel() || bias.numel() == N, "bias must have one value per output");
  // the activations of this input in this format: quantized once for every layer of a group that reads it
  auto& quantized = acts.by_format[G];
  if (quantized.empty()) {
    quantized = {at::empty({M, K}, x.options().dtype(at::kChar)), at::empty({M, K / 256}, x.options()),
                 at::empty({M, K / G / 2}, x.options().dtype(at::kInt))};
    quantize_acts(x.data_ptr<float>(), M, K, G, quantized[0].data_ptr<int8_t>(), quantized[1].data_ptr<float>(),
                  quantized[2].data_ptr<int32_t>());
  }
  // A prompt's rows of a Q4_K or Q6_K layer on AMX, where the CPU has it (bit-identical rows: see amx_q4k_rows)
  const bool amx = bits != 5 && M >= kAmxMinRows && amx_on();
  const C16Acts a{quantized[0].data_ptr<int8_t>(), quantized[1].data_ptr<float>(), quantized[2].data_ptr<int32_t>(),
                  K};
  const auto* d16 = reinterpret_cast<const uint16_t*>(d.data_ptr<at::Half>());
  const auto* m16 = dmin.numel() ? reinterpret_cast<const uint16_t*>(dmin.data_ptr<at::Half>()) : nullptr;
  const C16Weight w{lo.data_ptr<uint8_t>(), hi.numel() ? hi.data_ptr<uint8_t>() : nullptr, sc.data_ptr<int8_t>(),
                    mn.numel() ? mn.data_ptr<int8_t>() : nullptr, d16, m16, nsb};
  auto y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  LinearWork work;
  work.units = ng;
  // the tensors behind `a` and `w` are held by the caller (the activations by `acts`) until the work is done
  work.run = [a, w, fns = &fns, M, N, yp, bp, bits, max_rows, amx](int64_t first, int64_t last) {
    // The first superblocks of this thread's share, asked for at once (the tiles prefetch kAhead ahead of
    // themselves): a small layer would otherwise start each share at the memory's latency.
    for (int64_t at = first * w.nsb; at < std::min(last * w.nsb, first * w.nsb + kAhead); ++at) {
      for (int line = 0; line < 32; ++line) prefetch_weights(w.lo + (at * 32 + line) * 64);
      if (w.hi != nullptr)
        for (int line = 0; line < 16; ++line) prefetch_weights(w.hi + (at * 16 + line) * 64);
      prefetch_weights(w.sc + at * (bits == 6 ? 16 : 8) * 16);
      prefetch_weights(w.d + at * 16);
    }
    // rows AMX computed are skipped (a multiple of 16: the VNNI tiles of max_rows start on them)
    const int64_t done = amx ? amx_rows(a, w, static_cast<int>(bits), first, last, M, N, yp) : 0;
    run_channel_groups(first, last, M, N, max_rows, yp, bp, [&](int64_t cg, int64_t m, int64_t rows) {
      if (m >= done) (*fns)[rows - 1](a, w, cg, m, yp, N);
    });
  };
  work.done = [y] { return y; };
  work.y = yp, work.rows = M, work.cols = N;
  return work;
}

bool amx_on() { return kAmxKernel && amx_wanted.load() && amx_granted(); }

int64_t amx_min_rows() { return amx_on() ? kAmxMinRows : 0; }

void set_amx(bool on) { amx_wanted.store(on); }

at::Tensor linear_c16(const at::Tensor& x, const at::Tensor& lo, const at::Tensor& hi,
                      const at::Tensor& sc, const at::Tensor& mn, const at::Tensor& d,
                      const at::Tensor& dmin, const at::Tensor& bias, int64_t bits, int64_t G) {
  QuantizedActs acts;
  return run_alone(linear_c16_work(x, lo, hi, sc, mn, d, dmin, bias, bits, G, acts));
}
