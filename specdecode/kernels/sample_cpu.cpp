// Sampled decoding's per-row work over a whole vocabulary: top-p probabilities, and a draw from any row of weights.
// In torch, top-p over a 152k vocabulary took ~1.1-2 ms a row (a softmax, a top-256, a scatter, a masked fill, a
// second softmax) and a draw ~1 ms (a count of the non-zero weights, a top-k of them, a cumulative sum): ~12 ms of
// a sampled speculative step that verifies five rows. Here a row is read a few times and written twice.
#include "aten_lite.h"
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "simd.h"

namespace {

// exp((x - top) / temperature) of eight lanes, 0 where x is -inf (a masked token: exp8 alone gives ~1e-38 there)
inline __m256 weights8(__m256 x, __m256 top, __m256 inv_t) {
  const __m256 w = specdecode::exp8(_mm256_mul_ps(_mm256_sub_ps(x, top), inv_t));
  return _mm256_and_ps(w, _mm256_cmp_ps(x, _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ));
}

inline float weight1(float x, float top, float inv_t) { return x == -INFINITY ? 0.f : std::exp((x - top) * inv_t); }

// One row's top-p probabilities into `out`: false where the row holds a NaN or nothing above -inf (the caller asks
// torch then). The nucleus is the likeliest tokens until their mass reaches top_p (each token kept while the mass
// ranked above it is below top_p). It is looked for among the tokens of weight >= total * floor, for falling
// floors: a peaked row's nucleus lies among its few tokens above 1e-3 of the mass, and a sort of those is quick.
constexpr float kFloors[] = {1e-3f, 1e-5f, 1e-7f, 0.f};

bool nucleus_row(const float* x, int64_t V, float inv_t, double top_p, float* out) {
  bool nan = false;
  const float top = specdecode::row_max(x, V, nan);
  if (nan || top == -INFINITY) return false;
  // the weights into `out`, and their sum
  const __m256 shift = _mm256_set1_ps(top), scale = _mm256_set1_ps(inv_t);
  __m256 lanes = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= V; i += 8) {
    const __m256 w = weights8(_mm256_loadu_ps(x + i), shift, scale);
    _mm256_storeu_ps(out + i, w);
    lanes = _mm256_add_ps(lanes, w);
  }
  double total = specdecode::lane_sum(lanes);
  for (; i < V; ++i) total += out[i] = weight1(x[i], top, inv_t);
  if (top_p >= 1.0) {  // no nucleus: the softmax
    const float norm = static_cast<float>(1.0 / total);
    for (i = 0; i < V; ++i) out[i] *= norm;
    return true;
  }
  const double reach = top_p * total;
  std::vector<std::pair<float, int64_t>> ranked;  // (weight, token), likeliest first once sorted
  for (const float floor : kFloors) {
    ranked.clear();
    double mass = 0;
    const __m256 low = _mm256_set1_ps(static_cast<float>(total * floor));
    for (i = 0; i + 8 <= V; i += 8)
      for (int keep = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(out + i), low, _CMP_GE_OQ)); keep;
           keep &= keep - 1) {
        const int64_t j = i + __builtin_ctz(keep);
        if (out[j] > 0.f) ranked.emplace_back(out[j], j), mass += out[j];
      }
    for (; i < V; ++i)
      if (out[i] >= total * floor && out[i] > 0.f) ranked.emplace_back(out[i], i), mass += out[i];
    if (mass >= reach) break;  // the nucleus lies among these: every other token ranks below them all
  }
  std::sort(ranked.begin(), ranked.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  double above = 0;
  size_t kept = 0;
  while (kept < ranked.size() && (kept == 0 || above < reach)) above += ranked[kept++].first;
  std::fill(out, out + V, 0.f);
  const double norm = 1.0 / above;
  for (size_t k = 0; k < kept; ++k) out[ranked[k].second] = static_cast<float>(ranked[k].first * norm);
  return true;
}

}  // namespace

// softmax(logits / temperature) restricted to each row's top-p nucleus (zero elsewhere), [rows, V] float32; an
// empty tensor where a row holds a NaN or only -inf (torch's path then says what to do).
at::Tensor nucleus_probs(const at::Tensor& logits, double temperature, double top_p) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits must be [rows, V] float32");
  TORCH_CHECK(temperature > 0 && top_p > 0 && top_p <= 1, "temperature > 0 and top_p in (0, 1]");
  const int64_t M = logits.size(0), V = logits.size(1);
  auto out = at::empty_like(logits);
  const float* x = logits.data_ptr<float>();
  float* o = out.data_ptr<float>();
  std::vector<char> ok(M, 1);
  at::parallel_for(0, M, 1, [&](int64_t first, int64_t last) {
    for (int64_t m = first; m < last; ++m)
      ok[m] = nucleus_row(x + m * V, V, static_cast<float>(1.0 / temperature), top_p, o + m * V);
  });
  for (char good : ok)
    if (!good) return at::empty({0}, logits.options());
  return out;
}

// One token a row of non-negative weights [rows, V] float32 (any scale), by inverse CDF in index order over the
// weights above zero: token i owns [sum of the weights before it, that plus its own) of the total, and `u` [rows]
// float64 in [0, 1) picks the token owning u * total. -1 for a row whose weights are all zero (or not finite).
at::Tensor draw_rows(const at::Tensor& weights, const at::Tensor& u) {
  TORCH_CHECK(weights.dim() == 2 && weights.scalar_type() == at::kFloat && weights.is_contiguous(),
              "weights must be [rows, V] float32");
  TORCH_CHECK(u.dim() == 1 && u.scalar_type() == at::kDouble && u.size(0) == weights.size(0),
              "u must be [rows] float64");
  const int64_t M = weights.size(0), V = weights.size(1);
  auto out = at::empty({M}, weights.options().dtype(at::kLong));
  const float* w = weights.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* o = out.data_ptr<int64_t>();
  // the weights above zero, in index order: blocks of eight without any are skipped (after top-p, nearly all)
  auto each_live = [V](const float* row, auto&& visit) {
    const __m256 zero = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= V; i += 8)
      for (int any = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + i), zero, _CMP_GT_OQ)); any;
           any &= any - 1)
        if (visit(i + __builtin_ctz(any))) return;
    for (; i < V; ++i)
      if (row[i] > 0.f && visit(i)) return;
  };
  for (int64_t m = 0; m < M; ++m) {
    const float* row = w + m * V;
    double total = 0;
    each_live(row, [&](int64_t j) {
      total += row[j];
      return false;
    });
    o[m] = -1;
    if (total <= 0 || !std::isfinite(total)) continue;
    const double target = up[m] * total;
    double below = 0;  // the same sums in the same order as the total: the last interval ends at it exactly
    each_live(row, [&](int64_t j) {
      below += row[j];
      o[m] = j;
      return below > target;  // u * total rounded up to the total falls to the last token above zero
    });
  }
  return out;
}
