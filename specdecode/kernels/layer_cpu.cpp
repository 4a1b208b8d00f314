// A decoder layer's decode step in one call: see layer_cpu.h. Each step below is the call model.py's Python path
// makes, in the same order.
#include "layer_cpu.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <unistd.h>
#include <immintrin.h>

#include "kernels.h"
#include "simd.h"

namespace {

// Wall time of each stage of DecoderLayer::forward, summed over the calls made while profiling is on
// (scripts/profile_step.py). Off, a stage boundary costs one relaxed load.
constexpr const char* kStageNames[] = {"input norm", "q k v", "rotary + cache", "attention", "o", "post norm",
                                       "gate up", "silu mul", "down", "residual"};
constexpr int kStages = sizeof(kStageNames) / sizeof(kStageNames[0]);
std::atomic<bool> profiling{false};
double stage_seconds[kStages] = {};
int64_t profiled_calls = 0;

using Clock = std::chrono::steady_clock;

struct Laps {
  bool on = profiling.load(std::memory_order_relaxed);
  Clock::time_point last = on ? Clock::now() : Clock::time_point{};
  void mark(int stage) {
    if (!on) return;
    const auto now = Clock::now();
    stage_seconds[stage] += std::chrono::duration<double>(now - last).count();
    last = now;
  }
};

}  // namespace

std::atomic<bool> guided_units{true};

void set_guided_units(bool on) { guided_units.store(on); }

// The whole decode forward in one team region (on by default; set_team, from SPECDECODE_TEAM=0 through settings.py: a parallel region
// per group of linear layers instead, to compare the two in one process).
std::atomic<bool> team_forward{true};
std::atomic<int64_t> read_ahead{-1};  // set_read_ahead: -1, half the L2 cache

namespace {

// How much a helper reads ahead per stage: half its L2 cache (1 MB where the system does not say) unless set.
int64_t ahead_bytes() {
  static const int64_t half_l2 = [] {
    const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
    return l2 > 0 ? static_cast<int64_t>(l2) / 2 : int64_t{1} << 20;
  }();
  const int64_t set = read_ahead.load(std::memory_order_relaxed);
  return set >= 0 ? set : half_l2;
}

}  // namespace

void set_team(bool on) { team_forward.store(on); }

int64_t set_read_ahead(int64_t bytes) {
  read_ahead.store(bytes);
  return ahead_bytes();
}

void set_layer_profiling(bool on) {
  std::fill(stage_seconds, stage_seconds + kStages, 0.0);
  profiled_calls = 0;
  profiling.store(on);
}

std::vector<std::pair<std::string, double>> layer_profile() {
  std::vector<std::pair<std::string, double>> out{{"calls", static_cast<double>(profiled_calls)}};
  for (int i = 0; i < kStages; ++i) out.emplace_back(kStageNames[i], stage_seconds[i]);
  return out;
}

// Seconds to read `x` (float32) once with the thread team, as the kernels stream weights: each thread a
// contiguous share, sixteen floats a step in eight independent sums. The machine's read bandwidth, measured the
// way a forward reads (a stock sum over the same bytes ran 20-40% slower in some spells).
double read_seconds(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.numel() % 64 == 0,
              "x: contiguous float32, a multiple of 64 values");
  const float* p = x.data_ptr<float>();
  const int64_t blocks = x.numel() / 64;
  std::atomic<int64_t> sink{0};
  const auto begin = Clock::now();
  at::parallel_for(0, blocks, 1024, [&](int64_t first, int64_t last) {
    __m256 acc[8];
    for (auto& a : acc) a = _mm256_setzero_ps();
    for (int64_t b = first; b < last; ++b)
      for (int i = 0; i < 8; ++i) acc[i] = _mm256_add_ps(acc[i], _mm256_loadu_ps(p + b * 64 + 8 * i));
    for (int i = 1; i < 8; ++i) acc[0] = _mm256_add_ps(acc[0], acc[i]);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[0]);
    sink += static_cast<int64_t>(lanes[0] != 0.f);  // keeps the loads
  });
  return std::chrono::duration<double>(Clock::now() - begin).count();
}

// Seconds one empty fork-join of the thread team costs (at::parallel_for over one item per thread): what each
// parallel region of a forward pays before any work, measured the way the kernels start theirs.
double parallel_region_seconds(int64_t repeats) {
  const int64_t threads = at::get_num_threads();
  volatile int64_t sink = 0;
  const auto begin = Clock::now();
  for (int64_t r = 0; r < repeats; ++r)
    at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) { sink = sink + last - first; });
  return std::chrono::duration<double>(Clock::now() - begin).count() / static_cast<double>(repeats);
}

at::Tensor LinearOp::operator()(const at::Tensor& x) const {
  const auto& w = tensors;
  switch (kind) {
    case kC16:
    case kC16Legacy:
    case kBf16Tiles: {
      QuantizedActs acts;
      return run_alone(work(x, acts));
    }
    case kQuant: return linear_quant(x, w[0], w[1], w[2], w[3], w[4], w[5], bias, ints[0], ints[1], ints[2]);
    case kFp32:
    case kBf16:
    case kF16: {  // the float kernels take no bias: added after, as KernelLinear does
      auto y = kind == kFp32 ? linear_fp32(x, w[0]) : kind == kBf16 ? linear_bf16(x, w[0]) : linear_f16(x, w[0]);
      return bias.defined() && bias.numel() ? y.add(bias) : y;  // y + bias, without ATen's operator header
    }
  }
  TORCH_CHECK(false, "unknown linear kind ", kind);
}

std::vector<at::Tensor> LinearOp::with_argmax(const at::Tensor& x) const {
  if (!has_units()) {
    const auto y = (*this)(x).contiguous();
    auto index = argmax_rows(y);
    const int64_t* ip = index.data_ptr<int64_t>();
    const bool nan = std::any_of(ip, ip + index.numel(), [](int64_t i) { return i < 0; });
    return {y, nan ? at::empty({0}, index.options()) : index};
  }
  QuantizedActs acts;
  return run_with_argmax(work(x, acts));
}

LinearWork LinearOp::work(const at::Tensor& x, QuantizedActs& acts) const {
  const auto& w = tensors;
  if (kind == kC16) return linear_c16_work(x, w[0], w[1], w[2], w[3], w[4], w[5], bias, ints[0], ints[1], acts);
  if (kind == kC16Legacy) return linear_c16_legacy_work(x, w[0], w[1], w[2], w[3], bias, ints[0], ints[1], acts);
  if (kind == kBf16Tiles) return linear_bf16_tiles_work(x, w[0], bias, acts);
  LinearWork whole;
  whole.done = [this, x] { return (*this)(x); };
  return whole;
}

int64_t LinearOp::unit_bytes() const {
  int64_t bytes = 0;
  for (const auto& t : tensors)
    if (t.numel() && t.size(0) == units()) bytes += t.nbytes() / units();
  return bytes;
}

void LinearOp::prefetch_unit(int64_t u) const {
  // The repacked weights keep each unit's values together in every tensor: rows of dimension 0.
  for (const auto& t : tensors) {
    if (!t.numel() || t.size(0) != units()) continue;
    const int64_t bytes = t.nbytes() / units();
    const char* p = static_cast<const char*>(t.data_ptr()) + u * bytes;
    for (int64_t at = 0; at < bytes; at += 64) _mm_prefetch(p + at, _MM_HINT_T1);
  }
}

namespace {

// y += r over rows [0, M) and channels [c0, c1) of [M, N]: the residual add, one float add per value (the sum the
// Python loop's x + y rounds to).
void add_rows(float* y, const float* r, int64_t M, int64_t N, int64_t c0, int64_t c1) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = c0; c < c1; c += 8)
      _mm256_storeu_ps(y + m * N + c, _mm256_add_ps(_mm256_loadu_ps(y + m * N + c), _mm256_loadu_ps(r + m * N + c)));
}

// Works read by one parallel stage: units [first, last) of their concatenation, each work its share.
struct Works {
  std::vector<LinearWork> works;
  std::vector<int64_t> first_unit{0};
  void add(LinearWork work) {
    first_unit.push_back(first_unit.back() + work.units);
    works.push_back(std::move(work));
  }
  void run(int64_t first, int64_t last) const {
    for (size_t i = 0; i < works.size(); ++i) {
      const int64_t begin = std::max(first, first_unit[i]), end = std::min(last, first_unit[i + 1]);
      if (begin < end) works[i].run(begin - first_unit[i], end - first_unit[i]);
    }
  }
};


// q, k, v as the projections gave them [T, *] -> each segment's keys and values rotated into its cache, and the
// works of attention over every segment (their query rows rotated into `rotated`, which must outlive them).
Works attention_works(const DecoderLayer& l, const at::Tensor& q_out, const at::Tensor& k_out,
                      const at::Tensor& v_out, const at::Tensor& cos, const at::Tensor& sin,
                      const DecodeRows& rows, std::vector<at::Tensor>& rotated) {
  const int64_t T = q_out.size(0), H = l.heads, Hkv = l.kv_heads, D = l.head_dim;
  auto qx = q_out.view({1, T, H, D}), kx = k_out.view({1, T, Hkv, D});
  const auto vx = v_out.view({1, T, Hkv, D});
  if (l.q_norm.defined() && l.q_norm.numel()) qx = rms_norm(qx, l.q_norm, l.eps), kx = rms_norm(kx, l.k_norm, l.eps);
  Works attention;
  for (size_t s = 0; s < rows.begin.size(); ++s) {
    const int64_t b = rows.begin[s], e = rows.end[s];
    auto k_cache = rows.k[s].select(0, l.index), v_cache = rows.v[s].select(0, l.index);
    const bool all = b == 0 && e == T;  // the common case slices nothing
    const auto qs = all ? qx : qx.slice(1, b, e), ks = all ? kx : kx.slice(1, b, e);
    const auto vs = all ? vx : vx.slice(1, b, e);
    const auto cs = (all ? cos : cos.slice(0, b, e)).view({1, e - b, D});
    const auto ss = (all ? sin : sin.slice(0, b, e)).view({1, e - b, D});
    rotated.push_back(rope_store_at(qs, ks, vs, cs, ss, k_cache, v_cache, rows.start[s]));
    attention.add(decode_attention_work(rotated.back(), k_cache, v_cache, rows.spans[s], rows.extras[s]));
  }
  return attention;
}

// The attention works' outputs, once run -> the o projection's input [T, H * D]: a view of a lone sequence's
// output (the kernel writes each row's heads side by side), one concatenation of a batch's.
at::Tensor attention_output(const Works& attention, int64_t T, int64_t width) {
  std::vector<at::Tensor> parts;
  for (const auto& work : attention.works) parts.push_back(work.done().transpose(1, 2));  // [1, T, H, D] each
  const auto attn = parts.size() == 1 ? parts[0] : at::cat(parts, 1);
  return attn.reshape({T, width});
}

}  // namespace

std::vector<at::Tensor> run_linears(const at::Tensor& x, const std::vector<const LinearOp*>& ops) {
  QuantizedActs acts;  // held until every unit has run: the works point into it
  Works works;
  for (const LinearOp* op : ops) works.add(op->work(x, acts));
  run_units(works.first_unit.back(), [&](int64_t first, int64_t last) { works.run(first, last); });
  std::vector<at::Tensor> out;
  for (const auto& work : works.works) out.push_back(work.done());
  return out;
}

at::Tensor DecoderLayer::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                 const DecodeRows& rows) const {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [T, d] float32");
  const int64_t T = x.size(0);
  Laps laps;
  const auto h = rms_norm(x, input_norm, eps);
  laps.mark(0);
  const auto qkv = run_linears(h, {&q, &k, &v});
  laps.mark(1);
  std::vector<at::Tensor> rotated;
  const Works attention = attention_works(*this, qkv[0], qkv[1], qkv[2], cos, sin, rows, rotated);
  laps.mark(2);
  run_units(attention.first_unit.back(), [&](int64_t first, int64_t last) { attention.run(first, last); });
  laps.mark(3);
  auto projected = o(attention_output(attention, T, heads * head_dim));
  laps.mark(4);
  // In place, the same bits (a sum does not depend on the order of its operands). A prompt's 512 rows made
  // intermediates of several MB each, and freeing and allocating them again page-faulted ~200,000 times per
  // prompt of the 1.5B target; in place, 0-40,000.
  const auto out = projected.add_(x);
  laps.mark(9);
  const auto h2 = rms_norm(out, post_norm, eps);
  laps.mark(5);
  const auto gate_up = run_linears(h2, {&gate, &up});
  auto g = gate_up[0];
  const auto& u = gate_up[1];
  laps.mark(6);
  const auto act = silu_mul_(g, u);
  laps.mark(7);
  auto mlp = down(act);
  laps.mark(8);
  auto result = mlp.add_(out);
  laps.mark(9);
  if (laps.on) ++profiled_calls;
  return result;
}


bool DecoderLayer::in_team() const {
  for (const LinearOp* op : {&q, &k, &v, &o, &gate, &up, &down})
    if (!op->has_units()) return false;
  return gate.units() == up.units() && o.units() == down.units();  // SiLU unit by unit; one residual width
}

std::vector<StagePlan> DecoderLayer::plan() const {
  auto weights = [](std::vector<const LinearOp*> ops) {
    StagePlan plan;
    std::vector<int64_t> first{0};
    for (const LinearOp* op : ops) first.push_back(first.back() + op->units()), plan.unit_bytes += op->unit_bytes();
    plan.units = first.back();
    plan.unit_bytes = (plan.unit_bytes + static_cast<int64_t>(ops.size()) - 1) / static_cast<int64_t>(ops.size());
    plan.prefetch = [ops, first](int64_t u) {
      for (size_t i = 0; i < ops.size(); ++i)
        if (u < first[i + 1]) return ops[i]->prefetch_unit(u - first[i]);
    };
    return plan;
  };
  StagePlan gate_up;  // unit u: gate's and up's channels 16 u .. 16 u + 15, then SiLU over them
  gate_up.units = gate.units();
  gate_up.unit_bytes = gate.unit_bytes() + up.unit_bytes();
  gate_up.prefetch = [this](int64_t u) { gate.prefetch_unit(u), up.prefetch_unit(u); };
  return {weights({&q, &k, &v}), StagePlan{}, weights({&o}), gate_up, weights({&down})};
}

at::Tensor DecoderLayer::forward_in(Team& team, int64_t stage, const at::Tensor& x, const at::Tensor& cos,
                                    const at::Tensor& sin, const DecodeRows& rows) const {
  Laps laps;
  const auto h = rms_norm(x, input_norm, eps);
  laps.mark(0);
  QuantizedActs acts;
  Works qkv;
  for (const LinearOp* op : {&q, &k, &v}) qkv.add(op->work(h, acts));
  team.compute(stage, [&](int64_t first, int64_t last) { qkv.run(first, last); });
  laps.mark(1);
  std::vector<at::Tensor> rotated;
  const Works attention =
      attention_works(*this, qkv.works[0].done(), qkv.works[1].done(), qkv.works[2].done(), cos, sin, rows, rotated);
  laps.mark(2);
  team.compute(stage + 1, [&](int64_t first, int64_t last) { attention.run(first, last); });
  laps.mark(3);
  QuantizedActs acts_o;
  const LinearWork wo = o.work(attention_output(attention, x.size(0), heads * head_dim), acts_o);
  const float* residual = x.data_ptr<float>();
  team.compute(stage + 2, [&](int64_t first, int64_t last) {  // + x right after each unit: the residual stream
    wo.run(first, last);
    add_rows(wo.y, residual, wo.rows, wo.cols, 16 * first, 16 * last);
  });
  const auto out = wo.done();
  laps.mark(4);
  const auto h2 = rms_norm(out, post_norm, eps);
  laps.mark(5);
  QuantizedActs acts_mlp;
  const LinearWork wg = gate.work(h2, acts_mlp), wu = up.work(h2, acts_mlp);
  team.compute(stage + 3, [&](int64_t first, int64_t last) {  // a unit of gate and of up, then SiLU over it
    wg.run(first, last);
    wu.run(first, last);
    silu_mul_rows(wg.y, wu.y, wg.rows, wg.cols, 16 * first, 16 * last);
  });
  const auto act = wg.done();
  laps.mark(6);
  QuantizedActs acts_down;
  const LinearWork wd = down.work(act, acts_down);
  const float* stream = out.data_ptr<float>();
  team.compute(stage + 4, [&](int64_t first, int64_t last) {
    wd.run(first, last);
    add_rows(wd.y, stream, wd.rows, wd.cols, 16 * first, 16 * last);
  });
  laps.mark(8);
  if (laps.on) ++profiled_calls;
  return wd.done();
}

namespace {
// Rows idx [T] of a float32 table [P, d] (a copy, as index_select's), each index checked against P.
at::Tensor gather_rows(const at::Tensor& table, const at::Tensor& idx, const char* what) {
  TORCH_CHECK(table.dim() == 2 && table.scalar_type() == at::kFloat && table.is_contiguous() && table.is_cpu(), what,
              ": a contiguous float32 table [P, d] on the CPU");
  TORCH_CHECK(idx.dim() == 1 && idx.scalar_type() == at::kLong && idx.is_contiguous() && idx.is_cpu(), what,
              ": int64 indices [T] on the CPU");
  const int64_t n = idx.size(0), rows = table.size(0), d = table.size(1);
  const int64_t* at_row = idx.data_ptr<int64_t>();
  auto out = at::empty({n, d}, table.options());
  const float* from = table.data_ptr<float>();
  float* to = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(at_row[i] >= 0 && at_row[i] < rows, what, ": index ", at_row[i], " outside [0, ", rows, ")");
    std::memcpy(to + i * d, from + at_row[i] * d, d * sizeof(float));
  }
  return out;
}
}  // namespace

// Rows of a bfloat16 or float16 table widened to float32: exact, as torch's lookup then .float() gives them.
static at::Tensor widened_rows(const at::Tensor& table, const at::Tensor& idx) {
  const bool bf16 = table.scalar_type() == at::kBFloat16;
  TORCH_CHECK(table.dim() == 2 && (bf16 || table.scalar_type() == at::kHalf) && table.is_contiguous() &&
                  table.is_cpu() && table.size(1) % 8 == 0,
              "token ids: a contiguous bfloat16 or float16 table [P, d] on the CPU, d a multiple of 8");
  TORCH_CHECK(idx.dim() == 1 && idx.scalar_type() == at::kLong && idx.is_contiguous(), "token ids: int64 [T]");
  const int64_t n = idx.size(0), rows = table.size(0), d = table.size(1);
  const int64_t* at_row = idx.data_ptr<int64_t>();
  auto out = at::empty({n, d}, table.options().dtype(at::kFloat));
  const auto* from = reinterpret_cast<const uint16_t*>(table.data_ptr());
  float* to = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(at_row[i] >= 0 && at_row[i] < rows, "token ids: index ", at_row[i], " outside [0, ", rows, ")");
    const uint16_t* row = from + at_row[i] * d;
    for (int64_t c = 0; c < d; c += 8) {
      const __m128i half = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c));
      _mm256_storeu_ps(to + i * d + c, bf16 ? specdecode::load_bf16x8(row + c) : _mm256_cvtph_ps(half));
    }
  }
  return out;
}

at::Tensor TokenEmbedding::rows(const at::Tensor& ids) const {
  TORCH_CHECK((kind == kFloat && tensors.size() == 1) || (kind == kBlocks && tensors.size() == 6 && ints.size() == 5),
              "TokenEmbedding: kind 0 takes 6 tensors and 5 integers, kind 1 one tensor (got kind ", kind, ")");
  TORCH_CHECK(ids.is_cpu(), "token ids must be on the CPU");
  if (kind == kFloat && tensors[0].scalar_type() != at::kFloat) return widened_rows(tensors[0], ids);
  if (kind == kFloat) return gather_rows(tensors[0], ids, "token ids");  // what torch's embedding lookup copies
  return embedding_rows(ids, tensors[0], tensors[1], tensors[2], tensors[3], tensors[4], tensors[5], ints[0], ints[1],
                        ints[2], ints[3] != 0, ints[4] != 0);
}

at::Tensor DecoderStack::forward_ids(const at::Tensor& ids, const at::Tensor& positions, const TokenEmbedding& embed,
                                     const at::Tensor& cos_table, const at::Tensor& sin_table, const DecodeRows& rows,
                                     const std::vector<int64_t>& features) const {
  TORCH_CHECK(ids.dim() == 1 && positions.dim() == 1 && ids.size(0) == positions.size(0),
              "ids and positions must be [T] each");
  const auto pos = positions.to(at::kLong).contiguous();  // no copy where they are int64 already
  return forward(embed.rows(ids.to(at::kLong).contiguous()), gather_rows(cos_table, pos, "positions"),
                 gather_rows(sin_table, pos, "positions"), rows, features);
}

at::Tensor DecoderStack::forward_id_lists(const std::vector<int64_t>& ids, const std::vector<int64_t>& positions,
                                          const TokenEmbedding& embed, const at::Tensor& cos_table,
                                          const at::Tensor& sin_table, const DecodeRows& rows,
                                          const std::vector<int64_t>& features) const {
  auto as_tensor = [](const std::vector<int64_t>& values) {
    auto out = at::empty({static_cast<int64_t>(values.size())}, at::TensorOptions().dtype(at::kLong));
    std::memcpy(out.data_ptr<int64_t>(), values.data(), values.size() * sizeof(int64_t));
    return out;
  };
  return forward_ids(as_tensor(ids), as_tensor(positions), embed, cos_table, sin_table, rows, features);
}

at::Tensor DecoderStack::forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                                 const DecodeRows& rows, const std::vector<int64_t>& features) const {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(), "x must be [T, d] float32");
  std::vector<at::Tensor> captured;
  auto h = x;
  if (planned_for != this) {  // once per model: whether every layer can run in the team, and its stages' plans
    all_in_team = std::all_of(layers.begin(), layers.end(), [](const DecoderLayer& l) { return l.in_team(); });
    plans.clear();
    for (const auto& layer : layers)
      for (auto& plan : layer.plan()) plans.push_back(std::move(plan));
    planned_for = this;
  }
  if (!all_in_team || !team_forward.load()) {
    for (size_t i = 0; i < layers.size(); ++i) {
      if (std::find(features.begin(), features.end(), static_cast<int64_t>(i)) != features.end()) captured.push_back(h);
      h = layers[i].forward(h, cos, sin, rows);
    }
  } else {
    int64_t attention = 0;
    for (size_t s = 0; s < rows.begin.size(); ++s)
      attention += decode_attention_units(rows.end[s] - rows.begin[s], layers[0].kv_heads);
    std::vector<TeamStage> stages(plans.size());
    for (size_t i = 0; i < plans.size(); ++i) {
      stages[i].units = i % DecoderLayer::kStages == 1 ? attention : plans[i].units;
      stages[i].unit_bytes = plans[i].unit_bytes;
      stages[i].prefetch = plans[i].prefetch ? &plans[i].prefetch : nullptr;
    }
    Team team(stages, ahead_bytes());
    team.run([&] {
      for (size_t i = 0; i < layers.size(); ++i) {
        if (std::find(features.begin(), features.end(), static_cast<int64_t>(i)) != features.end())
          captured.push_back(h);
        h = layers[i].forward_in(team, static_cast<int64_t>(i) * DecoderLayer::kStages, h, cos, sin, rows);
      }
    });
  }
  auto out = rms_norm(h, norm, eps);
  if (captured.empty()) return out;
  captured.insert(captured.begin(), out);
  return at::cat(captured, -1);
}
