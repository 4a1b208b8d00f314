// Decode attention for CPUs with AVX2 + FMA: each query row attends to its own list of KV cache slots, computed by
// one fixed sequence of operations that depends only on that row's slots, never on how many rows are in the call.
// With the batch-invariant linear kernel this makes a verify forward equal one-token forwards bit for bit; it is
// also far cheaper than one stock attention call per row.
//
// q [B, H, T, D] float32; k_cache, v_cache [B, Hkv, S_max, D] float32 or bfloat16. Row t attends to slots
// [0, spans[t]) and then to the slots extras[t] in order (a tree node's ancestors: empty for a chain). A tree row
// whose ancestors sit at scattered slots thus runs exactly the operations a one-token forward of its path runs
// over contiguous slots. Grouped-query attention: head h reads KV head h / (H / Hkv). Returns [B, H, T, D] float32,
// a view of [B, T, H, D] memory: each row's heads side by side, the o projection's input without a copy.
#include "aten_lite.h"
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "amx_tiles.h"
#include "attention_bf16_dots.h"
#include "kernels.h"
#include "simd.h"

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  return specdecode::load_bf16x8(reinterpret_cast<const uint16_t*>(p));
}

using specdecode::exp8;
using specdecode::lane_sum;

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
#endif

// The lane sums of eight vectors at once, each added in lane_sum's order, ((l0 + l4) + (l2 + l6)) + ((l1 + l5) +
// (l3 + l7)), so each equals lane_sum of its vector bit for bit. Lane i of the result is the sum of a[2 i] for i < 4,
// of a[2 (i - 4) + 1] after: the caller orders its vectors so.
inline __m256 sum8(const __m256* a) {
  __m256 pair[4];  // pair[p]: lanes i + (i + 4) of a[2 p] in its low half, of a[2 p + 1] in its high half
  for (int p = 0; p < 4; ++p)
    pair[p] = _mm256_add_ps(_mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x20),
                            _mm256_permute2f128_ps(a[2 * p], a[2 * p + 1], 0x31));
  __m256 quad[2];  // (s0 + s2), (s1 + s3) of two pairs' vectors, interleaved per half
  for (int h = 0; h < 2; ++h)
    quad[h] = _mm256_add_ps(_mm256_shuffle_ps(pair[2 * h], pair[2 * h + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                            _mm256_shuffle_ps(pair[2 * h], pair[2 * h + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_hadd_ps(quad[0], quad[1]);
}

#if defined(__AVX512F__)
// Scores of P pairs of heads against eight keys: the pair's two heads share a vector (the first in the low eight
// lanes, the second in the high), each key broadcast to both halves, and every key's broadcast serves all P pairs.
// Every lane runs the eight-lane path's multiply-adds in its order, so the scores are its bits. `pairs`: the
// pairs' queries interleaved by eight lanes (pair p's lanes for d at pairs + 2 (p D + d)); head h of the group's
// eight scores go to scores + h * s_stride. With `odd` the last pair's second head is a copy of its first, not
// stored.
template <int P, bool odd, typename T>
inline void score_pairs(const float* pairs, const T* const* keys, int64_t D, float scale, float* scores,
                        int64_t s_stride) {
  __m512 a[P][8];
  for (int p = 0; p < P; ++p)
    for (int i = 0; i < 8; ++i) a[p][i] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m512 qd[P];
    for (int p = 0; p < P; ++p) qd[p] = _mm512_loadu_ps(pairs + 2 * (p * D + d));
    for (int i = 0; i < 8; ++i) {
      const __m512 key = _mm512_broadcast_f32x8(load8(keys[i] + d));  // bfloat16 widens exactly: the same bits
      for (int p = 0; p < P; ++p) a[p][i] = _mm512_fmadd_ps(qd[p], key, a[p][i]);
    }
  }
  for (int p = 0; p < P; ++p) {
    __m256 half[8];
    for (int i = 0; i < 8; ++i) half[i] = _mm512_castps512_ps256(a[p][i]);
    _mm256_storeu_ps(scores + 2 * p * s_stride, _mm256_mul_ps(sum8(half), _mm256_set1_ps(scale)));
    if (odd && p == P - 1) break;
    for (int i = 0; i < 8; ++i) half[i] = _mm512_extractf32x8_ps(a[p][i], 1);
    _mm256_storeu_ps(scores + (2 * p + 1) * s_stride, _mm256_mul_ps(sum8(half), _mm256_set1_ps(scale)));
  }
}
#endif

// Heads [0, count) in groups of at most six, as even as count allows: f(first head, a group size of 1..6 as a
// compile-time constant), so each group's loops over its heads unroll and keep their sums in registers.
template <typename F>
inline void six_head_groups(int64_t count, F&& f) {
  const int64_t groups = (count + 5) / 6;
  for (int64_t group = 0, first = 0; group < groups; ++group) {
    const int64_t heads = count / groups + (group < count % groups);
    switch (heads) {
      case 1: f(first, std::integral_constant<int, 1>()); break;
      case 2: f(first, std::integral_constant<int, 2>()); break;
      case 3: f(first, std::integral_constant<int, 3>()); break;
      case 4: f(first, std::integral_constant<int, 4>()); break;
      case 5: f(first, std::integral_constant<int, 5>()); break;
      default: f(first, std::integral_constant<int, 6>()); break;
    }
    first += heads;
  }
}

// Scores of NH heads (query h at q + h * stride) against eight keys, K keys at a time: each key's eight lanes are
// loaded (a bfloat16 one widened) once for all NH heads, and NH K independent chains keep both multiply-add ports
// busy (one head at a time loaded and widened every key for each of its multiply-adds). Each score is still its
// own chain over d from zero, then sum8's lane sum and the scale: the one-head path's bits. Head h's eight scores
// go to scores + h * s_stride, in the keys' order.
template <int NH, int K, typename T>
inline void score_heads(const float* q, int64_t stride, const T* const* keys, int64_t D, float scale, float* scores,
                        int64_t s_stride) {
  static_assert(8 % K == 0 && NH * K <= 12, "K divides the eight keys; the sums, the keys and a query fit 16 registers");
  alignas(32) float parts[NH][8][8];  // head, key, lane: the chains' sums, for sum8
  for (int k0 = 0; k0 < 8; k0 += K) {
    __m256 a[NH][K];
    for (int h = 0; h < NH; ++h)
      for (int i = 0; i < K; ++i) a[h][i] = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) {
      __m256 key[K];
      for (int i = 0; i < K; ++i) key[i] = load8(keys[k0 + i] + d);
      for (int h = 0; h < NH; ++h) {
        const __m256 qd = load8(q + h * stride + d);
        for (int i = 0; i < K; ++i) a[h][i] = _mm256_fmadd_ps(qd, key[i], a[h][i]);
      }
    }
    for (int h = 0; h < NH; ++h)
      for (int i = 0; i < K; ++i) _mm256_store_ps(parts[h][k0 + i], a[h][i]);
  }
  for (int h = 0; h < NH; ++h) {
    __m256 sums[8];
    for (int i = 0; i < 8; ++i) sums[i] = _mm256_load_ps(parts[h][i]);
    _mm256_storeu_ps(scores + h * s_stride, _mm256_mul_ps(sum8(sums), _mm256_set1_ps(scale)));
  }
}

// How far ahead attention asks for the cache rows it reads next (the shared prefix's, in slot order): a one-row
// forward's attention is bound by reading the cache, which no layer's weights leave in the caches. A scratch copy
// of the loop over 28 layers' caches with the caches flushed: 34 -> 27 us per KV head and layer at one row, 300
// slots (16 and 4 ahead; 32 keys ahead or 8 values were no better).
constexpr int64_t kKeysAhead = 16;
constexpr int64_t kValuesAhead = 4;

// `count` cache rows of `width` values each, from `row` on, into L1.
template <typename T>
inline void prefetch_rows(const T* row, int64_t count, int64_t width) {
  const char* begin = reinterpret_cast<const char*>(row);
  const int64_t bytes = count * width * static_cast<int64_t>(sizeof(T));
  for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(begin + at, _MM_HINT_T0);
}

// q . key over D in one chain of fused multiply-adds, then the fixed lane sum: the same operations for every key.
template <typename T>
inline float dot(const float* q, const T* key, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(load8(q + d), load8(key + d), acc);
  return lane_sum(acc);
}

// float32 -> bfloat16 as torch rounds: to nearest, ties to even; a NaN stays a (quiet) NaN
inline uint16_t to_bf16(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
  return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
// Attention over a bfloat16 cache in AMX tile products. A row's first amx_slots(its slot count) slots are scored and
// weighed here: queries and softmax weights rounded to bfloat16 (keys and values already are), the products summed
// in float32 by the tiles; its other slots by the eight-lane path, which continues from these sums. Each element of
// a tile product depends only on its own query and key rows (weights and value rows), never on what else shares
// the tile, and a query whose weights are zero there adds zeros: so a row computes the same bits alone, in a verify
// forward, or in a prompt's chunk, and a tree row gathers its ancestors' slots into the same operands a one-token
// forward of its path reads from the cache. Verify rows and prompt chunks pay 6 query heads' multiply-adds over
// every cached token, bound by the FMA port on the AVX-512 path: 8 rows over 4,000 cached tokens, 28 layers of the
// 1.5B target, took 24.5 ms here against 52.8 in float32 ("Long prompts").
#define SPECDECODE_AMX_ATTENTION 1
#endif

#if defined(SPECDECODE_AMX_ATTENTION) || defined(SPECDECODE_BF16_DOTS)
constexpr int64_t kAmxSlots = 32;  // slots one weights tile spans: a row's bfloat16 part is a multiple of it

// A row's slots in bfloat16 products (AMX tiles or AVX-512 BF16 dots): whole tiles of 32, none under 64 (its tiles
// would be mostly padding).
inline int64_t amx_slots(int64_t count) { return count < 64 ? 0 : count / kAmxSlots * kAmxSlots; }
#endif

#if defined(SPECDECODE_AMX_ATTENTION)

// tile 0: sums (16 x 16 float32), 1: A (16 x 32 bfloat16), 2: B (16 x 16 bfloat16 pairs): 64-byte rows each
inline void configure_attention_tiles() {
  TileConfig config;
  for (int t = 0; t < 3; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  _tile_loadconfig(&config);
}

// 16 (even[i], odd[i]) bfloat16 pairs: a row of a B operand whose depth runs over two value rows
inline __m512i interleave16(const uint16_t* even, const uint16_t* odd) {
  const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(even)));
  const __m512i hi = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(odd)));
  return _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16));
}

// One unit's AMX part: R rows of G heads (query n = r G + g at q + r D + g stride) against keys k and values v
// [slots, D] bfloat16. Row r's first F[r] slots; its j-th slot slot(r, j), of which the first prefix[r] are the
// cache's own [0, prefix[r]).
template <typename Slot>
struct AmxUnit {
  int64_t R, G, D;
  const int64_t* F;
  const int64_t* prefix;
  Slot slot;
  int64_t NQ, QP, FM;  // queries, padded to whole tiles, the largest F

  AmxUnit(int64_t R_, int64_t G_, int64_t D_, const int64_t* F_, const int64_t* prefix_, Slot slot_)
      : R(R_), G(G_), D(D_), F(F_), prefix(prefix_), slot(slot_), NQ(R_ * G_), QP((R_ * G_ + 15) / 16 * 16), FM(0) {
    for (int64_t r = 0; r < R; ++r) FM = std::max(FM, F[r]);
  }

  bool readers(int64_t j0, int64_t width, int64_t& first, int64_t& last) const {
    return specdecode::block_readers(R, F, prefix, j0, width, first, last);
  }

  // Scores of every row's first F[r] slots into scores + n s_stride + j, times scale.
  void scores(const float* q, int64_t stride, const at::BFloat16* k, float scale, float* out, int64_t s_stride) {
    thread_local std::vector<uint16_t> qv_buffer, gathered_buffer;
    thread_local std::vector<float> tile_buffer;
    const int64_t chunks = D / 32;
    uint16_t* qv = scratch(qv_buffer, chunks * 16 * QP * 2);  // [chunk][16 pairs][QP][2]
    uint16_t* gathered = scratch(gathered_buffer, 16 * D);
    float* tile = scratch(tile_buffer, 256);
    std::memset(qv, 0, chunks * 16 * QP * 2 * sizeof(uint16_t));
    for (int64_t n = 0; n < NQ; ++n) {
      const float* x = q + (n / G) * D + (n % G) * stride;
      for (int64_t d = 0; d < D; ++d) qv[(((d / 32) * 16 + (d % 32) / 2) * QP + n) * 2 + d % 2] = to_bf16(x[d]);
    }
    const uint16_t* keys = reinterpret_cast<const uint16_t*>(k);
    auto run = [&](const uint16_t* block, int64_t r_lo, int64_t r_hi, int64_t j0) {
      const int64_t n_lo = r_lo * G, n_hi = (r_hi + 1) * G;
      for (int64_t qt = n_lo / 16; qt * 16 < n_hi; ++qt) {
        _tile_zero(0);
        for (int64_t c = 0; c < chunks; ++c) {
          _tile_loadd(1, block + c * 32, D * 2);
          _tile_loadd(2, qv + (c * 16 * QP + qt * 16) * 2, QP * 4);
          _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, tile, 64);  // [16 keys][16 queries]
        for (int64_t n = std::max(n_lo, qt * 16); n < std::min(n_hi, qt * 16 + 16); ++n) {
          if (F[n / G] < j0 + 16) continue;
          float* s = out + n * s_stride + j0;
          for (int i = 0; i < 16; ++i) s[i] = tile[i * 16 + (n - qt * 16)] * scale;
        }
      }
    };
    configure_attention_tiles();
    for (int64_t j0 = 0; j0 < FM; j0 += 16) {
      int64_t first, last;
      if (readers(j0, 16, first, last)) {
        run(keys + j0 * D, first, last, j0);
        continue;
      }
      for (int64_t r = first; r <= last; ++r) {  // some row gathers: each row on its own slots
        if (F[r] < j0 + 16) continue;
        for (int i = 0; i < 16; ++i) std::memcpy(gathered + i * D, keys + slot(r, j0 + i) * D, D * 2);
        run(gathered, r, r, j0);
      }
    }
    _tile_release();
  }

  // The weighted values of every row's first F[r] slots (its weights in weights + n s_stride + j, unnormalised),
  // into out + r out_row + g D, where the eight-lane path continues.
  void values(const at::BFloat16* v, const float* weights, int64_t s_stride, float* out, int64_t out_row) {
    thread_local std::vector<uint16_t> p_buffer, block_buffer, lone_buffer;
    thread_local std::vector<float> sums_buffer;
    uint16_t* p = scratch(p_buffer, QP * FM);  // [QP][FM]: A operands, zero past each row's F
    uint16_t* block = scratch(block_buffer, 16 * D * 2);  // [D / 16][16 pairs][16][2]: B operands
    uint16_t* lone = scratch(lone_buffer, 16 * 32);
    float* sums = scratch(sums_buffer, QP * D);
    for (int64_t n = 0; n < QP; ++n) {
      const int64_t f = n < NQ ? F[n / G] : 0;
      const float* w = weights + n * s_stride;
      uint16_t* row = p + n * FM;
      int64_t j = 0;
      for (; j < f; j += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(w + j)));
      for (; j < FM; ++j) row[j] = 0;
    }
    std::memset(sums, 0, QP * D * sizeof(float));
    const uint16_t* values = reinterpret_cast<const uint16_t*>(v);
    auto pack = [&](auto row_of) {
      for (int k = 0; k < 16; ++k) {
        const uint16_t* even = values + row_of(2 * k) * D;
        const uint16_t* odd = values + row_of(2 * k + 1) * D;
        for (int64_t dt = 0; dt < D / 16; ++dt)
          _mm512_storeu_si512(block + (dt * 16 + k) * 32, interleave16(even + dt * 16, odd + dt * 16));
      }
    };
    auto run = [&](int64_t r_lo, int64_t r_hi, int64_t j0, int64_t only) {  // only >= 0: that row's queries alone
      const int64_t n_lo = r_lo * G, n_hi = (r_hi + 1) * G;
      for (int64_t qt = n_lo / 16; qt * 16 < n_hi; ++qt) {
        const uint16_t* a = p + qt * 16 * FM + j0;
        int64_t a_stride = FM * 2;
        if (only >= 0) {
          for (int i = 0; i < 16; ++i) {
            const int64_t n = qt * 16 + i;
            if (n / G == only && n < NQ) std::memcpy(lone + i * 32, a + i * FM, 64);
            else std::memset(lone + i * 32, 0, 64);
          }
          a = lone;
          a_stride = 64;
        }
        for (int64_t dt = 0; dt < D / 16; ++dt) {
          float* c = sums + qt * 16 * D + dt * 16;
          _tile_loadd(0, c, D * 4);
          _tile_loadd(1, a, a_stride);
          _tile_loadd(2, block + dt * 16 * 32, 64);
          _tile_dpbf16ps(0, 1, 2);
          _tile_stored(0, c, D * 4);
        }
      }
    };
    configure_attention_tiles();
    for (int64_t j0 = 0; j0 < FM; j0 += kAmxSlots) {
      int64_t first, last;
      if (readers(j0, kAmxSlots, first, last)) {
        pack([&](int64_t j) { return j0 + j; });
        run(first, last, j0, -1);
        continue;
      }
      for (int64_t r = first; r <= last; ++r) {
        if (F[r] < j0 + kAmxSlots) continue;
        pack([&](int64_t j) { return slot(r, j0 + j); });
        run(r, r, j0, r);
      }
    }
    _tile_release();
    for (int64_t n = 0; n < NQ; ++n)
      if (F[n / G] > 0) std::memcpy(out + (n / G) * out_row + (n % G) * D, sums + n * D, D * sizeof(float));
  }
};
#endif

// Query rows [t0, t1) of the G heads that share a KV head: per row and head, softmax(q . k[s] * scale) over the
// row's slots, then the weighted sum of v[s], all in float32. Slot j of row t is j for j < spans[t], extras[t][j -
// spans[t]] after.
// The loops walk the keys and values once for all the rows and heads (a block of keys or a tile of values is read
// from memory once and used by every row and head from L1: a verify forward over long contexts used to read the
// cache once per row) and keep several independent chains in flight, without changing any value's order of
// operations: each score is its own chain over d, each output lane one chain over the row's slots in order, the
// softmax denominator eight lane chains over the slots then the fixed lane sum. So a row's result depends only on
// its own slots, never on the other rows or heads of the call.
// Row t, head g: q at q + (t - t0) * D + g * stride, out at out + (t - t0) * out_row + g * D (rows of all heads:
// the o projection's input as it is); its scores at scores + ((t - t0) * G + g) * s_stride,
// s_stride >= its slots + 8; inv_total: (t1 - t0) * G floats of room; pairs: (t1 - t0) * (G + 1) * D floats.
constexpr int64_t kUnitRows = 8;  // the most rows one call of attend_rows takes (kRows below)

template <typename T>
void attend_rows(const float* q, float* out, int64_t stride, int64_t out_row, int64_t G, const T* k, const T* v,
                 const std::vector<int64_t>& spans, const std::vector<std::vector<int64_t>>& extras, int64_t t0,
                 int64_t t1, int64_t D, float scale, float* scores, int64_t s_stride, float* inv_total,
                 float* pairs) {
  static const std::vector<int64_t> none;
  const int64_t R = t1 - t0;
  auto extra = [&](int64_t r) -> const std::vector<int64_t>& { return extras.empty() ? none : extras[t0 + r]; };
  auto count = [&](int64_t r) { return spans[t0 + r] + static_cast<int64_t>(extra(r).size()); };
  auto slot = [&](int64_t r, int64_t j) { return j < spans[t0 + r] ? j : extra(r)[j - spans[t0 + r]]; };
  int64_t shared = spans[t0], longest = 0;  // slots [0, shared) are every row's first ones
  for (int64_t r = 0; r < R; ++r) shared = std::min(shared, spans[t0 + r]), longest = std::max(longest, count(r));
  // each row's first F[r] slots in bfloat16 products (a bfloat16 cache: AMX tiles or BF16 dots, where the CPU has
  // them), the rest below
  int64_t F[kUnitRows] = {}, prefix[kUnitRows] = {}, least_F = 0, most_F = 0;
  [[maybe_unused]] bool tiles = false;  // the bfloat16 part on AMX tiles, else (where F > 0) in BF16 dot products
#if defined(SPECDECODE_AMX_ATTENTION) || defined(SPECDECODE_BF16_DOTS)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
#if defined(SPECDECODE_AMX_ATTENTION)
    tiles = amx_on();
#endif
    bool dots = false;
#if defined(SPECDECODE_BF16_DOTS)
    dots = !tiles && specdecode::bf16_dots_on();
#endif
    if (D % 64 == 0 && (tiles || dots)) {
      least_F = INT64_MAX;
      for (int64_t r = 0; r < R; ++r)
        F[r] = amx_slots(count(r)), prefix[r] = spans[t0 + r], least_F = std::min(least_F, F[r]);
#if defined(SPECDECODE_AMX_ATTENTION)
      if (tiles) {
        AmxUnit unit(R, G, D, F, prefix, slot);
        most_F = unit.FM;
        if (most_F > 0) unit.scores(q, stride, k, scale, scores, s_stride);
      }
#endif
#if defined(SPECDECODE_BF16_DOTS)
      if (dots) {
        specdecode::DotsUnit unit(R, G, D, F, prefix, slot);
        most_F = unit.FM;
        if (most_F > 0) unit.scores(q, stride, k, scale, scores, s_stride);
      }
#endif
    }
  }
#endif
  // scores, eight keys at a time (eight independent chains, then one transposed sum that adds each key's lanes
  // in lane_sum's order: the same bits as dot()): the shared slots once for every row, then each row's own
#if defined(__AVX512F__)
  // each row's queries in head pairs interleaved by eight lanes, for score_pairs (an odd last head pairs with itself)
  const int64_t pair_count = (G + 1) / 2;
  for (int64_t r = 0; r < R; ++r)
      for (int64_t h = 0; h < 2 * pair_count; ++h) {
        const float* from = q + r * D + std::min(h, G - 1) * stride;
        float* to = pairs + (r * pair_count + h / 2) * 2 * D + 8 * (h % 2);
        for (int64_t d = 0; d < D; d += 8) _mm256_storeu_ps(to + 2 * d, _mm256_loadu_ps(from + d));
      }
#endif
  auto eight = [&](int64_t r, int64_t j, const T* const* keys) {
    int64_t g = 0;
#if defined(__AVX512F__)
    {
      // two heads a vector (score_pairs), in groups of at most three pairs (24 sums in registers) as even as the
      // pairs allow: at six heads half the eight-lane path's multiply-adds and a fifth of its loads, the same bits
      const int64_t groups = (pair_count + 2) / 3;
      for (int64_t group = 0; group < groups; ++group) {
        const int64_t p = pair_count / groups + (group < pair_count % groups);
        const bool odd = 2 * p > G - g;
        const float* qp = pairs + (r * pair_count + g / 2) * 2 * D;
        float* sg = scores + (r * G + g) * s_stride + j;
        if (p == 3) odd ? score_pairs<3, true, T>(qp, keys, D, scale, sg, s_stride)
                        : score_pairs<3, false, T>(qp, keys, D, scale, sg, s_stride);
        else if (p == 2) odd ? score_pairs<2, true, T>(qp, keys, D, scale, sg, s_stride)
                             : score_pairs<2, false, T>(qp, keys, D, scale, sg, s_stride);
        else odd ? score_pairs<1, true, T>(qp, keys, D, scale, sg, s_stride)
                 : score_pairs<1, false, T>(qp, keys, D, scale, sg, s_stride);
        g = std::min(G, g + 2 * p);
      }
    }
#endif
    // the eight-lane path (on the AVX-512 path, its leftover heads: none there); more keys a pass for fewer heads
    six_head_groups(G - g, [&](int64_t first, auto heads) {
      constexpr int NH = decltype(heads)::value;
      score_heads<NH, NH == 1 ? 8 : NH <= 3 ? 4 : 2>(q + r * D + (g + first) * stride, stride, keys, D, scale,
                                                      scores + (r * G + g + first) * s_stride + j, s_stride);
    });
  };
  auto slots8 = [&](int64_t r, int64_t j, const T** keys) {  // in sum8's order: lane i of its result is key j + i
    for (int i = 0; i < 4; ++i) keys[2 * i] = k + slot(r, j + i) * D, keys[2 * i + 1] = k + slot(r, j + 4 + i) * D;
  };
  const T* keys[8];
  int64_t j = least_F;  // a multiple of 32: slots before it are every row's in bfloat16 products
  for (; j + 8 <= shared; j += 8) {
    slots8(0, j, keys);  // shared slots: the same for every row
    if (j + kKeysAhead + 8 <= shared) prefetch_rows(k + (j + kKeysAhead) * D, 8, D);
    for (int64_t r = 0; r < R; ++r)
      if (j >= F[r]) eight(r, j, keys);
  }
  const int64_t own = j;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t n = count(r);
    for (j = std::max(own, F[r]); j + 8 <= n; j += 8) {
      slots8(r, j, keys);
      eight(r, j, keys);
    }
    for (; j < n; ++j)
      for (int64_t g = 0; g < G; ++g)
        scores[(r * G + g) * s_stride + j] = dot(q + r * D + g * stride, k + slot(r, j) * D, D) * scale;
  }
  // per row and head: weights exp(s - top), eight at a time; the last vector's lanes past its slots are computed,
  // then dropped
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t n = count(r);
      float* s = scores + (r * G + g) * s_stride;
      float top = -INFINITY;
      j = 0;
      // the maximum is the same number in any order; s[j] first, as std::max keeps `top` over a NaN score
#if defined(__AVX512F__)
      __m512 most = _mm512_set1_ps(-INFINITY);
      for (; j + 16 <= n; j += 16) most = _mm512_max_ps(_mm512_loadu_ps(s + j), most);
      top = _mm512_reduce_max_ps(most);
#else
      __m256 most = _mm256_set1_ps(-INFINITY);
      for (; j + 8 <= n; j += 8) most = _mm256_max_ps(_mm256_loadu_ps(s + j), most);
      __m128 half = _mm_max_ps(_mm256_castps256_ps128(most), _mm256_extractf128_ps(most, 1));
      half = _mm_max_ps(half, _mm_movehl_ps(half, half));
      top = _mm_cvtss_f32(_mm_max_ss(half, _mm_movehdup_ps(half)));
#endif
      for (; j < n; ++j) top = std::max(top, s[j]);
      const __m256 shift = _mm256_set1_ps(top);
      __m256 lanes = _mm256_setzero_ps();
      j = 0;
      for (; j + 16 <= n; j += 16) {  // whole vectors, two at a time; the sum adds eight lanes at a time in order
        const __m256 w0 = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift));
        const __m256 w1 = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j + 8), shift));
        _mm256_storeu_ps(s + j, w0);
        _mm256_storeu_ps(s + j + 8, w1);
        lanes = _mm256_add_ps(_mm256_add_ps(lanes, w0), w1);
      }
      for (; j < n; j += 8) {
        const int64_t live = std::min<int64_t>(8, n - j);
        for (int64_t i = live; i < 8; ++i) s[j + i] = top;
        const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(live)),
                                                                   _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
        const __m256 w = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift)), keep);
        _mm256_storeu_ps(s + j, w);
        lanes = _mm256_add_ps(lanes, w);
      }
      inv_total[r * G + g] = 1.f / lane_sum(lanes);
    }
#if defined(SPECDECODE_AMX_ATTENTION) || defined(SPECDECODE_BF16_DOTS)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
#if defined(SPECDECODE_AMX_ATTENTION)
    if (most_F > 0 && tiles) AmxUnit(R, G, D, F, prefix, slot).values(v, scores, s_stride, out, out_row);
#endif
#if defined(SPECDECODE_BF16_DOTS)
    if (most_F > 0 && !tiles) specdecode::DotsUnit(R, G, D, F, prefix, slot).values(v, scores, s_stride, out, out_row);
#endif
  }
#endif
  // weighted sums of v, unnormalised, into `out`: 64 output lanes a pass (AVX-512; 16 on AVX2), tiles of kSlots
  // slots read once for all rows and heads (a row's first F[r] slots were summed in bfloat16 products: it goes on
  // from those sums); the partial sums wait in `out` between tiles (a store and a load change no bit)
  constexpr int64_t kSlots = 32;
  static_assert(kSlots == 32, "a row's AMX part ends on a tile of kSlots");
  int64_t d0 = 0;
#if defined(__AVX512F__)
  // NH heads of a row at once: each value row's 64 lanes are loaded once for all of them, 4 NH independent chains
  // (one head's four were bound by the multiply-add's latency). Each lane's multiply-adds are the eight-lane
  // path's, in the same order.
  auto weigh = [&](auto heads, int64_t r, int64_t g0, int64_t j0, int64_t end) {
    constexpr int NH = decltype(heads)::value;
    __m512 acc[NH][4];
    for (int h = 0; h < NH; ++h) {
      const float* o = out + r * out_row + (g0 + h) * D + d0;
      for (int c = 0; c < 4; ++c) acc[h][c] = j0 == 0 ? _mm512_setzero_ps() : _mm512_loadu_ps(o + 16 * c);
    }
    const float* s = scores + (r * G + g0) * s_stride;
    for (int64_t jj = j0; jj < end; ++jj) {
      const T* row = v + slot(r, jj) * D + d0;
      if (g0 == 0 && r == 0 && jj + kValuesAhead < shared) prefetch_rows(v + (jj + kValuesAhead) * D + d0, 1, 64);
      __m512 value[4];
      for (int c = 0; c < 4; ++c) value[c] = load16(row + 16 * c);
      for (int h = 0; h < NH; ++h) {
        const __m512 w = _mm512_set1_ps(s[h * s_stride + jj]);
        for (int c = 0; c < 4; ++c) acc[h][c] = _mm512_fmadd_ps(w, value[c], acc[h][c]);
      }
    }
    for (int h = 0; h < NH; ++h) {
      float* o = out + r * out_row + (g0 + h) * D + d0;
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o + 16 * c, acc[h][c]);
    }
  };
  // at most six heads a group: 24 sums, their value row and a weight in registers
  for (; d0 + 64 <= D; d0 += 64)
    for (int64_t j0 = 0; j0 < longest; j0 += kSlots)
      for (int64_t r = 0; r < R; ++r) {
        const int64_t end = std::min(count(r), j0 + kSlots);
        if (j0 >= end || j0 < F[r]) continue;
        six_head_groups(G, [&](int64_t g0, auto heads) { weigh(heads, r, g0, j0, end); });
      }
#else
  // NH heads of a row at once over 16 lanes: each value row's 16 lanes are loaded (a bfloat16 one split into its
  // even and odd lanes by shifts, no widening shuffle) once for all NH heads, 2 NH independent chains (one
  // head at a time widened every value for each of its multiply-adds). Each lane's multiply-adds are the one-head
  // path's, in the same order; a tile's 16-lane passes run while its values are in L1. A bfloat16 cache's sums wait
  // in `out` as even lanes then odd ones, put back in order below.
  constexpr bool split = std::is_same_v<T, at::BFloat16>;
  const T* tile_rows[kSlots];  // the tile's value rows of the row at hand, looked up once for all its passes
  auto weigh = [&](auto heads, int64_t r, int64_t g0, int64_t d, int64_t j0, int64_t end) {
    constexpr int NH = decltype(heads)::value;
    __m256 acc[NH][2];
    for (int h = 0; h < NH; ++h) {
      const float* o = out + r * out_row + (g0 + h) * D + d;
      for (int c = 0; c < 2; ++c) acc[h][c] = j0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(o + 8 * c);
    }
    const float* s = scores + (r * G + g0) * s_stride;
    for (int64_t jj = j0; jj < end; ++jj) {
      const T* row = tile_rows[jj - j0] + d;
      __m256 value[2];
      if constexpr (split) {
        const __m256i both = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
        value[0] = _mm256_castsi256_ps(_mm256_slli_epi32(both, 16));
        value[1] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_srli_epi32(both, 16), 16));  // no mask register
      } else {
        value[0] = _mm256_loadu_ps(reinterpret_cast<const float*>(row));
        value[1] = _mm256_loadu_ps(reinterpret_cast<const float*>(row) + 8);
      }
      for (int h = 0; h < NH; ++h) {
        const __m256 w = _mm256_broadcast_ss(s + h * s_stride + jj);
        for (int c = 0; c < 2; ++c) acc[h][c] = _mm256_fmadd_ps(w, value[c], acc[h][c]);
      }
    }
    for (int h = 0; h < NH; ++h) {
      float* o = out + r * out_row + (g0 + h) * D + d;
      for (int c = 0; c < 2; ++c) _mm256_storeu_ps(o + 8 * c, acc[h][c]);
    }
  };
  // at most six heads a group: 12 sums, a value's two vectors and a weight in registers (12 chains hide the
  // multiply-add's latency; 6 of them, three heads, could not)
  const int64_t paired = D / 16 * 16;  // lanes summed 16 at a time
  for (int64_t j0 = 0; j0 < longest; j0 += kSlots)
    for (int64_t r = 0; r < R; ++r) {
      const int64_t end = std::min(count(r), j0 + kSlots);
      if (j0 >= end) continue;
      for (int64_t jj = j0; jj < end; ++jj) tile_rows[jj - j0] = v + slot(r, jj) * D;
      for (int64_t d = 0; d < paired; d += 16)
        six_head_groups(G, [&](int64_t g0, auto heads) { weigh(heads, r, g0, d, j0, end); });
    }
  if constexpr (split)  // even lanes, odd lanes -> lane order (moves only: the same bits)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < paired; d += 16) {
          float* o = out + r * out_row + g * D + d;
          const __m256 even = _mm256_loadu_ps(o), odd = _mm256_loadu_ps(o + 8);
          const __m256 lo = _mm256_unpacklo_ps(even, odd), hi = _mm256_unpackhi_ps(even, odd);
          _mm256_storeu_ps(o, _mm256_permute2f128_ps(lo, hi, 0x20));
          _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
        }
  d0 = paired;
#endif
  for (; d0 < D; d0 += 8)
    for (int64_t r = 0; r < R; ++r)
      for (int64_t g = 0; g < G; ++g) {
        const float* s = scores + (r * G + g) * s_stride;
        __m256 acc = _mm256_setzero_ps();
        for (j = 0; j < count(r); ++j) acc = _mm256_fmadd_ps(_mm256_set1_ps(s[j]), load8(v + slot(r, j) * D + d0), acc);
        _mm256_storeu_ps(out + r * out_row + g * D + d0, acc);
      }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; d += 8) {
        float* o = out + r * out_row + g * D + d;
        _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_loadu_ps(o), _mm256_set1_ps(inv_total[r * G + g])));
      }
}

// Rows of one call attended together against one KV head: enough to read the cache once for a verify forward's
// rows, few enough that a prompt fed as decode rows still splits across the threads. (32 rows a unit for a prompt's
// chunks, so that AMX lays out each values block for more rows at once, left a 4,000-token prompt's prefill level:
// 31.1 s against 30.4.)
constexpr int64_t kRows = kUnitRows;

// One unit of work: up to kRows rows of a batch entry against one KV head, for all the query heads that read it.
// Scratch per thread, kept between calls (a step calls this once per layer and unit).
template <typename T>
LinearWork attend_work(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const std::vector<int64_t>& spans, const std::vector<std::vector<int64_t>>& extras,
                       at::Tensor out) {
  const int64_t H = q.size(1), T_ = q.size(2), D = q.size(3);
  const int64_t Hkv = k_cache.size(1), S_max = k_cache.size(2), group = H / Hkv;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const float* qp = q.data_ptr<float>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  float* op = out.data_ptr<float>();
  const int64_t chunks = (T_ + kRows - 1) / kRows;
  int64_t longest = 0;
  for (size_t t = 0; t < spans.size(); ++t)
    longest = std::max<int64_t>(longest, spans[t] + (extras.empty() ? 0 : extras[t].size()));
  LinearWork work;
  work.units = q.size(0) * decode_attention_units(T_, Hkv);
  work.run = [=, &spans, &extras](int64_t first, int64_t last) {
    thread_local std::vector<float> scores, inv_total, pairs;
    scores.resize(std::max<size_t>(scores.size(), kRows * group * (longest + 8)));
    inv_total.resize(std::max<size_t>(inv_total.size(), kRows * group));
    pairs.resize(std::max<size_t>(pairs.size(), kRows * (group + 1) * D));
    for (int64_t i = first; i < last; ++i) {
      const int64_t b = i / (Hkv * chunks), kvh = (i / chunks) % Hkv, t0 = (i % chunks) * kRows;
      const int64_t t1 = std::min(T_, t0 + kRows);
      const int64_t kv = (b * Hkv + kvh) * S_max * D;
      const float* q_rows = qp + ((b * H + kvh * group) * T_ + t0) * D;  // q is [B, H, T, D]
      float* out_rows = op + ((b * T_ + t0) * H + kvh * group) * D;       // out is [B, T, H, D]
      attend_rows(q_rows, out_rows, T_ * D, H * D, group, kp + kv, vp + kv, spans, extras, t0, t1, D, scale,
                  scores.data(), longest + 8, inv_total.data(), pairs.data());
    }
  };
  work.done = [out] { return out.permute({0, 2, 1, 3}); };  // [B, H, T, D], rows of all heads in memory
  return work;
}

}  // namespace

namespace {
std::atomic<bool> bf16_dots_wanted{true};
}

#if defined(SPECDECODE_BF16_DOTS)
bool specdecode::bf16_dots_on() { return bf16_dots_wanted.load(); }
#endif

void set_bf16_dots(bool on) { bf16_dots_wanted.store(on); }

int64_t decode_attention_units(int64_t rows, int64_t kv_heads) { return kv_heads * ((rows + kRows - 1) / kRows); }

LinearWork decode_attention_work(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const std::vector<int64_t>& spans, const std::vector<std::vector<int64_t>>& extras) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == at::kFloat && q.is_contiguous(), "q: float32 [B, H, T, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.is_contiguous(), "caches: [B, Hkv, S, D]");
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type(), "k and v caches must share a dtype");
  TORCH_CHECK(q.size(3) % 8 == 0 && q.size(3) == k_cache.size(3) && q.size(1) % k_cache.size(1) == 0,
              "head dim must be a multiple of 8 and match; heads a multiple of KV heads");
  TORCH_CHECK(static_cast<int64_t>(spans.size()) == q.size(2), "one span per query row");
  for (int64_t span : spans) TORCH_CHECK(span > 0 && span <= k_cache.size(2), "span out of the cache");
  TORCH_CHECK(extras.empty() || extras.size() == spans.size(), "extra slots: none, or one list per query row");
  for (size_t t = 0; t < extras.size(); ++t)
    for (int64_t s : extras[t])
      TORCH_CHECK(s >= spans[t] && s < k_cache.size(2) && spans[t] + extras[t].size() <= size_t(k_cache.size(2)),
                  "extra slot out of the cache");
  auto out = at::empty({q.size(0), q.size(2), q.size(1), q.size(3)}, q.options());  // [B, T, H, D]
  if (k_cache.scalar_type() == at::kFloat) return attend_work<float>(q, k_cache, v_cache, spans, extras, out);
  TORCH_CHECK(k_cache.scalar_type() == at::kBFloat16, "caches must be float32 or bfloat16");
  return attend_work<at::BFloat16>(q, k_cache, v_cache, spans, extras, out);
}

at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            std::vector<int64_t> spans, std::vector<std::vector<int64_t>> extras) {
  return run_alone(decode_attention_work(q, k_cache, v_cache, spans, extras));
}

// The glue of one attention layer in one call (a one-token step is mostly small framework operations):
// q [B, T, H, D], k and v [B, T, Hkv, D] float32 (the projections' outputs, viewed), cos and sin [B, T, D].
// Rotates q and k by x * cos + rotate_half(x) * sin, rounded as that eager formula rounds (two products, one sum,
// no fused multiply-add), writes k and v into cache slots [start, start + T) of k_cache, v_cache [B, Hkv, S, D]
// (float32, or bfloat16 rounded to nearest even as torch rounds) with start = slots[0] (rope_store_at: given), and returns q rotated as [B, H, T, D], the layout decode_attention reads.
at::Tensor rope_store(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                      at::Tensor& v_cache, const at::Tensor& slots) {
  return rope_store_at(q, k, v, cos, sin, k_cache, v_cache, slots.data_ptr<int64_t>()[0]);
}

namespace {

// One cache row of D values from float32: copied, or rounded to bfloat16 (a bfloat16 cache halves what attention
// reads over a long context).
inline void store_row(const float* from, int64_t D, void* cache, int64_t at, bool bf16) {
  if (!bf16) {
    std::copy(from, from + D, static_cast<float*>(cache) + at);
    return;
  }
  uint16_t* to = static_cast<uint16_t*>(cache) + at;
  for (int64_t i = 0; i < D; ++i) to[i] = to_bf16(from[i]);
}

}  // namespace

at::Tensor rope_store_at(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                         at::Tensor& v_cache, int64_t start) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&q, &k, &v, &cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous(), "rope_store takes contiguous float32");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.scalar_type() == v_cache.scalar_type() &&
                  (k_cache.scalar_type() == at::kFloat || k_cache.scalar_type() == at::kBFloat16),
              "rope_store: contiguous float32 or bfloat16 caches of one dtype");
  const bool bf16 = k_cache.scalar_type() == at::kBFloat16;
  const int64_t B = q.size(0), T_ = q.size(1), H = q.size(2), D = q.size(3), Hkv = k.size(2), S = k_cache.size(2);
  const int64_t half = D / 2;
  TORCH_CHECK(start >= 0 && start + T_ <= S, "cache slots out of range");
  auto out = at::empty({B, H, T_, D}, q.options());
  const float* c = cos.data_ptr<float>();
  const float* s = sin.data_ptr<float>();
  auto rotate = [&](const float* x, const float* cb, const float* sb, float* y) {
    for (int64_t i = 0; i < half; ++i) {
      const float a = x[i] * cb[i], b = -x[i + half] * sb[i];
      y[i] = a + b;
    }
    for (int64_t i = half; i < D; ++i) {
      const float a = x[i] * cb[i], b = x[i - half] * sb[i];
      y[i] = a + b;
    }
  };
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  void* kc = k_cache.data_ptr();
  void* vc = v_cache.data_ptr();
  std::vector<float> key(D);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T_; ++t) {
      const float* cb = c + (b * T_ + t) * D;
      const float* sb = s + (b * T_ + t) * D;
      for (int64_t h = 0; h < H; ++h) rotate(qp + ((b * T_ + t) * H + h) * D, cb, sb, op + ((b * H + h) * T_ + t) * D);
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t src = ((b * T_ + t) * Hkv + h) * D, dst = ((b * Hkv + h) * S + start + t) * D;
        rotate(kp + src, cb, sb, key.data());
        store_row(key.data(), D, kc, dst, bf16);
        store_row(vp + src, D, vc, dst, bf16);
      }
    }
  return out;
}
