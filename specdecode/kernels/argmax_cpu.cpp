// The index of each row's largest value, for greedy verification, and the few likeliest tokens of a draft's row.
// torch.argmax over a [rows, vocabulary] float32 tensor runs at ~4 GB/s on a 2-core CPU (0.24 ms for six rows of a
// 152k vocabulary, every step). Here a row is read twice at the speed of its cache: its largest value (several
// independent chains), then the first index holding it. Same answer as torch: the first index on ties. A row holding
// a NaN answers -1, and the caller asks torch (which counts NaN as the largest).
#include "aten_lite.h"
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <tuple>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

// The first index holding `value` (which the row holds).
int64_t first_at(const float* x, int64_t V, float value) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512 wanted = _mm512_set1_ps(value);
  for (; i + 16 <= V; i += 16)
    if (const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), wanted, _CMP_EQ_OQ))
      return i + __builtin_ctz(hit);
#else
  const __m256 wanted = _mm256_set1_ps(value);
  for (; i + 8 <= V; i += 8)
    if (const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), wanted, _CMP_EQ_OQ)))
      return i + __builtin_ctz(hit);
#endif
  for (; i < V; ++i)
    if (x[i] == value) return i;
  return 0;  // unreachable for a row without NaN
}

// sum(exp(x - top)) over a row, in one fixed order (eight lanes, then the fixed lane sum).
float exp_sum(const float* row, int64_t V, float top) {
  const __m256 shift = _mm256_set1_ps(top);
  __m256 lanes = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= V; j += 8)
    lanes = _mm256_add_ps(lanes, specdecode::exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), shift)));
  float total = specdecode::lane_sum(lanes);
  for (; j < V; ++j) total += std::exp(row[j] - top);
  return total;
}

void check_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [M, V] float32");
  TORCH_CHECK(x.size(1) > 0 && x.size(1) < (int64_t(1) << 31), "rows must hold 1 to 2^31 - 1 values");
}

// Each thread reduces a contiguous share of every row's columns (a draft's single 32k row too: 20 us against 28 on
// one thread), and the shares' results are combined in column order. The LM head's threads wrote the logits in
// the same contiguous split, so each mostly reads what its own core wrote.
constexpr int64_t kMinShare = 4096;  // columns: below this a thread's start-up costs more than the read

int64_t shares_of(int64_t V) { return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), V / kMinShare)); }

// One share's reduction of one row: its largest value and the first column holding it.
struct ShareMax {
  float value = -INFINITY;
  int64_t index = 0;
  bool nan = false;
};

}  // namespace

at::Tensor argmax_rows(const at::Tensor& x) {
  check_rows(x);
  const int64_t M = x.size(0), V = x.size(1), S = shares_of(V), width = (V + S - 1) / S;
  auto out = at::empty({M}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  std::vector<ShareMax> share(M * S);
  at::parallel_for(0, S, 1, [&](int64_t first, int64_t last) {
    for (int64_t s = first; s < last; ++s) {
      const int64_t begin = s * width, n = std::min(V, begin + width) - begin;
      for (int64_t m = 0; m < M; ++m) {
        ShareMax& r = share[m * S + s];
        r.value = specdecode::row_max(xp + m * V + begin, n, r.nan);
        if (!r.nan) r.index = begin + first_at(xp + m * V + begin, n, r.value);
      }
    }
  });
  for (int64_t m = 0; m < M; ++m) {  // the first share holding the largest value: the first index on ties
    const ShareMax* r = &share[m * S];
    int64_t best = 0;
    bool nan = r[0].nan;
    for (int64_t s = 1; s < S; ++s) {
      nan = nan || r[s].nan;
      if (r[s].value > r[best].value) best = s;
    }
    op[m] = nan ? -1 : r[best].index;
  }
  return out;
}

// Each row's argmax of a linear layer's outputs (an LM head's logits), found while they are still in cache: the
// units run a short run at a time, and each run's outputs are scanned right after. Read afterwards, a verify
// forward's [rows, 152k] logits come back from memory (the head streamed its ~190 MB of weights through the caches
// while writing them): 0.15-0.25 ms a greedy step. The same answer as argmax_rows: each run keeps its first index of
// its largest value, and the runs merge keeping the largest value's lowest index. No indices (an empty tensor) when
// a row holds a NaN: torch's argmax decides then, as for argmax_rows' -1.
constexpr int64_t kScanUnits = 32;  // 512 outputs a row: a run's outputs stay in L1/L2 beside its weights

std::vector<at::Tensor> run_with_argmax(const LinearWork& work) {
  TORCH_CHECK(work.y != nullptr && work.units > 0, "run_with_argmax: a 16-channel kernel's work");
  const int64_t M = work.rows, N = work.cols;
  std::vector<ShareMax> best(M);
  std::mutex merging;
  run_units(work.units, [&](int64_t first, int64_t last) {
    std::vector<ShareMax> mine(M);  // this share's, its runs in ascending order: the first index on ties
    for (int64_t u = first; u < last; u += kScanUnits) {
      const int64_t end = std::min(last, u + kScanUnits), n = 16 * (end - u);
      work.run(u, end);
      for (int64_t m = 0; m < M; ++m) {
        const float* row = work.y + m * N + 16 * u;
        bool nan = false;
        const float top = specdecode::row_max(row, n, nan);
        ShareMax& r = mine[m];
        r.nan = r.nan || nan;
        if (!nan && top > r.value) r.value = top, r.index = 16 * u + first_at(row, n, top);
      }
    }
    std::lock_guard<std::mutex> hold(merging);
    for (int64_t m = 0; m < M; ++m) {
      ShareMax& b = best[m];
      const ShareMax& r = mine[m];
      b.nan = b.nan || r.nan;
      if (r.value > b.value || (r.value == b.value && r.index < b.index)) b.value = r.value, b.index = r.index;
    }
  });
  bool nan = false;
  for (const ShareMax& b : best) nan = nan || b.nan;
  auto index = at::empty({nan ? 0 : M}, at::TensorOptions().dtype(at::kLong));
  int64_t* ip = index.data_ptr<int64_t>();
  for (int64_t m = 0; m < index.size(0); ++m) ip[m] = best[m].index;
  return {work.done(), index};
}

// Each row's k likeliest tokens, likeliest first (the lower index first among equals), and their softmax
// probabilities exp(x - max) / sum(exp(x - max)): what a greedy drafter keeps of a draft forward's logits (torch's
// softmax and topk over a 32k head take ~120 us a row; k = 1 is a chain's child). Each share of the columns keeps
// its own k best and its exp sum against its own maximum; the shares merge in column order. Index -1 (and
// probability 0) where a row has a NaN or fewer than k values above -inf. Into ip, pp [M, k], which it fills.
// Plain loops, no ATen calls: on the caches a forward has just flushed, each of those costs ~10 us.
namespace {
void topk_into(const at::Tensor& x, int64_t k, int64_t* ip, float* pp) {
  const int64_t M = x.size(0), V = x.size(1);
  const int64_t S = shares_of(V), width = (V + S - 1) / S;
  std::fill(ip, ip + M * k, -1);
  std::fill(pp, pp + M * k, 0.f);
  const float* xp = x.data_ptr<float>();
  std::vector<float> top(M * S * k, -INFINITY), share_max(M * S), share_sum(M * S);
  std::vector<int64_t> at(M * S * k, -1);
  std::vector<char> nan(M * S);
  // keep (v, j) among the k best of best[0..k) / where[0..k) if strictly above the k-th: an equal later value
  // stays out, so among equals the lower index comes first
  auto offer = [k](float* best, int64_t* where, float v, int64_t j) {
    if (!(v > best[k - 1])) return;
    int64_t place = k - 1;
    while (place > 0 && v > best[place - 1]) best[place] = best[place - 1], where[place] = where[place - 1], --place;
    best[place] = v, where[place] = j;
  };
  at::parallel_for(0, S, 1, [&](int64_t first, int64_t last) {
    for (int64_t s = first; s < last; ++s) {
      const int64_t begin = s * width, n = std::min(V, begin + width) - begin;
      for (int64_t m = 0; m < M; ++m) {
        const int64_t r = m * S + s;
        const float* row = xp + m * V + begin;
        bool row_nan = false;
        share_max[r] = specdecode::row_max(row, n, row_nan);
        nan[r] = row_nan;
        if (row_nan) continue;
        float* best = &top[r * k];
        int64_t* where = &at[r * k];
        int64_t j = 0;
#if defined(__AVX512F__)
        for (; j + 16 <= n; j += 16) {  // most blocks hold nothing above the k-th kept value
          __mmask16 above = _mm512_cmp_ps_mask(_mm512_loadu_ps(row + j), _mm512_set1_ps(best[k - 1]), _CMP_GT_OQ);
          for (; above; above &= above - 1) {
            const int64_t c = j + __builtin_ctz(above);
            offer(best, where, row[c], begin + c);
          }
        }
#else
        for (; j + 8 <= n; j += 8) {
          const __m256 kth = _mm256_set1_ps(best[k - 1]);
          int above = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(row + j), kth, _CMP_GT_OQ));
          for (; above; above &= above - 1) {
            const int64_t c = j + __builtin_ctz(above);
            offer(best, where, row[c], begin + c);
          }
        }
#endif
        for (; j < n; ++j) offer(best, where, row[j], begin + j);
        share_sum[r] = share_max[r] == -INFINITY ? 0.f : exp_sum(row, n, share_max[r]);
      }
    }
  });
  std::vector<float> best(k);
  for (int64_t m = 0; m < M; ++m) {
    bool row_nan = false;
    float peak = -INFINITY;
    for (int64_t s = 0; s < S; ++s) row_nan = row_nan || nan[m * S + s], peak = std::max(peak, share_max[m * S + s]);
    if (row_nan || peak == -INFINITY) continue;
    std::fill(best.begin(), best.end(), -INFINITY);
    int64_t* where = ip + m * k;
    float total = 0.f;
    for (int64_t s = 0; s < S; ++s) {  // in column order
      const int64_t r = m * S + s;
      if (share_max[r] != -INFINITY) total += share_sum[r] * std::exp(share_max[r] - peak);
      for (int64_t c = 0; c < k && at[r * k + c] >= 0; ++c) offer(best.data(), where, top[r * k + c], at[r * k + c]);
    }
    if (where[k - 1] < 0) {  // fewer than k values above -inf
      std::fill(where, where + k, -1);
      continue;
    }
    for (int64_t c = 0; c < k; ++c) pp[m * k + c] = std::exp(best[c] - peak) / total;
  }
}
}  // namespace

// -> (index [M, k], probabilities [M, k], whether every row has them: else the caller asks torch)
std::tuple<at::Tensor, at::Tensor, bool> topk_probs(const at::Tensor& x, int64_t k) {
  check_rows(x);
  TORCH_CHECK(k >= 1 && k <= x.size(1), "k must be in [1, vocabulary]");
  auto index = at::empty({x.size(0), k}, x.options().dtype(at::kLong));
  auto prob = at::empty({x.size(0), k}, x.options());
  int64_t* ip = index.data_ptr<int64_t>();
  topk_into(x, k, ip, prob.data_ptr<float>());
  return {index, prob, std::all_of(ip, ip + index.numel(), [](int64_t i) { return i >= 0; })};
}

// topk_probs' answer as rows of Python lists (what a tree drafter reads): no tensors allocated and read back, each
// ~5-10 us on the caches a forward has just flushed. The same values, bit for bit.
std::tuple<std::vector<std::vector<int64_t>>, std::vector<std::vector<float>>, bool> topk_lists(const at::Tensor& x,
                                                                                               int64_t k) {
  check_rows(x);
  TORCH_CHECK(k >= 1 && k <= x.size(1), "k must be in [1, vocabulary]");
  const int64_t M = x.size(0);
  std::vector<int64_t> ip(M * k);
  std::vector<float> pp(M * k);
  topk_into(x, k, ip.data(), pp.data());
  std::vector<std::vector<int64_t>> index(M);
  std::vector<std::vector<float>> prob(M);
  for (int64_t m = 0; m < M; ++m) {
    index[m].assign(ip.begin() + m * k, ip.begin() + (m + 1) * k);
    prob[m].assign(pp.begin() + m * k, pp.begin() + (m + 1) * k);
  }
  return {index, prob, std::all_of(ip.begin(), ip.end(), [](int64_t i) { return i >= 0; })};
}

// Each row's argmax and the softmax probability of it, 1 / sum(exp(x - max)): what a greedy chain drafter keeps of
// a draft forward's logits, without a softmax over the whole row. A row of -inf only: index 0, probability NaN, as
// torch gives. -> (index [M], probabilities [M], whether no row holds a NaN: else the caller asks torch)
std::tuple<at::Tensor, at::Tensor, bool> top1_probs(const at::Tensor& x) {
  check_rows(x);
  auto index = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  auto prob = at::empty({x.size(0)}, x.options());
  int64_t* ip = index.data_ptr<int64_t>();
  float* pp = prob.data_ptr<float>();
  topk_into(x, 1, ip, pp);
  const float* xp = x.data_ptr<float>();
  bool ok = true;
  for (int64_t m = 0; m < x.size(0); ++m)
    if (ip[m] < 0) {  // a row of -inf only: torch's argmax is 0 and its softmax NaN (0 / 0); a NaN: torch decides
      bool row_nan = false;
      specdecode::row_max(xp + m * x.size(1), x.size(1), row_nan);
      ip[m] = 0;
      pp[m] = NAN;
      ok = ok && !row_nan;
    }
  return {index, prob, ok};
}

// A grammar's token bitmask applied to logits in place: bit j of word w of a row set = token 32 w + j allowed, any
// other token -inf. Torch's unpack-and-fill takes ~0.45 ms per 152k-token row; this is one pass over the row, eight
// lanes at a time (each lane tests its own bit of the word's byte).
void mask_disallowed(at::Tensor& logits, const at::Tensor& bits) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.is_contiguous(),
              "logits: contiguous float32 [rows, vocab]");
  TORCH_CHECK(bits.dim() == 2 && bits.scalar_type() == at::kInt && bits.is_contiguous() &&
                  bits.size(0) == logits.size(0) && bits.size(1) * 32 >= logits.size(1),
              "bits: contiguous int32 [rows, ceil(vocab / 32)]");
  const int64_t M = logits.size(0), V = logits.size(1), W = bits.size(1);
  float* xp = logits.data_ptr<float>();
  const uint32_t* bp = reinterpret_cast<const uint32_t*>(bits.data_ptr<int32_t>());
  const __m256i lane_bits = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  const __m256 none = _mm256_set1_ps(-INFINITY);
  for (int64_t m = 0; m < M; ++m) {
    float* row = xp + m * V;
    const uint32_t* words = bp + m * W;
    const int64_t whole = V / 32;  // words whose 32 tokens are all in the row
    for (int64_t w = 0; w < whole; ++w) {
      const uint32_t word = words[w];
      if (word == 0xFFFFFFFFu) continue;
      for (int g = 0; g < 4; ++g) {
        const __m256i byte = _mm256_set1_epi32(static_cast<int>((word >> (8 * g)) & 0xFFu));
        const __m256i on = _mm256_cmpeq_epi32(_mm256_and_si256(byte, lane_bits), lane_bits);
        float* at = row + 32 * w + 8 * g;
        _mm256_storeu_ps(at, _mm256_blendv_ps(none, _mm256_loadu_ps(at), _mm256_castsi256_ps(on)));
      }
    }
    for (int64_t t = 32 * whole; t < V; ++t)
      if (!((words[t / 32] >> (t % 32)) & 1u)) row[t] = -INFINITY;
  }
}
