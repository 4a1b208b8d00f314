// Attention over a bfloat16 cache in AVX-512 BF16 dot products (vdpbf16ps: two bfloat16 products added into a
// float32 lane), for CPUs that have them without AMX tiles (AMD Zen 4 and 5, Intel Cooper Lake, or AMX turned off).
// The same contract as attention_cpu.cpp's AmxUnit: a row's first F[r] slots (whole blocks of 32, from 64 slots on;
// the split depends on the row's own slot count only) are scored and weighed here, queries and softmax weights
// rounded to bfloat16 (by vcvtneps2bf16, which flushes denormals: other bits than the tiles' there), and its other
// slots go on through the float path from these sums. Every lane's sum runs over its row's own slots in one fixed
// order, so a row computes the same bits alone, in a verify forward or in a prompt's chunk, and a tree row reading
// its ancestors' scattered slots the bits of its path laid out in order.
//
// Scores: 16 keys a vector. A block of 16 keys is transposed once (lane i of vector p: key i's p-th pair of
// dimensions) for every row and head that reads it, and a head's query pair p, broadcast, meets vector p: a
// head's 16 scores need D / 2 dot products and no horizontal sums. Values: 16 dimensions a vector, two slots a
// lane (the slot pair's values interleaved once per block of 32 slots for every row and head), the pair's two
// weights broadcast. Against the float path this halves the multiply-add instructions, which bound verify rows
// and prompt chunks over long caches.
#pragma once
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "aten_lite.h"

namespace specdecode {

// Of R rows whose first F[r] slots run in bfloat16 products (their first prefix[r] the cache's own): the rows
// [first, last] that read slots [j0, j0 + width), and whether all of them read the cache's own there (then one
// block serves them all). Shared by the AMX tiles (attention_cpu.cpp) and the dot products below.
inline bool block_readers(int64_t R, const int64_t* F, const int64_t* prefix, int64_t j0, int64_t width,
                          int64_t& first, int64_t& last) {
  bool own = true;
  first = R, last = -1;
  for (int64_t r = 0; r < R; ++r)
    if (F[r] >= j0 + width) first = std::min(first, r), last = r, own = own && j0 + width <= prefix[r];
  return own;
}

}  // namespace specdecode

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SPECDECODE_BF16_DOTS 1

namespace specdecode {

// Whether attention over a bfloat16 cache runs in these dot products where AMX does not (on by default;
// set_bf16_dots, SPECDECODE_BF16_DOTS=0 through settings.py: the float path's bits instead).
bool bf16_dots_on();

// 16 rows of 16 32-bit values -> 16 columns: r[i] lane c becomes r[c] lane i.
inline void transpose16(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {  // u[4 i + c]: in each 128-bit lane L, column 4 L + c of rows 4 i .. 4 i + 3
    u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int c = 0; c < 4; ++c) {
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xDD);
    const __m512i w0 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
    const __m512i w1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xDD);
    r[c] = _mm512_shuffle_i32x4(v0, w0, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(v1, w1, 0x88);
    r[8 + c] = _mm512_shuffle_i32x4(v0, w0, 0xDD);
    r[12 + c] = _mm512_shuffle_i32x4(v1, w1, 0xDD);
  }
}

inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
  return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh&>(a), reinterpret_cast<__m512bh&>(b));
}

// One unit's part in dot products: R rows of G heads (query n = r G + g at q + r D + g stride) against keys k and
// values v [slots, D] bfloat16. Row r's first F[r] slots (a multiple of 32); its j-th slot slot(r, j), of which
// the first prefix[r] are the cache's own [0, prefix[r]). D a multiple of 64.
template <typename Slot>
struct DotsUnit {
  int64_t R, G, D;
  const int64_t* F;
  const int64_t* prefix;
  Slot slot;
  int64_t NQ, FM;  // queries, the largest F

  DotsUnit(int64_t R_, int64_t G_, int64_t D_, const int64_t* F_, const int64_t* prefix_, Slot slot_)
      : R(R_), G(G_), D(D_), F(F_), prefix(prefix_), slot(slot_), NQ(R_ * G_), FM(0) {
    for (int64_t r = 0; r < R; ++r) FM = std::max(FM, F[r]);
  }

  // run(std::integral_constant<int, NH>, g0) for each group of a row's heads: at most six a group (six chains of
  // dot products in flight; 24 value sums in registers), as even as G allows.
  template <typename Run>
  void each_group(Run run) const {
    const int64_t groups = (G + 5) / 6;
    for (int64_t group = 0, g0 = 0; group < groups; ++group) {
      const int64_t heads = G / groups + (group < G % groups);
      switch (heads) {
        case 1: run(std::integral_constant<int, 1>(), g0); break;
        case 2: run(std::integral_constant<int, 2>(), g0); break;
        case 3: run(std::integral_constant<int, 3>(), g0); break;
        case 4: run(std::integral_constant<int, 4>(), g0); break;
        case 5: run(std::integral_constant<int, 5>(), g0); break;
        default: run(std::integral_constant<int, 6>(), g0); break;
      }
      g0 += heads;
    }
  }

  bool readers(int64_t j0, int64_t width, int64_t& first, int64_t& last) const {
    return specdecode::block_readers(R, F, prefix, j0, width, first, last);
  }

  // Scores of every row's first F[r] slots into out + n s_stride + j, times scale. Two blocks of 16 keys a pass: a
  // head's two chains of dot products are independent, so six heads keep twelve in flight, enough to cover the
  // dot product's latency (six chains ran at half its throughput). Each score is still one chain over p in order.
  void scores(const float* q, int64_t stride, const at::BFloat16* k, float scale, float* out, int64_t s_stride) {
    thread_local std::vector<uint16_t> qb_buffer;
    thread_local std::vector<uint32_t> kt_buffer;
    const int64_t P = D / 2;  // dimension pairs a key
    uint16_t* qb = scratch(qb_buffer, NQ * D);  // each query rounded to bfloat16
    uint32_t* kt = scratch(kt_buffer, 2 * P * 16);  // [2 blocks][P][16 keys]: 32 keys transposed
    for (int64_t n = 0; n < NQ; ++n) {
      const float* x = q + (n / G) * D + (n % G) * stride;
      for (int64_t d = 0; d < D; d += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(qb + n * D + d), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + d)));
    }
    const uint32_t* keys = reinterpret_cast<const uint32_t*>(k);  // [slots][P]
    auto transpose = [&](auto row_of) {  // keys row_of(0 .. 31) into the two blocks
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t p0 = 0; p0 < P; p0 += 16) {
          __m512i block[16];
          for (int i = 0; i < 16; ++i) block[i] = _mm512_loadu_si512(keys + row_of(16 * b + i) * P + p0);
          transpose16(block);
          for (int i = 0; i < 16; ++i) _mm512_store_si512(kt + (b * P + p0 + i) * 16, block[i]);
        }
    };
    // row r's heads against the transposed blocks, 2 NH chains at a time; `ahead` (or null): the D lines of the next
    // block, two fetched a pair p
    auto dots = [&](int64_t r, int64_t j0, const char* ahead) {
      each_group([&](auto nh, int64_t g0) {
        constexpr int NH = decltype(nh)::value;
        const uint32_t* qp[NH];
        __m512 acc[NH][2];
        for (int h = 0; h < NH; ++h) {
          qp[h] = reinterpret_cast<const uint32_t*>(qb + (r * G + g0 + h) * D);
          acc[h][0] = acc[h][1] = _mm512_setzero_ps();
        }
        for (int64_t p = 0; p < P; ++p) {
          if (ahead && g0 == 0) _mm_prefetch(ahead + 128 * p, _MM_HINT_T0), _mm_prefetch(ahead + 128 * p + 64, _MM_HINT_T0);
          const __m512i low = _mm512_load_si512(kt + p * 16), high = _mm512_load_si512(kt + (P + p) * 16);
          for (int h = 0; h < NH; ++h) {
            const __m512i pair = _mm512_set1_epi32(static_cast<int>(qp[h][p]));
            acc[h][0] = dot_pairs(acc[h][0], pair, low);
            acc[h][1] = dot_pairs(acc[h][1], pair, high);
          }
        }
        for (int h = 0; h < NH; ++h)
          for (int b = 0; b < 2; ++b)
            _mm512_storeu_ps(out + (r * G + g0 + h) * s_stride + j0 + 16 * b, _mm512_mul_ps(acc[h][b], _mm512_set1_ps(scale)));
      });
    };
    for (int64_t j0 = 0; j0 < FM; j0 += 32) {  // F[r] is a multiple of 32
      int64_t first, last;
      // the cache's own keys a block ahead into L1, a few lines among each pair's dot products: the transposes'
      // loads stalled on memory, which the hardware's prefetch did not cover, and the block's 128 prefetches at
      // once left it so (they wait for the core's few outstanding misses); spread, a one-row forward's attention
      // over 28 layers of 7,600 cached tokens took half the time
      const char* ahead = j0 + 64 <= FM ? reinterpret_cast<const char*>(keys + (j0 + 32) * P) : nullptr;
      if (readers(j0, 32, first, last)) {
        transpose([&](int i) { return j0 + i; });
        for (int64_t r = first; r <= last; ++r)
          if (F[r] >= j0 + 32) dots(r, j0, r == first ? ahead : nullptr);
        continue;
      }
      for (int64_t r = first; r <= last; ++r) {  // some row reads other slots here: each row its own
        if (F[r] < j0 + 32) continue;
        transpose([&](int i) { return slot(r, j0 + i); });
        dots(r, j0, r == first ? ahead : nullptr);
      }
    }
  }

  // The weighted values of every row's first F[r] slots (its weights at weights + n s_stride + j, unnormalised),
  // into out + r out_row + g D, where the float path continues. A block of 32 slots' values is packed whole (all D
  // dimensions, 2 D bytes a slot in L1) and then weighed 64 dimensions a pass: each value row comes from memory
  // once (passes over the slots for each 64 dimensions read every row twice). Each lane's sum still runs over its
  // row's slots in order.
  void values(const at::BFloat16* v, const float* weights, int64_t s_stride, float* out, int64_t out_row) {
    thread_local std::vector<uint16_t> wb_buffer;
    thread_local std::vector<uint32_t> vt_buffer;
    const int64_t C = D / 16;  // vectors of packed pairs a slot pair: D / 64 passes of 4
    uint16_t* wb = scratch(wb_buffer, NQ * FM);  // [NQ][FM]: weights rounded to bfloat16
    uint32_t* vt = scratch(vt_buffer, 16 * C * 16);  // [16 slot pairs][C][16]: a block's values interleaved
    for (int64_t n = 0; n < NQ; ++n) {  // the bound held apart: stores through wb would reload it, with a division
      const int64_t f = F[n / G];
      const float* from = weights + n * s_stride;
      uint16_t* to = wb + n * FM;
      for (int64_t j = 0; j < f; j += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(to + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(from + j)));
    }
    const uint16_t* values = reinterpret_cast<const uint16_t*>(v);
    // vt[k][4 pass + c]: the values of slots 2k and 2k + 1 as pairs, 16 dimensions a vector, in unpack order (c =
    // 0, 1: the low and high halves of each 8 of the pass's dimensions d0 .. d0 + 31; 2, 3: of d0 + 32 ..): one
    // shuffle a vector, where widening each row's values to 32 bits took four. `unpacked` puts the sums back in
    // order at the end.
    auto pack = [&](auto row_of) {
      for (int k = 0; k < 16; ++k) {
        const uint16_t* even = values + row_of(2 * k) * D;
        const uint16_t* odd = values + row_of(2 * k + 1) * D;
        for (int64_t half = 0; half < D / 32; ++half) {
          const __m512i e = _mm512_loadu_si512(even + 32 * half), o = _mm512_loadu_si512(odd + 32 * half);
          _mm512_store_si512(vt + (k * C + 2 * half) * 16, _mm512_unpacklo_epi16(e, o));
          _mm512_store_si512(vt + (k * C + 2 * half + 1) * 16, _mm512_unpackhi_epi16(e, o));
        }
      }
    };
    // row r's heads over the packed block, from their sums so far; `ahead` (or null): the D lines of the next
    // block's values, four fetched a slot pair and pass
    auto weigh = [&](int64_t r, int64_t j0, const char* ahead) {
      for (int64_t d0 = 0; d0 < D; d0 += 64)
        each_group([&](auto nh, int64_t g0) {
          constexpr int NH = decltype(nh)::value;
          __m512 acc[NH][4];
          const uint32_t* w[NH];
          for (int h = 0; h < NH; ++h) {
            w[h] = reinterpret_cast<const uint32_t*>(wb + (r * G + g0 + h) * FM + j0);
            const float* o = out + r * out_row + (g0 + h) * D + d0;
            for (int c = 0; c < 4; ++c) acc[h][c] = j0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(o + 16 * c);
          }
          for (int k = 0; k < 16; ++k) {
            if (ahead && g0 == 0)
              for (int l = 0; l < 4; ++l) _mm_prefetch(ahead + 64 * (4 * (k + 16 * (d0 / 64)) + l), _MM_HINT_T0);
            __m512i pair[4];
            for (int c = 0; c < 4; ++c) pair[c] = _mm512_load_si512(vt + (k * C + d0 / 16 + c) * 16);
            for (int h = 0; h < NH; ++h) {
              const __m512i weight = _mm512_set1_epi32(static_cast<int>(w[h][k]));
              for (int c = 0; c < 4; ++c) acc[h][c] = dot_pairs(acc[h][c], weight, pair[c]);
            }
          }
          for (int h = 0; h < NH; ++h) {
            float* o = out + r * out_row + (g0 + h) * D + d0;
            for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + 16 * c, acc[h][c]);
          }
        });
    };
    for (int64_t j0 = 0; j0 < FM; j0 += 32) {
      int64_t first, last;
      // the next block's values into L1, spread over this block's products as the keys are in scores
      const char* ahead = j0 + 64 <= FM ? reinterpret_cast<const char*>(values + (j0 + 32) * D) : nullptr;
      if (readers(j0, 32, first, last)) {
        pack([&](int j) { return j0 + j; });
        for (int64_t r = first; r <= last; ++r)
          if (F[r] >= j0 + 32) weigh(r, j0, r == first ? ahead : nullptr);
        continue;
      }
      for (int64_t r = first; r <= last; ++r) {
        if (F[r] < j0 + 32) continue;
        pack([&](int j) { return slot(r, j0 + j); });
        weigh(r, j0, r == first ? ahead : nullptr);
      }
    }
    for (int64_t n = 0; n < NQ; ++n)
      if (F[n / G] > 0) unpacked(out + (n / G) * out_row + (n % G) * D);
  }

  // A head's sums from unpack order (pack above) into dimension order, 32 dimensions at a time: lane i of the low
  // vector holds dimension 8 (i / 4) + i % 4, of the high one 8 (i / 4) + 4 + i % 4.
  void unpacked(float* sums) const {
    for (int64_t d = 0; d < D; d += 32) {
      float held[32];
      std::memcpy(held, sums + d, sizeof held);
      for (int i = 0; i < 16; ++i) {
        sums[d + 8 * (i / 4) + i % 4] = held[i];
        sums[d + 8 * (i / 4) + 4 + i % 4] = held[16 + i];
      }
    }
  }
};

}  // namespace specdecode
#endif
