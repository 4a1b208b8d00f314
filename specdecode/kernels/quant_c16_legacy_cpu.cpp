// The 32-weight block types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) with 16 output channels per vector (AVX-512 VNNI,
// or two AVX2 halves): the counterpart of quant_c16_cpu.cpp's k-quants (read its header first). These are the draft
// model's blocks, run mostly one token at a time, where quant_cpu.cpp's row kernel spends more instructions on
// unpacking and scaling each 64-weight step than on its dot products.
//
// Repacked layout, per group of 16 channels (cg) and block of 32 weights (b), arrays [N / 16, K / 32, ...]:
//   codes, 4 and 5 bits: lo, 4 vectors of 64 bytes: vector p, byte 4 c + i = code[c][8 p + i] & 15 |
//     (code[c][8 p + 4 + i] & 15) << 4; 5 bits also hi, 1 vector: byte 4 c + i, bit j = bit 4 of code[c][4 j + i]
//   codes, 8 bits: 8 vectors of 64 bytes, byte 4 c + i = code[c][4 j + i] + 128 (unsigned)
//   d: [16] float16; Q4_1, Q5_1 also m: [16] float16 (w = d * code + m)
// Q4_0, Q5_0, Q8_0 are w = d * (code - OFF) with OFF = 8, 16, 128: the offset is taken off the integer sum
// (sum of code * x minus OFF * sum of x), exactly, before the one float multiply-add per block and row.
// MXFP4 (4 bits, OFF = 16) stores Q4_0's nibbles, each an index into twice the e2m1 values: one byte shuffle turns
// a vector of them into the unsigned codes 16 + 2v (4..28), and from there it is Q5_0's sum (blocks.py).
// Activations: int8 per block of 32 (the row kernel's rounding), their scale, and the sum of their codes.
#include "aten_lite.h"
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "amx_tiles.h"
#include "huge_pages.h"
#include "kernels.h"
#include "simd.h"

// Row layout (blocks.py: 32-code nibble runs, bit planes; Q8_0 signed bytes) -> the channel layout above. Four codes
// of a channel move as one word, as quant_c16_cpu.cpp's repack does.
std::vector<at::Tensor> repack_c16_legacy(const at::Tensor& qs, const at::Tensor& qh, const at::Tensor& d,
                                          const at::Tensor& dmin, int64_t bits, bool with_m) {
  using specdecode::load_word;
  using specdecode::store_word;
  const int64_t N = d.size(0), nb = d.size(1), K = nb * 32, ng = N / 16;
  TORCH_CHECK(N % 16 == 0, "repack_c16_legacy: N must be a multiple of 16");
  auto u8 = at::TensorOptions().dtype(at::kByte);
  auto codes = empty_in_huge_pages({ng, nb, bits == 8 ? 8 : 4, 64}, u8);
  auto hi = empty_in_huge_pages({ng, nb, bits == 5 ? 1 : 0, 64}, u8);
  auto dd = empty_in_huge_pages({ng, nb, 16}, u8.dtype(at::kHalf));
  auto mm = empty_in_huge_pages({ng, nb, with_m ? 16 : 0}, u8.dtype(at::kHalf));
  const uint8_t* q = qs.data_ptr<uint8_t>();
  const uint8_t* h = bits == 5 ? qh.data_ptr<uint8_t>() : nullptr;
  const at::Half* d16 = d.data_ptr<at::Half>();
  const at::Half* m16 = with_m ? dmin.data_ptr<at::Half>() : nullptr;
  uint8_t* codes_all = codes.data_ptr<uint8_t>();
  uint8_t* hi_all = bits == 5 ? hi.data_ptr<uint8_t>() : nullptr;
  at::Half* dd_all = dd.data_ptr<at::Half>();
  at::Half* mm_all = with_m ? mm.data_ptr<at::Half>() : nullptr;
  at::parallel_for(0, ng, 1, [&](int64_t first, int64_t last) {
    for (int64_t cg = first; cg < last; ++cg)
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t at = cg * nb + b;
        uint8_t* cp = codes_all + at * (bits == 8 ? 8 : 4) * 64;
        uint8_t* hp = bits == 5 ? hi_all + at * 64 : nullptr;
        for (int c = 0; c < 16; ++c) {
          const int64_t n = cg * 16 + c;
          if (bits == 8) {  // code 4 j + i, plus 128 (its top bit flipped), at byte 4 c + i of vector j
            for (int j = 0; j < 8; ++j) store_word(cp + j * 64 + 4 * c, load_word(q + n * K + b * 32 + 4 * j) ^ 0x80808080u);
          } else {
            // codes k < 16 are the low nibbles of the block's 16 bytes, codes 16 + k the high ones
            const uint8_t* run = q + n * (K / 2) + b * 16;
            alignas(8) uint8_t row[32];
            for (int k = 0; k < 16; ++k) row[k] = run[k] & 15, row[16 + k] = run[k] >> 4;
            for (int p = 0; p < 4; ++p)  // codes 8 p + i and 8 p + 4 + i: the low and high nibble of byte i
              store_word(cp + p * 64 + 4 * c, load_word(row + 8 * p) | load_word(row + 8 * p + 4) << 4);
            if (hp != nullptr) {  // bit 4 of code 4 j + i (bit k % 8 of the plane's byte k / 8) in bit j of byte i
              alignas(8) uint8_t high[32];
              for (int w = 0; w < 4; ++w) {
                const uint64_t eight = specdecode::spread_bits(h[n * (K / 8) + b * 4 + w]);
                std::memcpy(high + 8 * w, &eight, 8);
              }
              uint32_t word = 0;
              for (int j = 0; j < 8; ++j) word |= load_word(high + 4 * j) << j;
              store_word(hp + 4 * c, word);
            }
          }
          dd_all[at * 16 + c] = d16[n * nb + b];
          if (with_m) mm_all[at * 16 + c] = m16[n * nb + b];  // dmin = -m
        }
      }
  });
  return {codes, hi, dd, mm};
}

namespace {

struct Weight {
  const uint8_t* codes;
  const uint8_t* hi;
  const uint16_t* d;
  const uint16_t* dmin;  // Q4_1, Q5_1: w = d * code - dmin
  int64_t nb;
};

struct Acts {
  const int8_t* q;     // [M, K]
  const float* xd;     // [M, K / 32]
  const int32_t* sum;  // [M, K / 32]
  int64_t K;
};

// MXFP4: nibble -> 16 + twice its e2m1 value (0, 0.5, 1, 1.5, 2, 3, 4, 6, then the same negated), for a byte
// shuffle of 16-byte lanes.
inline __m128i mxfp4_codes() { return _mm_setr_epi8(16, 17, 18, 19, 20, 22, 24, 28, 16, 15, 14, 13, 12, 10, 8, 4); }

// Block `at`'s bytes, asked for kAhead blocks (5-8 KB) before use, with the build's hint: as quant_c16_cpu.cpp
// does and for the same reasons; one line two blocks ahead left the draft model's one-token forward ~35% slower.
constexpr int kAhead = 16;
using specdecode::prefetch_weights;

template <int BITS, int OFF>
SPECDECODE_PREFETCHES void prefetch_block(const Weight& w, int64_t at) {
  constexpr int lines = BITS == 8 ? 8 : 4;
  for (int line = 0; line < lines; ++line) prefetch_weights(w.codes + (at * lines + line) * 64);
  if constexpr (BITS == 5) prefetch_weights(w.hi + at * 64);
  prefetch_weights(w.d + at * 16);
  if constexpr (OFF == 0) prefetch_weights(w.dmin + at * 16);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
constexpr int kTile = 8;  // activation rows per pass, as in quant_c16_cpu.cpp

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

template <int BITS, int OFF = 0>
inline __m512i chunk_codes(const Weight& w, int64_t at, int j) {
  if constexpr (BITS == 8) return _mm512_loadu_si512(w.codes + (at * 8 + j) * 64);
  const __m512i packed = _mm512_loadu_si512(w.codes + (at * 4 + j / 2) * 64);
  __m512i codes = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(packed, 4) : packed, _mm512_set1_epi8(0x0F));
  if constexpr (BITS == 4 && OFF == 16) return _mm512_shuffle_epi8(_mm512_broadcast_i32x4(mxfp4_codes()), codes);
  if constexpr (BITS == 5) {  // bit j of each byte -> bit 4
    const __m512i high = _mm512_loadu_si512(w.hi + at * 64);
    const __m512i moved = j <= 4 ? _mm512_slli_epi16(high, 4 - j) : _mm512_srli_epi16(high, j - 4);
    codes = _mm512_or_si512(codes, _mm512_and_si512(moved, _mm512_set1_epi8(0x10)));
  }
  return codes;
}

// OFF > 0: w = d * (code - OFF); OFF == 0: w = d * code - dmin
template <int BITS, int OFF, int TILE>
void tile(const Acts& a, const Weight& w, int64_t cg, int64_t m0, float* y, int64_t N) {
  constexpr int kSplit = TILE <= 4 ? 2 : 1;  // few rows: two accumulator chains, so vpdpbusd's latency overlaps
  __m512 acc[TILE];
  for (int t = 0; t < TILE; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < w.nb; ++b) {
    const int64_t at = cg * w.nb + b;
    if (m0 == 0) prefetch_block<BITS, OFF>(w, at + kAhead);
    __m512i part[kSplit][TILE];
    for (int s = 0; s < kSplit; ++s)
      for (int t = 0; t < TILE; ++t) part[s][t] = _mm512_setzero_si512();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      const __m512i codes = chunk_codes<BITS, OFF>(w, at, j);
      for (int t = 0; t < TILE; ++t)
        part[j % kSplit][t] = _mm512_dpbusd_epi32(part[j % kSplit][t], codes, bcast4(a.q + (m0 + t) * a.K + b * 32 + 4 * j));
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.d + at * 16)));
    __m512 dmin;
    if constexpr (OFF == 0) dmin = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.dmin + at * 16)));
    for (int t = 0; t < TILE; ++t) {
      __m512i isum = kSplit == 2 ? _mm512_add_epi32(part[0][t], part[kSplit - 1][t]) : part[0][t];
      const int64_t blk = (m0 + t) * (a.K / 32) + b;
      if constexpr (OFF > 0) isum = _mm512_sub_epi32(isum, _mm512_set1_epi32(OFF * a.sum[blk]));
      const __m512 xd = _mm512_set1_ps(a.xd[blk]);
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(d, xd), acc[t]);
      if constexpr (OFF == 0) acc[t] = _mm512_fnmadd_ps(dmin, _mm512_set1_ps(a.xd[blk] * static_cast<float>(a.sum[blk])), acc[t]);
    }
  }
  for (int t = 0; t < TILE; ++t) _mm512_storeu_ps(y + (m0 + t) * N + cg * 16, acc[t]);
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
// Q4_0 forwards of many rows (a prompt: the draft model reads its window of the prompt in one forward) on AMX.
// A block's 32 weights of 16 channels, unpacked as chunk_codes gives them (8 vectors, byte 4 c + i of vector j =
// code[c][4 j + i]) less the offset 8, are a signed tile product's B operand as they are; 16 rows' activation codes
// of the block are its A operand. Each product is one block's exact integer sums, the offset already off, and the
// float steps after it are the VNNI tile's, in its order: every row is bit for bit what that tile (and a one-row
// forward) gives.
// Fewer rows: the VNNI tile alone (verify and draft forwards stay there; BENCHMARKS.md, "The draft's prompt on AMX").
constexpr int64_t kAmxMinRows = 32;

// Two sets of tiles, so that one block's product runs while the float steps of the block before it do:
// activations [16 rows, 32 bytes] in 0 and 2, weights [8 rows of 4 codes x 16 channels, 64 bytes] in 1 and 3, sums
// [16 rows, 16 channels] in 4 and 5.
void configure_q4_0_tiles() {
  TileConfig config;
  for (int t : {0, 2}) config.rows[t] = 16, config.colsb[t] = 32;
  for (int t : {1, 3}) config.rows[t] = 8, config.colsb[t] = 64;
  for (int t : {4, 5}) config.rows[t] = 16, config.colsb[t] = 64;
  _tile_loadconfig(&config);
}

// One block's product into sums tile C (a macro: the tile intrinsics take their tile numbers as literal tokens).
#define SPECDECODE_Q4_0_PRODUCT(A, B, C, blk)                   \
  do {                                                          \
    _tile_zero(C);                                              \
    _tile_loadd(A, a.q + m0 * a.K + (blk) * 32, a.K);           \
    _tile_loadd(B, b + (blk) * 512, 64);                        \
    _tile_dpbssd(C, A, B);                                      \
  } while (0)

// Rows [m0, m0 + 16) of channel group cg, from its blocks' codes unpacked into `b` (512 bytes a block).
void amx_q4_0_rows(const Acts& a, const Weight& w, const uint8_t* b, int64_t cg, int64_t m0, float* y, int64_t N) {
  alignas(64) int32_t sums[16][16];
  __m512 acc[16];
  for (int t = 0; t < 16; ++t) acc[t] = _mm512_setzero_ps();
  auto float_steps = [&](int64_t blk) {
    const auto* d16 = reinterpret_cast<const __m256i*>(w.d + (cg * w.nb + blk) * 16);
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(d16));
    for (int t = 0; t < 16; ++t) {
      const float xd = a.xd[(m0 + t) * (a.K / 32) + blk];
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums[t])), _mm512_mul_ps(d, _mm512_set1_ps(xd)),
                               acc[t]);
    }
  };
  SPECDECODE_Q4_0_PRODUCT(0, 1, 4, 0);
  for (int64_t blk = 0; blk < w.nb; blk += 2) {
    const bool pair = blk + 1 < w.nb;
    if (pair) SPECDECODE_Q4_0_PRODUCT(2, 3, 5, blk + 1);
    _tile_stored(4, sums, 64);
    float_steps(blk);
    if (blk + 2 < w.nb) SPECDECODE_Q4_0_PRODUCT(0, 1, 4, blk + 2);
    if (pair) {
      _tile_stored(5, sums, 64);
      float_steps(blk + 1);
    }
  }
  for (int t = 0; t < 16; ++t) _mm512_storeu_ps(y + (m0 + t) * N + cg * 16, acc[t]);
}
#undef SPECDECODE_Q4_0_PRODUCT

// Channel groups [first, last) of a Q4_0 layer, its whole 16-row tiles -> the rows done (the VNNI tile does the
// rest). A channel group's codes are unpacked once for all its rows.
int64_t amx_q4_0(const Acts& a, const Weight& w, int64_t first, int64_t last, int64_t M, int64_t N, float* y) {
  uint8_t* b = tile_scratch(static_cast<size_t>(w.nb * 512));
  const __m512i offset = _mm512_set1_epi8(8);
  const int64_t whole = M / 16 * 16;
  configure_q4_0_tiles();
  for (int64_t cg = first; cg < last; ++cg) {
    for (int64_t blk = 0; blk < w.nb; ++blk)
      for (int j = 0; j < 8; ++j)
        _mm512_store_si512(b + blk * 512 + j * 64, _mm512_sub_epi8(chunk_codes<4>(w, cg * w.nb + blk, j), offset));
    for (int64_t m = 0; m < whole; m += 16) amx_q4_0_rows(a, w, b, cg, m, y, N);
  }
  _tile_release();
  return whole;
}
#endif

#else
constexpr int kTile = 4;  // both halves' running sums of 4 rows fill the 16 registers (the tile below)

// AVX2: two 8-channel halves of each vector, vpmaddubsw's int16 pair sums added over kRun chunks (they cannot
// overflow) and widened by one vpmaddwd, as quant_c16_cpu.cpp's AVX2 tile does. Q8_0 multiplies |code| by the
// activation with the code's sign (vpmaddubsw's first operand is unsigned), the sum of code x activation that the
// AVX-512 tile reaches through the +128 offset: the same integers, and the same float steps lane by lane.
template <int BITS, int OFF = 0>
inline __m256i chunk_codes_half(const Weight& w, int64_t at, int j, int h) {
  if constexpr (BITS == 8) return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.codes + (at * 8 + j) * 64 + 32 * h));
  const __m256i packed = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.codes + (at * 4 + j / 2) * 64 + 32 * h));
  __m256i codes = _mm256_and_si256(j % 2 ? _mm256_srli_epi16(packed, 4) : packed, _mm256_set1_epi8(0x0F));
  if constexpr (BITS == 4 && OFF == 16) return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(mxfp4_codes()), codes);
  if constexpr (BITS == 5) {  // bit j of each byte -> bit 4
    const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w.hi + at * 64 + 32 * h));
    const __m256i moved = j <= 4 ? _mm256_slli_epi16(high, 4 - j) : _mm256_srli_epi16(high, j - 4);
    codes = _mm256_or_si256(codes, _mm256_and_si256(moved, _mm256_set1_epi8(0x10)));
  }
  return codes;
}

// Both 8-channel halves in one pass over a block: each activation broadcast feeds two products (quant_c16_cpu.cpp's
// tile_pass says why that pays on Zen 3), with 2 x TILE running sums in 16 registers, so up to 4 rows a pass.
// Measured on Zen 3, one thread, row-chunks per ns, one half a pass -> both: Q5_0 1 row 0.55-0.59 -> 0.72-0.82,
// 4 rows 1.0-1.1 -> 1.7-1.8, 8 rows (one pass -> 4 + 4) 1.1-1.2 -> 1.7; Q8_0 0.65 -> 0.75, 0.7 -> 1.2, 0.9 -> 1.1-1.3;
// Q4_0 and Q4_1 the same at 1 row and 1.5-1.9x at 2-8.
template <int BITS, int OFF, int TILE>
void tile(const Acts& a, const Weight& w, int64_t cg, int64_t m0, float* y, int64_t N) {
  // chunks whose int16 pair sums cannot overflow (MXFP4's codes reach 28, as 5-bit codes do)
  constexpr int kRun = BITS == 4 && OFF != 16 ? 8 : BITS <= 5 ? 4 : 1;
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[2][TILE];
  for (int h = 0; h < 2; ++h)
    for (int t = 0; t < TILE; ++t) acc[h][t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < w.nb; ++b) {
    const int64_t at = cg * w.nb + b;
    if (m0 == 0) prefetch_block<BITS, OFF>(w, at + kAhead);
    __m256i isum[2][TILE], part[2][TILE];
    for (int h = 0; h < 2; ++h)
      for (int t = 0; t < TILE; ++t) isum[h][t] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      __m256i codes[2], sign[2];
      for (int h = 0; h < 2; ++h) {
        codes[h] = chunk_codes_half<BITS, OFF>(w, at, j, h);
        if constexpr (BITS == 8) {  // stored + 128: back to signed, then |code| and its sign
          sign[h] = _mm256_xor_si256(codes[h], _mm256_set1_epi8(static_cast<char>(0x80)));
          codes[h] = _mm256_abs_epi8(sign[h]);
        }
      }
      for (int t = 0; t < TILE; ++t) {
        const __m256i x = specdecode::broadcast4(a.q + (m0 + t) * a.K + b * 32 + 4 * j);
        for (int h = 0; h < 2; ++h) {
          const __m256i p = _mm256_maddubs_epi16(codes[h], BITS == 8 ? _mm256_sign_epi8(x, sign[h]) : x);
          part[h][t] = j % kRun == 0 ? p : _mm256_add_epi16(part[h][t], p);
          specdecode::pin(part[h][t]);
        }
      }
      if (j % kRun == kRun - 1)
        for (int h = 0; h < 2; ++h)
          for (int t = 0; t < TILE; ++t) isum[h][t] = _mm256_add_epi32(isum[h][t], _mm256_madd_epi16(part[h][t], ones));
    }
    for (int h = 0; h < 2; ++h) {
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.d + at * 16 + 8 * h)));
      __m256 dmin;
      if constexpr (OFF == 0) dmin = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.dmin + at * 16 + 8 * h)));
      for (int t = 0; t < TILE; ++t) {
        const int64_t blk = (m0 + t) * (a.K / 32) + b;
        __m256i s = isum[h][t];
        if constexpr (OFF > 0 && BITS != 8) s = _mm256_sub_epi32(s, _mm256_set1_epi32(OFF * a.sum[blk]));
        const __m256 xd = _mm256_set1_ps(a.xd[blk]);
        acc[h][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(d, xd), acc[h][t]);
        if constexpr (OFF == 0)
          acc[h][t] = _mm256_fnmadd_ps(dmin, _mm256_set1_ps(a.xd[blk] * static_cast<float>(a.sum[blk])), acc[h][t]);
      }
    }
  }
  for (int t = 0; t < TILE; ++t)
    for (int h = 0; h < 2; ++h) _mm256_storeu_ps(y + (m0 + t) * N + cg * 16 + 8 * h, acc[h][t]);
}
#endif

#if !(defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AMX_TILE__) && \
      defined(__AMX_INT8__))
constexpr int64_t kAmxMinRows = 0;
int64_t amx_q4_0(const Acts&, const Weight&, int64_t, int64_t, int64_t, int64_t, float*) { return 0; }
#endif

using TileFn = void (*)(const Acts&, const Weight&, int64_t, int64_t, float*, int64_t);

template <int BITS, int OFF, int... T>
std::vector<TileFn> tiles(std::integer_sequence<int, T...>) {
  return {&tile<BITS, OFF, T + 1>...};
}

// x [M, K] -> int8 codes per block of 32 (amax / 127, as quant_cpu.cpp rounds), scales, and sums of the codes.
void quantize_acts(const float* x, int64_t M, int64_t K, int8_t* q, float* xd, int32_t* sum) {
  at::parallel_for(0, M, 1, [&](int64_t first, int64_t last) {
    for (int64_t m = first; m < last; ++m)
      for (int64_t b = 0; b < K / 32; ++b) {
        int8_t* qb = q + m * K + b * 32;
        xd[m * (K / 32) + b] = specdecode::quantize_block(x + m * K + b * 32, 32, qb);
        int32_t s = 0;
        for (int i = 0; i < 32; ++i) s += qb[i];
        sum[m * (K / 32) + b] = s;
      }
  });
}

}  // namespace

LinearWork linear_c16_legacy_work(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& hi,
                                  const at::Tensor& d, const at::Tensor& dmin, const at::Tensor& bias,
                                  int64_t bits, int64_t offset, QuantizedActs& acts) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [M, K] float32");
  const int64_t M = x.size(0), K = x.size(1), ng = codes.size(0), nb = codes.size(1), N = ng * 16;
  TORCH_CHECK(K == nb * 32, "x has ", K, " columns, the weight ", nb * 32);
  using Seq = std::make_integer_sequence<int, kTile>;
  static const std::vector<TileFn> q4_0 = tiles<4, 8>(Seq{}), q4_1 = tiles<4, 0>(Seq{});
  static const std::vector<TileFn> q5_0 = tiles<5, 16>(Seq{}), q5_1 = tiles<5, 0>(Seq{});
  static const std::vector<TileFn> q8_0 = tiles<8, 128>(Seq{}), mxfp4 = tiles<4, 16>(Seq{});
  const std::vector<TileFn>* fns = nullptr;
  if (bits == 4) fns = offset == 16 ? &mxfp4 : offset ? &q4_0 : &q4_1;
  if (bits == 5) fns = offset ? &q5_0 : &q5_1;
  if (bits == 8 && offset == 128) fns = &q8_0;
  TORCH_CHECK(fns != nullptr && (offset == 0 || offset == (bits == 8 ? 128 : 1 << (bits - 1)) ||
                                 (bits == 4 && offset == 16)),
              "no kernel for bits=", bits, " offset=", offset);
  TORCH_CHECK(!bias.numel() || bias.numel() == N, "bias must have one value per output");
  auto& quantized = acts.by_format[-32];  // every 32-weight block type reads these (the k-quants key by G > 0)
  if (quantized.empty()) {
    quantized = {at::empty({M, K}, x.options().dtype(at::kChar)), at::empty({M, K / 32}, x.options()),
                 at::empty({M, K / 32}, x.options().dtype(at::kInt))};
    quantize_acts(x.data_ptr<float>(), M, K, quantized[0].data_ptr<int8_t>(), quantized[1].data_ptr<float>(),
                  quantized[2].data_ptr<int32_t>());
  }
  const Acts a{quantized[0].data_ptr<int8_t>(), quantized[1].data_ptr<float>(), quantized[2].data_ptr<int32_t>(), K};
  const Weight w{codes.data_ptr<uint8_t>(), hi.numel() ? hi.data_ptr<uint8_t>() : nullptr,
                 reinterpret_cast<const uint16_t*>(d.data_ptr()),
                 dmin.numel() ? reinterpret_cast<const uint16_t*>(dmin.data_ptr()) : nullptr, nb};
  auto y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  const float* bp = bias.numel() ? bias.data_ptr<float>() : nullptr;
  LinearWork work;
  work.units = ng;
  const int lines = bits == 8 ? 8 : 4;
  // A prompt's rows of a Q4_0 layer on AMX, where the CPU has it (bit-identical rows: see amx_q4_0_rows); amx_on()
  // is false in a build without the tiles
  const bool amx = bits == 4 && offset == 8 && M >= kAmxMinRows && amx_on();
  work.run = [a, w, fns, M, N, yp, bp, lines, amx](int64_t first, int64_t last) {
    // The first blocks of this thread's share, asked for at once: the tiles prefetch kAhead blocks ahead of
    // themselves, and a small layer (the draft model's k, v, o) would otherwise start each share at the memory's
    // latency, block by block.
    for (int64_t at = first * w.nb; at < std::min(last * w.nb, first * w.nb + kAhead); ++at) {
      for (int line = 0; line < lines; ++line) prefetch_weights(w.codes + (at * lines + line) * 64);
      if (w.hi != nullptr) prefetch_weights(w.hi + at * 64);
      prefetch_weights(w.d + at * 16);
    }
    const int64_t done = amx ? amx_q4_0(a, w, first, last, M, N, yp) : 0;  // whole 16-row tiles
    run_channel_groups(first, last, M, N, kTile, yp, bp, [&](int64_t cg, int64_t m, int64_t rows) {
      if (m >= done) (*fns)[rows - 1](a, w, cg, m, yp, N);
    });
  };
  work.done = [y] { return y; };
  work.y = yp, work.rows = M, work.cols = N;
  return work;
}

at::Tensor linear_c16_legacy(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& hi,
                             const at::Tensor& d, const at::Tensor& dmin, const at::Tensor& bias,
                             int64_t bits, int64_t offset) {
  QuantizedActs acts;
  return run_alone(linear_c16_legacy_work(x, codes, hi, d, dmin, bias, bits, offset, acts));
}

// Integer multiply-adds a second, as operations (a multiply and an add per weight and activation), of back-to-back
// u8 x s8 dot products on registers, every thread of the team at once: the peak a prompt's forward on the integer
// kernels is measured against (profile_step.py). The instructions the 32-weight tiles above use: vpdpbusd on
// AVX-512 VNNI, AVX-VNNI's on AVX2 machines with it, else vpmaddubsw then vpmaddwd.
double int8_dot_peak_ops(int64_t steps) {
  const int64_t threads = at::get_num_threads();
  std::atomic<int64_t> sink{0};
  volatile int8_t seed = 1;  // values the compiler cannot fold the loop over
  const auto began = std::chrono::steady_clock::now();
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    constexpr int kAcc = 8;  // independent chains: the instruction's latency hidden behind its throughput
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
    const __m512i a = _mm512_set1_epi8(seed), b = _mm512_set1_epi8(static_cast<char>(seed + 1));
    __m512i acc[kAcc];
    for (auto& v : acc) v = _mm512_setzero_si512();
    for (int64_t i = 0; i < steps; ++i)
      for (auto& v : acc) v = _mm512_dpbusd_epi32(v, a, b);
    int64_t total = 0;
    for (auto& v : acc) total += _mm512_reduce_add_epi32(v);
#else
    const __m256i a = _mm256_set1_epi8(seed), b = _mm256_set1_epi8(static_cast<char>(seed + 1));
    __m256i acc[kAcc];
    for (auto& v : acc) v = _mm256_setzero_si256();
#if defined(__AVXVNNI__)
    for (int64_t i = 0; i < steps; ++i)
      for (auto& v : acc) v = _mm256_dpbusd_avx_epi32(v, a, b);
#else
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t i = 0; i < steps; ++i)
      for (auto& v : acc) v = _mm256_add_epi32(v, _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones));
#endif
    alignas(32) int32_t lanes[8];
    int64_t total = 0;
    for (auto& v : acc) {
      _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), v);
      for (int32_t x : lanes) total += x;
    }
#endif
    sink += total;
  });
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
  constexpr double kMacs = 64;  // per instruction: 16 lanes of 4 products
#else
  constexpr double kMacs = 32;
#endif
  if (sink.load() == 42) return 0.0;  // keeps the sums live
  return static_cast<double>(threads) * static_cast<double>(steps) * 8 * kMacs * 2 / seconds;
}
