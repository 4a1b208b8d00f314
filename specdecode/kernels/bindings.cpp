// Python bindings of the native CPU kernels (one extension module, built on first use).
#include <torch/extension.h>

#include <vector>

torch::Tensor linear_fp32(const torch::Tensor& x, const torch::Tensor& weight);
torch::Tensor linear_bf16(const torch::Tensor& x, const torch::Tensor& weight);
torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& qweight, const torch::Tensor& scales);
torch::Tensor linear_int4(const torch::Tensor& x, const torch::Tensor& packed, const torch::Tensor& scales,
                          const torch::Tensor& mins);
torch::Tensor decode_attention(const torch::Tensor& q, const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                               std::vector<int64_t> spans);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_fp32", &linear_fp32, "y = x @ W^T, W float32");
  m.def("linear_bf16", &linear_bf16, "y = x @ W^T, W bfloat16");
  m.def("linear_int8", &linear_int8, "y = x @ (q * scale)^T, per output row scales");
  m.def("linear_int4", &linear_int4, "y = x @ (q * scale + min)^T, groups of 32");
  m.def("decode_attention", &decode_attention, "per-row prefix attention, batch-invariant");
}
