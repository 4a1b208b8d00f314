// Embedding rows de-quantized from the row layout of blocks.py, in one native call. A decode forward looks up a
// few tokens, and torch's ~20 tensor operations per lookup (PackedWeight.rows, then .dequantize) cost 250-300 us on
// the caches the previous forward flushed, several times a speculative step. Every weight is computed as
// PackedWeight.dequantize computes it in float32, operation by operation: (d * scale) * code, then minus
// dmin * min where the format has a minimum (scale and min are 1 in the 32-weight formats): the same bits, tested.
#include "aten_lite.h"

#include <cstdint>

#include "kernels.h"

namespace {

struct Rows {
  const uint8_t* qs;   // [out, K / 2] nibbles, or [out, K] signed codes (8 bits)
  const uint8_t* qh;   // [out, planes, K / 8] bit planes of the high bits
  const int8_t* sc;    // [out, K / group]
  const int8_t* mn;    // [out, K / group]
  const at::Half* d;   // [out, K / superblock]
  const at::Half* dm;  // [out, K / superblock]
  int64_t K, bits;
  int sb_shift, group_shift;  // superblock and group sizes are powers of two: index by shifts, not divisions
  bool sub_scales, has_min;
};

// The code of weight k of row t.
inline int32_t code_at(const Rows& r, const uint8_t* qs, int64_t t, int64_t k, int span_shift) {
  if (r.bits == 8) return static_cast<int8_t>(qs[k]);
  // byte j of a run of codes holds code j (low nibble) and code j + half (high)
  const int64_t half = int64_t{1} << (span_shift - 1), j = k & ((int64_t{1} << span_shift) - 1);
  const uint8_t byte = qs[(k >> span_shift) * half + (j & (half - 1))];
  int32_t code = j < half ? byte & 15 : byte >> 4;
  for (int64_t p = 0; p < r.bits - 4; ++p)  // code k's bit 4 + p is bit k % 8 of the plane's byte k / 8
    code |= ((r.qh[(t * (r.bits - 4) + p) * (r.K / 8) + (k >> 3)] >> (k & 7)) & 1) << (4 + p);
  return code;
}

// Weight row `t` into out[0, K), a group of weights (one scale and min) at a time.
void decode_row(const Rows& r, int64_t t, float* out) {
  const int64_t K = r.K, group = int64_t{1} << r.group_shift;
  const int span_shift = r.sb_shift == 8 ? 7 : 5;  // codes per nibble run: 128 in the k-quants, else 32
  const int64_t nsb = K >> r.sb_shift, ng = K >> r.group_shift;
  const uint8_t* qs = r.qs + t * (r.bits == 8 ? K : K / 2);
  for (int64_t g = 0; g < ng; ++g) {
    const int64_t sb = (g << r.group_shift) >> r.sb_shift;
    const float d = static_cast<float>(r.d[t * nsb + sb]);
    const float scale = r.sub_scales ? d * static_cast<float>(r.sc[t * ng + g]) : d;
    float low = 0.f;
    if (r.has_min) {
      const float dmin = static_cast<float>(r.dm[t * nsb + sb]);
      low = r.sub_scales ? dmin * static_cast<float>(r.mn[t * ng + g]) : dmin;
    }
    for (int64_t k = g * group; k < (g + 1) * group; ++k) {
      const float w = scale * static_cast<float>(code_at(r, qs, t, k, span_shift));
      out[k] = r.has_min ? w - low : w;
    }
  }
}

}  // namespace

at::Tensor embedding_rows(const at::Tensor& tokens, const at::Tensor& qs, const at::Tensor& qh,
                          const at::Tensor& scales, const at::Tensor& mins, const at::Tensor& d,
                          const at::Tensor& dmin, int64_t bits, int64_t superblock, int64_t group,
                          bool sub_scales, bool has_min) {
  TORCH_CHECK(tokens.dim() == 1 && tokens.scalar_type() == at::kLong && tokens.is_contiguous(),
              "tokens: contiguous int64 [n]");
  TORCH_CHECK(bits == 4 || bits == 5 || bits == 6 || bits == 8, "bits must be 4, 5, 6 or 8");
  TORCH_CHECK(d.dim() == 2 && d.scalar_type() == at::kHalf && d.is_contiguous(), "d: contiguous float16 [out, blocks]");
  const int64_t out = d.size(0), K = d.size(1) * superblock;
  TORCH_CHECK((superblock == 32 || superblock == 256) && (group == 16 || group == 32 || group == superblock) &&
                  K % 8 == 0, "superblock must be 32 or 256, group 16, 32 or the superblock, K a multiple of 8");
  TORCH_CHECK(qs.is_contiguous() && qs.numel() == out * (bits == 8 ? K : K / 2), "qs: the codes of [out, K]");
  TORCH_CHECK(bits == 4 || bits == 8 || (qh.is_contiguous() && qh.numel() == out * (bits - 4) * (K / 8)),
              "qh: the high bit planes of [out, K]");
  TORCH_CHECK(!sub_scales || (scales.is_contiguous() && scales.numel() == out * (K / group)), "scales: [out, K / group]");
  TORCH_CHECK(!(sub_scales && has_min) || (mins.is_contiguous() && mins.numel() == out * (K / group)),
              "mins: [out, K / group]");
  TORCH_CHECK(!has_min || (dmin.is_contiguous() && dmin.numel() == d.numel()), "dmin: as d");
  const int64_t n = tokens.size(0);
  const int64_t* ids = tokens.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(ids[i] >= 0 && ids[i] < out, "token ", ids[i], " outside [0, ", out, ")");
  const Rows r{reinterpret_cast<const uint8_t*>(qs.data_ptr()),
               bits == 5 || bits == 6 ? reinterpret_cast<const uint8_t*>(qh.data_ptr()) : nullptr,
               sub_scales ? reinterpret_cast<const int8_t*>(scales.data_ptr()) : nullptr,
               sub_scales && has_min ? reinterpret_cast<const int8_t*>(mins.data_ptr()) : nullptr,
               d.data_ptr<at::Half>(), has_min ? dmin.data_ptr<at::Half>() : nullptr,
               K, bits, __builtin_ctzll(superblock), __builtin_ctzll(group), sub_scales, has_min};
  auto y = at::empty({n, K}, d.options().dtype(at::kFloat));
  float* yp = y.data_ptr<float>();
  // A decode step's few rows on this thread (no fork-join); a prompt's many in parallel.
  constexpr int64_t kRowsPerTask = 32;
  if (n <= kRowsPerTask) {
    for (int64_t i = 0; i < n; ++i) decode_row(r, ids[i], yp + i * K);
  } else {
    at::parallel_for(0, n, kRowsPerTask, [&](int64_t first, int64_t last) {
      for (int64_t i = first; i < last; ++i) decode_row(r, ids[i], yp + i * K);
    });
  }
  return y;
}
