// A decoder layer's decode step in one native call. A one-token forward of the 1.5B target runs ~15 small framework
// operations per layer around its kernels: in Python that glue cost ~0.13 ms a layer, a tenth of the whole step.
// Here the same kernels and the same ATen operations run in the same order, so the result is bit for bit what
// model.py's Python path computes (which still runs prefill, CUDA, bfloat16 and layers this cannot take).
#pragma once
#include "aten_lite.h"

#include <vector>

#include "kernels.h"

#include "team_cpu.h"

// A linear layer on one of the kernels, with what the kernel needs: built by quantize.py's QuantLinear and
// KernelLinear (their `op`).
struct LinearOp {
  enum Kind : int64_t { kC16 = 0, kC16Legacy = 1, kQuant = 2, kFp32 = 3, kBf16 = 4, kBf16Tiles = 5, kF16 = 6 };
  int64_t kind;
  std::vector<at::Tensor> tensors;  // the weight's tensors, in the kernel's argument order
  at::Tensor bias;                  // empty: none
  std::vector<int64_t> ints;           // the kernel's integer arguments (bits, group, ...)

  at::Tensor operator()(const at::Tensor& x) const;
  // {its output, each row's argmax (empty where a row holds a NaN)}: found as the outputs are written on the
  // 16-channel kernels (an LM head's logits for greedy verification), else from the output after
  std::vector<at::Tensor> with_argmax(const at::Tensor& x) const;
  // Its work on x, for a parallel region shared with other layers reading x (the float kernels and the row
  // kernel have no units: their `done` computes the whole output after the region).
  LinearWork work(const at::Tensor& x, QuantizedActs& acts) const;
  // The 16-channel kernels' units, known from the weights alone: how many, their bytes, and unit u's weights
  // fetched into this thread's L2 cache (a thread reading ahead while another does a layer's serial work).
  bool has_units() const { return kind == kC16 || kind == kC16Legacy || kind == kBf16Tiles; }
  int64_t units() const { return has_units() ? tensors[0].size(0) : 0; }
  int64_t unit_bytes() const;
  void prefetch_unit(int64_t u) const;
};

// Linear layers that read the same input, in one parallel region over all their output channels, the input
// quantized once per format: each output bit-identical to its layer's own call.
std::vector<at::Tensor> run_linears(const at::Tensor& x, const std::vector<const LinearOp*>& ops);

// Which rows of a forward belong to which sequence: rows [begin, end) of segment s write their keys and values to
// cache slots [start, start + end - begin) of caches k[s], v[s] ([layers, 1, Hkv, S, D] float32), and row t of the
// segment attends to slots [0, spans[s][t]) then extras[s][t] (decode_attention's contract).
struct DecodeRows {
  std::vector<int64_t> begin, end, start;
  std::vector<std::vector<int64_t>> spans;
  std::vector<std::vector<std::vector<int64_t>>> extras;
  std::vector<at::Tensor> k, v;
};

struct DecoderLayer {
  int64_t index, heads, kv_heads, head_dim;
  double eps;
  at::Tensor input_norm, post_norm, q_norm, k_norm;  // q_norm, k_norm empty where the model has none
  LinearOp q, k, v, o, gate, up, down;

  // x [T, d] float32, the rows of every segment; cos, sin [T, head_dim] -> the layer's output [T, d]
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const DecodeRows& rows) const;
  // The same, as the lead of a team that runs stages [stage, stage + kStages) of its forward (team_cpu.h): every
  // linear layer on a 16-channel kernel.
  static constexpr int64_t kStages = 5;  // q k v, attention, o, gate up, down
  at::Tensor forward_in(Team& team, int64_t stage, const at::Tensor& x, const at::Tensor& cos,
                        const at::Tensor& sin, const DecodeRows& rows) const;
  // Those stages' units and weights (attention's units depend on the rows: 0 here); they point into this layer.
  std::vector<StagePlan> plan() const;
  bool in_team() const;
};

// A model's token embedding, for a decode forward that starts from token ids: rows of a weight in blocks (as
// embedding_rows reads them) or of a float32 matrix, the same bits as the model's own lookup.
struct TokenEmbedding {
  enum Kind : int64_t { kBlocks = 0, kFloat = 1 };
  int64_t kind;
  std::vector<at::Tensor> tensors;  // kBlocks: qs, qh, scales, mins, d, dmin; kFloat: the weight [vocab, d]
  std::vector<int64_t> ints;        // kBlocks: bits, superblock, group, sub_scales, has_min

  at::Tensor rows(const at::Tensor& ids) const;  // ids [T] int64 -> [T, d] float32
};

// Every decoder layer of a model and its final norm: a decode forward in one call, and where every linear layer
// is on a 16-channel kernel, in one parallel region (team_cpu.h).
struct DecoderStack {
  std::vector<DecoderLayer> layers;
  at::Tensor norm;
  double eps;

  // x [T, d] float32 (the embedded rows) -> the final hidden states [T, d], then the inputs of the layers
  // `features` (an EAGLE head's features) along the last dimension: [T, d * (1 + features)]
  at::Tensor forward(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                     const DecodeRows& rows, const std::vector<int64_t>& features) const;
  // The same from token ids and rotary positions [T] (int64): their rows of `embed` and of the rotary tables
  // cos_table, sin_table [P, head_dim] (P above every position). Three calls from Python fewer a forward, each
  // ~10-35 us on the caches the last forward flushed.
  at::Tensor forward_ids(const at::Tensor& ids, const at::Tensor& positions, const TokenEmbedding& embed,
                         const at::Tensor& cos_table, const at::Tensor& sin_table, const DecodeRows& rows,
                         const std::vector<int64_t>& features) const;
  // The same from lists (a step's parts are made of them: no tensor made in Python between two forwards)
  at::Tensor forward_id_lists(const std::vector<int64_t>& ids, const std::vector<int64_t>& positions,
                              const TokenEmbedding& embed, const at::Tensor& cos_table, const at::Tensor& sin_table,
                              const DecodeRows& rows, const std::vector<int64_t>& features) const;

  // Whether every layer runs in the team, and the layers' stage plans: made on the first forward (and again if
  // this object moved: the plans point into it).
  mutable bool all_in_team = false;
  mutable std::vector<StagePlan> plans;
  mutable const DecoderStack* planned_for = nullptr;
};
