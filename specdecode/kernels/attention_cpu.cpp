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

#include "simd.h"

namespace {

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const at::BFloat16* p) {
  return specdecode::load_bf16x8(reinterpret_cast<const uint16_t*>(p));
}

using specdecode::lane_sum;

// One query row: softmax(q . k[s] * scale) over its slots, then the weighted sum of v[s], all in float32.
// Slot j of the row is j for j < span, extra[j - span] after.
template <typename T>
void attend_row(const float* q, const T* k, const T* v, int64_t span, const std::vector<int64_t>& extra, int64_t D,
                float scale, float* scores, float* out) {
  const int64_t count = span + static_cast<int64_t>(extra.size());
  auto slot = [&](int64_t j) { return j < span ? j : extra[j - span]; };
  float top = -INFINITY;
  for (int64_t j = 0; j < count; ++j) {
    const T* key = k + slot(j) * D;
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(load8(q + d), load8(key + d), acc);
    scores[j] = lane_sum(acc) * scale;
    top = std::max(top, scores[j]);
  }
  float total = 0.f;
  for (int64_t j = 0; j < count; ++j) {
    scores[j] = std::exp(scores[j] - top);
    total += scores[j];
  }
  for (int64_t d = 0; d < D; d += 8) {
    __m256 acc = _mm256_setzero_ps();
    for (int64_t j = 0; j < count; ++j)
      acc = _mm256_fmadd_ps(_mm256_set1_ps(scores[j]), load8(v + slot(j) * D + d), acc);
    _mm256_storeu_ps(out + d, _mm256_mul_ps(acc, _mm256_set1_ps(1.f / total)));
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
  at::parallel_for(0, B * H * T_, 1, [&](int64_t first, int64_t last) {
    std::vector<float> scores(S_max);
    for (int64_t i = first; i < last; ++i) {
      const int64_t b = i / (H * T_), h = (i / T_) % H, t = i % T_;
      const int64_t kv = (b * Hkv + h / group) * S_max * D;
      attend_row(qp + i * D, kp + kv, vp + kv, spans[t], extras.empty() ? none : extras[t], D, scale, scores.data(),
                 op + i * D);
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
// (float32) with start = slots[0], and returns q rotated as [B, H, T, D], the layout decode_attention reads.
torch::Tensor rope_store(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& k_cache,
                         torch::Tensor& v_cache, const torch::Tensor& slots) {
  for (const torch::Tensor* t : std::initializer_list<const torch::Tensor*>{&q, &k, &v, &cos, &sin, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->is_contiguous(), "rope_store takes contiguous float32");
  const int64_t B = q.size(0), T_ = q.size(1), H = q.size(2), D = q.size(3), Hkv = k.size(2), S = k_cache.size(2);
  const int64_t start = slots.data_ptr<int64_t>()[0], half = D / 2;
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
