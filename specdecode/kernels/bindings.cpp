// Python bindings of the native CPU kernels (one extension module, built on first use).
#include <torch/extension.h>

#include <vector>

torch::Tensor linear_fp32(const torch::Tensor& x, const torch::Tensor& weight);
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& weight);
torch::Tensor linear_quant(const torch::Tensor& x, const torch::Tensor& qs, const torch::Tensor& qh,
                           const torch::Tensor& scales, const torch::Tensor& mins, const torch::Tensor& d,
                           const torch::Tensor& dmin, const torch::Tensor& bias, int64_t bits, int64_t S, int64_t G);
bool c16_available();
std::vector<torch::Tensor> repack_c16(const torch::Tensor& qs, const torch::Tensor& qh, const torch::Tensor& scales,
                                      const torch::Tensor& mins, const torch::Tensor& d, const torch::Tensor& dmin,
                                      int64_t bits, int64_t G);
torch::Tensor linear_c16(const torch::Tensor& x, const torch::Tensor& lo, const torch::Tensor& hi,
                         const torch::Tensor& sc, const torch::Tensor& mn, const torch::Tensor& d,
                         const torch::Tensor& dmin, const torch::Tensor& bias, int64_t bits, int64_t G);
std::vector<torch::Tensor> repack_c16_legacy(const torch::Tensor& qs, const torch::Tensor& qh, const torch::Tensor& d,
                                             const torch::Tensor& dmin, int64_t bits, bool with_m);
torch::Tensor linear_c16_legacy(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& hi,
                                const torch::Tensor& d, const torch::Tensor& dmin, const torch::Tensor& bias,
                                int64_t bits, int64_t offset);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               std::vector<int64_t> spans, std::vector<std::vector<int64_t>> extras);

torch::Tensor rope_store(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                         const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& k_cache,
                         torch::Tensor& v_cache, const torch::Tensor& slots);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_fp32", &linear_fp32, "y = x @ W^T, W float32");
  m.def("linear_bf16", &linear_bf16, "y = x @ W^T, W bfloat16");
  m.def("linear_quant", &linear_quant, "y = x @ W^T + b, W in GGUF-style blocks, x quantized per row, integer dots");
  m.def("c16_available", &c16_available, "whether linear_c16 runs here (AVX-512 VNNI)");
  m.def("repack_c16", &repack_c16, "k-quant blocks, row layout -> 16 output channels per vector");
  m.def("linear_c16", &linear_c16, "y = x @ W^T + b, k-quant W with 16 channels per vector");
  m.def("repack_c16_legacy", &repack_c16_legacy, "32-weight blocks, row layout -> 16 output channels per vector");
  m.def("linear_c16_legacy", &linear_c16_legacy, "y = x @ W^T + b, 32-weight-block W with 16 channels per vector");
  m.def("rms_norm", &rms_norm, "RMSNorm over the last dimension, float32, batch-invariant");
  m.def("rope_store", &rope_store, "rotary q and k, k and v into the cache, q as [B, H, T, D]");
  m.def("decode_attention", &decode_attention, "per-row attention over a prefix then extra slots, batch-invariant",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("spans"),
        py::arg("extras") = std::vector<std::vector<int64_t>>());
}
