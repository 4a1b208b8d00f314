// Python bindings of the native CPU kernels (one extension module, built on first use).
// pybind11 with the casters of at::Tensor: the bindings need no more of torch (<torch/extension.h> took twice as
// long to compile).
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "huge_pages.h"
#include "kernels.h"
#include "layer_cpu.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_fp32", &linear_fp32, "y = x @ W^T, W float32");
  m.def("linear_bf16", &linear_bf16, "y = x @ W^T, W bfloat16");
  m.def("linear_f16", &linear_f16, "y = x @ W^T, W float16");
  m.def("bf16_tiles_on", &bf16_tiles_on, "whether bfloat16 weights run on AMX tiles here (linear_bf16_tiles)");
  m.def("bf16_tile_peak_flops", &bf16_tile_peak_flops, "FLOP/s of back-to-back bfloat16 tile products on every "
        "thread: the peak a prompt's forward is measured against (0 where no tiles run)",
        py::arg("products") = 4000000);
  m.def("int8_dot_peak_ops", &int8_dot_peak_ops, "operations a second (a multiply and an add each) of back-to-back "
        "int8 dot products on every thread: the peak a prompt's forward on the integer kernels is measured against",
        py::arg("steps") = 20000000);
  m.def("linear_bf16_tiles", &linear_bf16_tiles, "y = x @ W^T + b, W bfloat16 in tile layout, x rounded to "
        "bfloat16, float32 sums; every row as a one-row call computes it");
  m.def("linear_quant", &linear_quant, "y = x @ W^T + b, W in GGUF-style blocks, x quantized per row, integer dots");
  m.def("repack_c16", &repack_c16, "k-quant blocks, row layout -> 16 output channels per vector");
  m.def("linear_c16", &linear_c16, "y = x @ W^T + b, k-quant W with 16 channels per vector");
  m.def("amx_min_rows", &amx_min_rows, "rows from which Q4_K and Q6_K layers run on AMX tile products; 0: never here");
  m.def("set_guided_units", &set_guided_units, "guided (True, the default) or one fixed share per thread (False) "
        "for linear layers' units; the same bits either way, to compare speed");
  m.def("set_team", &set_team, "a decode forward's layers in one parallel region (True, the default) or one region "
        "per group of linear layers (False); the same bits either way, to compare speed");
  m.def("set_read_ahead", &set_read_ahead, "bytes of weights a helper thread reads ahead per stage of a decode "
        "forward's region (-1: half its L2 cache, the default; 0: none); returns the bytes in force");
  m.def("set_huge_pages", [](bool on) { huge_pages_wanted.store(on); },
        "weights repacked from now on in 2 MB pages (on) or 4 KB ones (the same bits; to compare speed)");
  m.def("set_amx", &set_amx, "AMX on or off for this process (to compare speed: the same bits in the linear layers, "
        "not in attention over a bfloat16 cache, whose tiles round queries and weights to bfloat16)");
  m.def("set_bf16_dots", &set_bf16_dots, "attention over a bfloat16 cache in AVX-512 BF16 dot products where the "
        "CPU has them and AMX does not run (True, the default) or on the float path (False: other bits, to compare)");
  m.def("repack_c16_legacy", &repack_c16_legacy, "32-weight blocks, row layout -> 16 output channels per vector");
  m.def("linear_c16_legacy", &linear_c16_legacy, "y = x @ W^T + b, 32-weight-block W with 16 channels per vector");
  m.def("argmax_rows", &argmax_rows, "each row's largest value's index, the first on ties; -1 for a row with a NaN");
  m.def("top1_probs", &top1_probs, "(each row's argmax, its softmax probability, False where a row holds a NaN)");
  m.def("topk_probs", &topk_probs, "(each row's k largest values' indices, largest first, their softmax "
        "probabilities, False where a row holds a NaN or fewer than k values above -inf)");
  m.def("topk_lists", &topk_lists, "topk_probs' answer as rows of lists (indices, probabilities, whether every row "
        "has them)");
  m.def("nucleus_probs", &nucleus_probs, "softmax(logits / temperature) over each row's top-p nucleus, zero "
        "elsewhere; an empty tensor where a row holds a NaN or only -inf");
  m.def("draw_rows", &draw_rows, "one token a row of non-negative weights by inverse CDF in index order at u * total; "
        "-1 for a row of zeros");
  m.def("mask_disallowed", &mask_disallowed, "logits -inf where a grammar's token bitmask has no bit (in place)");
  m.def("move_slots", &move_slots, "KV cache slots from[i] -> to[i] in every layer and head, in order (k, v "
        "[layers, batch, heads, slots, head_dim], contiguous on the CPU)");
  m.def("embedding_rows", &embedding_rows, "rows `tokens` of a weight in blocks.py's row layout, de-quantized to "
        "float32 as PackedWeight.dequantize computes them");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension, float32, batch-invariant");
  m.def("silu_mul_", &silu_mul_, "g = silu(g) * u in place, float32, each value by one fixed sequence of operations");
  m.def("rope_store", &rope_store, "rotary q and k, k and v into the cache, q as [B, H, T, D]");
  m.def("decode_attention", &decode_attention, "per-row attention over a prefix then extra slots, batch-invariant",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("spans"),
        py::arg("extras") = std::vector<std::vector<int64_t>>());

  m.def("set_layer_profiling", &set_layer_profiling, "reset, then time each stage of the native layers (or stop)");
  m.def("layer_profile", &layer_profile, "[(stage, seconds)] summed since profiling began; first ('calls', n)");
  m.def("read_seconds", &read_seconds, "seconds to read a float32 tensor once with the thread team");
  m.def("parallel_region_seconds", &parallel_region_seconds, "seconds of one empty fork-join of the thread team",
        py::arg("repeats") = 1000);

  py::class_<LinearOp>(m, "LinearOp", "a linear layer on one of the kernels (kind: 0 c16, 1 c16 legacy, 2 rows, "
                                      "3 float32, 4 bfloat16, 5 bfloat16 tiles, 6 float16)")
      .def(py::init<int64_t, std::vector<at::Tensor>, at::Tensor, std::vector<int64_t>>(), py::arg("kind"),
           py::arg("tensors"), py::arg("bias"), py::arg("ints"))
      .def("__call__", &LinearOp::operator())
      .def("with_argmax", &LinearOp::with_argmax,
           "(y, each row's argmax: the first index of its largest value; empty where a row holds a NaN)");
  m.def("run_linears", &run_linears, "linear layers reading one input, in one parallel region (layer_cpu.h)",
        py::arg("x"), py::arg("ops"));
  py::class_<DecodeRows>(m, "DecodeRows", "the segments of a decode forward (layer_cpu.h)")
      .def(py::init<std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>, std::vector<std::vector<int64_t>>,
                    std::vector<std::vector<std::vector<int64_t>>>, std::vector<at::Tensor>,
                    std::vector<at::Tensor>>(),
           py::arg("begin"), py::arg("end"), py::arg("start"), py::arg("spans"), py::arg("extras"), py::arg("k"),
           py::arg("v"));
  py::class_<DecoderLayer>(m, "DecoderLayer", "a decoder layer's weights and shape, for DecoderStack (layer_cpu.h)")
      .def(py::init<int64_t, int64_t, int64_t, int64_t, double, at::Tensor, at::Tensor, at::Tensor,
                    at::Tensor, LinearOp, LinearOp, LinearOp, LinearOp, LinearOp, LinearOp, LinearOp>(),
           py::arg("index"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("eps"),
           py::arg("input_norm"), py::arg("post_norm"), py::arg("q_norm"), py::arg("k_norm"), py::arg("q"),
           py::arg("k"), py::arg("v"), py::arg("o"), py::arg("gate"), py::arg("up"), py::arg("down"));
  py::class_<TokenEmbedding>(m, "TokenEmbedding", "a token embedding for DecoderStack.forward_ids (kind: 0 blocks, "
                                                  "1 float32 rows; layer_cpu.h)")
      .def(py::init<int64_t, std::vector<at::Tensor>, std::vector<int64_t>>(), py::arg("kind"), py::arg("tensors"),
           py::arg("ints"))
      .def("rows", &TokenEmbedding::rows);
  py::class_<DecoderStack>(m, "DecoderStack", "every decoder layer and the final norm: a decode forward in one call "
                                              "(layer_cpu.h)")
      .def(py::init<std::vector<DecoderLayer>, at::Tensor, double>(), py::arg("layers"), py::arg("norm"),
           py::arg("eps"))
      .def("forward", &DecoderStack::forward, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("rows"),
           py::arg("features"))
      .def("forward_ids", &DecoderStack::forward_ids, py::arg("ids"), py::arg("positions"), py::arg("embed"),
           py::arg("cos_table"), py::arg("sin_table"), py::arg("rows"), py::arg("features"))
      .def("forward_id_lists", &DecoderStack::forward_id_lists, py::arg("ids"), py::arg("positions"),
           py::arg("embed"), py::arg("cos_table"), py::arg("sin_table"), py::arg("rows"), py::arg("features"));
}
