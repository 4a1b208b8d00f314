// Decode attention for CPUs with AVX2 + FMA: each query row attends to its own list of KV cache slots, computed by
// one fixed sequence of operations that depends only on that row's slots, never on how many rows are in the call.
// With the batch-invariant linear kernel this makes a verify forward equal one-token forwards bit for bit; it is
// also far cheaper than one stock attention call per row.
//
// q [B, H, T, D] float32; k_cache, v_cache [B, Hkv, S_max, D] float32 or bfloat16. Row t attends to slots
// [0, spans[t]) and then to the slots extras[t] in order (a tree node's ancestors: empty for a chain). A tree row
// whose ancestors sit at scattered slots thus runs exactly the operations a one-token forward of its path runs
// over contiguous slots. Grouped-query attention: head h reads KV head h / (H / Hkv). Returns [B, H, T, D] float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  return specdecode::load_bf16x8(reinterpret_cast<const uint16_t*>(p));
}

using specdecode::lane_sum;

// exp(x) of eight lanes, for x <= 0 (softmax after subtracting the maximum): exp(x) = 2^n exp(r), r = x - n ln 2,
// exp(r) by a degree-7 polynomial; within ~2 ulp of expf. Lane by lane, so a row's weights do not depend on
// where its scores sit in a vector.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));  // below this expf is denormal or 0: 2^-126 is close enough to 0
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // ln 2 in two parts: r stays exact
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i two_n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(two_n));
}

// q . key over D in one chain of fused multiply-adds, then the fixed lane sum: the same operations for every key.
template <typename T>
inline float dot(const float* q, const T* key, int64_t D) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(load8(q + d), load8(key + d), acc);
  return lane_sum(acc);
}

// One query row of the G heads that share a KV head: per head, softmax(q . k[s] * scale) over the row's slots, then
// the weighted sum of v[s], all in float32. Slot j of the row is j for j < span, extra[j - span] after.
// The loops walk the keys and values once for all G heads (a block of keys or a tile of values is read from
// memory once and used G times from L1) and keep several independent chains in flight, without changing any
// value's order of operations: each score is its own chain over d, each output lane one chain over the slots in
// order, the softmax denominator eight lane chains over the slots then the fixed lane sum. So a row's result
// depends only on its own slots, never on the other rows or heads of the call.
// q, out: head g at q + g * stride; scores: head g at scores + g * s_stride, s_stride >= count + 8;
// inv_total: G floats of room.
template <typename T>
void attend_group(const float* q, float* out, int64_t stride, int64_t G, const T* k, const T* v, int64_t span,
                  const std::vector<int64_t>& extra, int64_t D, float scale, float* scores, int64_t s_stride,
                  float* inv_total) {
  const int64_t count = span + static_cast<int64_t>(extra.size());
  auto slot = [&](int64_t j) { return j < span ? j : extra[j - span]; };
  int64_t j = 0;
  for (; j + 4 <= count; j += 4) {  // four independent chains; the same per-key operations as dot()
    const T* k0 = k + slot(j) * D;
    const T* k1 = k + slot(j + 1) * D;
    const T* k2 = k + slot(j + 2) * D;
    const T* k3 = k + slot(j + 3) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float* qg = q + g * stride;
      __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
      for (int64_t d = 0; d < D; d += 8) {
        const __m256 qd = load8(qg + d);
        a0 = _mm256_fmadd_ps(qd, load8(k0 + d), a0);
        a1 = _mm256_fmadd_ps(qd, load8(k1 + d), a1);
        a2 = _mm256_fmadd_ps(qd, load8(k2 + d), a2);
        a3 = _mm256_fmadd_ps(qd, load8(k3 + d), a3);
      }
      float* s = scores + g * s_stride + j;
      s[0] = lane_sum(a0) * scale, s[1] = lane_sum(a1) * scale, s[2] = lane_sum(a2) * scale, s[3] = lane_sum(a3) * scale;
    }
  }
  for (; j < count; ++j)
    for (int64_t g = 0; g < G; ++g) scores[g * s_stride + j] = dot(q + g * stride, k + slot(j) * D, D) * scale;
  // per head: weights exp(s - top), eight at a time; the last vector's lanes past `count` are computed, then dropped
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * s_stride;
    float top = -INFINITY;
    for (j = 0; j < count; ++j) top = std::max(top, s[j]);
    const __m256 shift = _mm256_set1_ps(top);
    __m256 lanes = _mm256_setzero_ps();
    for (j = 0; j < count; j += 8) {
      const int64_t live = std::min<int64_t>(8, count - j);
      for (int64_t i = live; i < 8; ++i) s[j + i] = top;
      const __m256 keep = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(live)),
                                                                 _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)));
      const __m256 w = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), shift)), keep);
      _mm256_storeu_ps(s + j, w);
      lanes = _mm256_add_ps(lanes, w);
    }
    inv_total[g] = 1.f / lane_sum(lanes);
  }
  // weighted sums of v, unnormalised, into `out`: 64 output lanes (eight chains) per pass, tiles of kSlots slots
  // read once for all heads; the partial sums wait in `out` between tiles (a store and a load change no bit)
  constexpr int64_t kSlots = 32;
  int64_t d0 = 0;
  for (; d0 + 64 <= D; d0 += 64)
    for (int64_t j0 = 0; j0 < count; j0 += kSlots)
      for (int64_t g = 0; g < G; ++g) {
        const float* s = scores + g * s_stride;
        float* o = out + g * stride + d0;
        __m256 acc[8];
        for (int c = 0; c < 8; ++c) acc[c] = j0 == 0 ? _mm256_setzero_ps() : _mm256_loadu_ps(o + 8 * c);
        for (j = j0; j < std::min(count, j0 + kSlots); ++j) {
          const __m256 w = _mm256_set1_ps(s[j]);
          const T* row = v + slot(j) * D + d0;
          for (int c = 0; c < 8; ++c) acc[c] = _mm256_fmadd_ps(w, load8(row + 8 * c), acc[c]);
        }
        for (int c = 0; c < 8; ++c) _mm256_storeu_ps(o + 8 * c, acc[c]);
      }
  for (; d0 < D; d0 += 8)
    for (int64_t g = 0; g < G; ++g) {
      const float* s = scores + g * s_stride;
      __m256 acc = _mm256_setzero_ps();
      for (j = 0; j < count; ++j) acc = _mm256_fmadd_ps(_mm256_set1_ps(s[j]), load8(v + slot(j) * D + d0), acc);
      _mm256_storeu_ps(out + g * stride + d0, acc);
    }
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < D; d += 8) {
      float* o = out + g * stride + d;
      _mm256_storeu_ps(o, _mm256_mul_ps(_mm256_loadu_ps(o), _mm256_set1_ps(inv_total[g])));
    }
}

template <typename T>
void attend(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
            const std::vector<int64_t>& spans, const std::vector<std::vector<int64_t>>& extras, torch::Tensor& out) {
  const int64_t B = q.size(0), H = q.size(1), T_ = q.size(2), D = q.size(3);
  const int64_t Hkv = k_cache.size(1), S_max = k_cache.size(2), group = H / Hkv;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const float* qp = q.data_ptr<float>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  float* op = out.data_ptr<float>();
  const std::vector<int64_t> none;
  // one unit of work: a row of a batch entry against one KV head, for all the query heads that read it
  at::parallel_for(0, B * Hkv * T_, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores(group * (S_max + 8)), inv_total(group);  // per thread, reused by its rows
    for (int64_t i = first; i < last; ++i) {
      const int64_t b = i / (Hkv * T_), kvh = (i / T_) % Hkv, t = i % T_;
      const int64_t kv = (b * Hkv + kvh) * S_max * D, row = ((b * H + kvh * group) * T_ + t) * D;
      attend_group(qp + row, op + row, T_ * D, group, kp + kv, vp + kv, spans[t], extras.empty() ? none : extras[t],
                   D, scale, scores.data(), S_max + 8, inv_total.data());
    }
  });
}

}  // namespace

torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               std::vector<int64_t> spans, std::vector<std::vector<int64_t>> extras) {
  TORCH_CHECK(q.dim() == 4 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(), "q: float32 [B, H, T, D]");
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
  auto out = torch::empty_like(q);
  if (k_cache.scalar_type() == torch::kFloat32) {
    attend<float>(q, k_cache, v_cache, spans, extras, out);
  } else {
    TORCH_CHECK(k_cache.scalar_type() == torch::kBFloat16, "caches must be float32 or bfloat16");
    attend<at::BFloat16>(q, k_cache, v_cache, spans, extras, out);
  }
  return out;
}

// The glue of one attention layer in one call (a one-token step is mostly small framework operations):
// q [B, T, H, D], k and v [B, T, Hkv, D] float32 (the projections' outputs, viewed), cos and sin [B, T, D].
// Rotates q and k by x * cos + rotate_half(x) * sin, rounded as that eager formula rounds (two products, one sum,
// no fused multiply-add), writes k and v into cache slots [start, start + T) of k_cache, v_cache [B, Hkv, S, D]
// (float32) with start = slots[0] (rope_store_at: given), and returns q rotated as [B, H, T, D], the layout decode_attention reads.
torch::Tensor rope_store(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& k_cache,
                         torch::Tensor& v_cache, const torch::Tensor& slots) {
  return rope_store_at(q, k, v, cos, sin, k_cache, v_cache, slots.data_ptr<int64_t>()[0]);
}

torch::Tensor rope_store_at(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& k_cache,
                            torch::Tensor& v_cache, int64_t start) {
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&q, &k, &v, &cos, &sin, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous(), "rope_store takes contiguous float32");
  const int64_t B = q.size(0), T_ = q.size(1), H = q.size(2), D = q.size(3), Hkv = k.size(2), S = k_cache.size(2);
  const int64_t half = D / 2;
  TORCH_CHECK(start >= 0 && start + T_ <= S, "cache slots out of range");
  auto out = torch::empty({B, H, T_, D}, q.options());
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
  float* kc = k_cache.data_ptr<float>();
  float* vc = v_cache.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T_; ++t) {
      const float* cb = c + (b * T_ + t) * D;
      const float* sb = s + (b * T_ + t) * D;
      for (int64_t h = 0; h < H; ++h) rotate(qp + ((b * T_ + t) * H + h) * D, cb, sb, op + ((b * H + h) * T_ + t) * D);
      for (int64_t h = 0; h < Hkv; ++h) {
        const int64_t src = ((b * T_ + t) * Hkv + h) * D, dst = ((b * Hkv + h) * S + start + t) * D;
        rotate(kp + src, cb, sb, kc + dst);
        std::copy(vp + src, vp + src + D, vc + dst);
      }
    }
  return out;
}
