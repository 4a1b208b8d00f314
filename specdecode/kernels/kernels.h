// Declarations of the native CPU kernels, for the bindings and for the decoder layer that calls them in C++.
#pragma once
#include "aten_lite.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <functional>
#include <map>
#include <string>
#include <tuple>
#include <vector>

// A linear layer's work, prepared (input quantized, output allocated): `run(first, last)` computes its units
// (groups of 16 output channels) [first, last), from any thread, in any order; `done()` then returns the output.
// Several layers that read one input run as one parallel region over all their units (layer_cpu.cpp), so a
// decoder layer starts its thread team once for q, k and v and once for gate and up.
struct LinearWork {
  int64_t units = 0;
  std::function<void(int64_t, int64_t)> run;
  std::function<at::Tensor()> done;
  // Where unit u writes (the 16-channel kernels): y[m * cols + 16 u + i] for rows m < rows, so that a decoder
  // layer can finish a unit's outputs (the residual add, SiLU) right after the thread computing it wrote them.
  // Null where the work has no units.
  float* y = nullptr;
  int64_t rows = 0, cols = 0;
};

// An input's activations as the integer kernels read them, by block format (the group size): quantized once for
// all the layers of a group.
struct QuantizedActs {
  std::map<int64_t, std::vector<at::Tensor>> by_format;
};

// How run_units shares a linear layer's units among the thread team: guided (true, the default) or one fixed share
// per thread (false: set_guided_units, from SPECDECODE_GUIDED_UNITS=0 through settings.py, to compare the two).
extern std::atomic<bool> guided_units;
void set_guided_units(bool on);
void set_team(bool on);  // a decode forward in one parallel region (layer_cpu.cpp, DecoderStack), on by default
// Bytes of weights a helper thread reads ahead per stage of that region (-1: half its L2 cache, the default; 0:
// none). Returns the bytes now in force.
int64_t set_read_ahead(int64_t bytes);

// The next guided chunk of `left` units for a team of `threads`: half of what is left divided among the threads.
inline int64_t guided_chunk(int64_t left, int64_t threads) { return std::max<int64_t>(1, left / (2 * threads)); }

// Units [0, units) run as `run(first, last)` over the thread team. Guided: each thread takes the next chunk
// (guided_chunk) until none is left: large contiguous shares first, small ones at the end, so a thread that
// starts late or is slowed by the memory takes fewer units instead of the other one waiting for it at the join.
// A unit's outputs do not depend on which thread computes them: the same bits.
template <typename Run>
void run_units(int64_t units, Run&& run) {
  const int64_t threads = at::get_num_threads();
  if (threads <= 1 || units <= 1 || at::in_parallel_region()) {
    if (units > 0) run(0, units);
    return;
  }
  if (!guided_units.load(std::memory_order_relaxed)) {
    at::parallel_for(0, units, 1, [&](int64_t first, int64_t last) { run(first, last); });
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    int64_t first = next.load(std::memory_order_relaxed);
    while (first < units) {
      const int64_t size = guided_chunk(units - first, threads);
      if (next.compare_exchange_weak(first, first + size, std::memory_order_relaxed)) {
        run(first, std::min(units, first + size));
        first = next.load(std::memory_order_relaxed);
      }
    }
  });
}

inline at::Tensor run_alone(const LinearWork& work) {
  run_units(work.units, [&](int64_t first, int64_t last) { work.run(first, last); });
  return work.done();
}

// Channel groups [first, last) of the 16-channel kernels for all M rows of y [M, N]: `tile(cg, m0, rows)` computes
// rows [m0, m0 + rows), at most `max_rows` at a time; then the bias, one float add per output (the rounding of
// adding it after the product).
template <typename Tile>
inline void run_channel_groups(int64_t first, int64_t last, int64_t M, int64_t N, int64_t max_rows, float* y,
                               const float* bias, Tile&& tile) {
  for (int64_t cg = first; cg < last; ++cg) {
    for (int64_t m = 0; m < M; m += max_rows) tile(cg, m, std::min<int64_t>(max_rows, M - m));
    if (bias == nullptr) continue;
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = cg * 16; c < cg * 16 + 16; ++c) y[m * N + c] += bias[c];
  }
}

at::Tensor linear_fp32(const at::Tensor& x, const at::Tensor& weight);
at::Tensor linear_bf16(const at::Tensor& x, const at::Tensor& weight);
at::Tensor linear_f16(const at::Tensor& x, const at::Tensor& weight);
// bfloat16 weights in AMX tile layout (linear_bf16_tiles_cpu.cpp): whether they run here, and a layer's work in
// units of 16 output channels.
bool bf16_tiles_on();
LinearWork linear_bf16_tiles_work(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& bias,
                                  QuantizedActs& acts);
at::Tensor linear_bf16_tiles(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& bias);
double bf16_tile_peak_flops(int64_t products);  // this machine's bfloat16 tile peak, FLOP/s (0: no tiles here)
double int8_dot_peak_ops(int64_t steps);  // this machine's int8 dot-product peak, operations a second
at::Tensor linear_quant(const at::Tensor& x, const at::Tensor& qs, const at::Tensor& qh,
                        const at::Tensor& scales, const at::Tensor& mins, const at::Tensor& d,
                        const at::Tensor& dmin, const at::Tensor& bias, int64_t bits, int64_t S, int64_t G);
std::vector<at::Tensor> repack_c16(const at::Tensor& qs, const at::Tensor& qh, const at::Tensor& scales,
                                   const at::Tensor& mins, const at::Tensor& d, const at::Tensor& dmin,
                                   int64_t bits, int64_t G);
at::Tensor linear_c16(const at::Tensor& x, const at::Tensor& lo, const at::Tensor& hi,
                      const at::Tensor& sc, const at::Tensor& mn, const at::Tensor& d,
                      const at::Tensor& dmin, const at::Tensor& bias, int64_t bits, int64_t G);
std::vector<at::Tensor> repack_c16_legacy(const at::Tensor& qs, const at::Tensor& qh, const at::Tensor& d,
                                          const at::Tensor& dmin, int64_t bits, bool with_m);
// Rows from which a Q4_K or Q6_K layer's forward runs on AMX tile products (bit-identical rows; a Q4_0 layer's from
// 32), or 0 where it does not: no AMX in this build or this CPU, the system refused the tile state, or SPECDECODE_AMX=0.
int64_t amx_min_rows();
void set_bf16_dots(bool on);  // attention over a bfloat16 cache in AVX-512 BF16 dots where AMX is off (attention_cpu.cpp)
void set_amx(bool on);  // AMX for this process (on by default where it runs); off: the VNNI tile for every row
LinearWork linear_c16_work(const at::Tensor& x, const at::Tensor& lo, const at::Tensor& hi,
                           const at::Tensor& sc, const at::Tensor& mn, const at::Tensor& d,
                           const at::Tensor& dmin, const at::Tensor& bias, int64_t bits, int64_t G,
                           QuantizedActs& acts);
LinearWork linear_c16_legacy_work(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& hi,
                                  const at::Tensor& d, const at::Tensor& dmin, const at::Tensor& bias,
                                  int64_t bits, int64_t offset, QuantizedActs& acts);
at::Tensor linear_c16_legacy(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& hi,
                             const at::Tensor& d, const at::Tensor& dmin, const at::Tensor& bias,
                             int64_t bits, int64_t offset);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// g = silu(g) * u over rows [0, M) and channels [c0, c1) (multiples of 8) of [M, N] float32 arrays: every value by
// one fixed sequence of operations (the MLP of the native layers and of model.py's loop on the CPU both call it).
void silu_mul_rows(float* g, const float* u, int64_t M, int64_t N, int64_t c0, int64_t c1);
at::Tensor silu_mul_(at::Tensor& g, const at::Tensor& u);  // in place on g, returned
// decode_attention's work in units (a KV head and up to eight rows each: decode_attention_units of them), for a parallel region shared with other
// work: spans and extras must outlive it.
int64_t decode_attention_units(int64_t rows, int64_t kv_heads);  // for one sequence's rows
LinearWork decode_attention_work(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                 const std::vector<int64_t>& spans, const std::vector<std::vector<int64_t>>& extras);
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            std::vector<int64_t> spans, std::vector<std::vector<int64_t>> extras);

at::Tensor argmax_rows(const at::Tensor& x);
// A 16-channel linear layer's work run in full -> {its output [M, N], each row's argmax [M] as argmax_rows gives it,
// or [0] where a row holds a NaN}
std::vector<at::Tensor> run_with_argmax(const LinearWork& work);
std::tuple<at::Tensor, at::Tensor, bool> top1_probs(const at::Tensor& x);
std::tuple<at::Tensor, at::Tensor, bool> topk_probs(const at::Tensor& x, int64_t k);
std::tuple<std::vector<std::vector<int64_t>>, std::vector<std::vector<float>>, bool> topk_lists(const at::Tensor& x,
                                                                                               int64_t k);
void mask_disallowed(at::Tensor& logits, const at::Tensor& bits);
void move_slots(const at::Tensor& k, const at::Tensor& v, const std::vector<int64_t>& to,
                const std::vector<int64_t>& from);
at::Tensor embedding_rows(const at::Tensor& tokens, const at::Tensor& qs, const at::Tensor& qh,
                          const at::Tensor& scales, const at::Tensor& mins, const at::Tensor& d,
                          const at::Tensor& dmin, int64_t bits, int64_t superblock, int64_t group,
                          bool sub_scales, bool has_min);
at::Tensor nucleus_probs(const at::Tensor& logits, double temperature, double top_p);
at::Tensor draw_rows(const at::Tensor& weights, const at::Tensor& u);
at::Tensor rope_store(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                      at::Tensor& v_cache, const at::Tensor& slots);
at::Tensor rope_store_at(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                         at::Tensor& v_cache, int64_t start);

// Profiling of the native decoder layer (layer_cpu.cpp): per-stage wall time while on, and the cost of one empty
// parallel region.
void set_layer_profiling(bool on);
std::vector<std::pair<std::string, double>> layer_profile();
double parallel_region_seconds(int64_t repeats);
double read_seconds(const at::Tensor& x);
