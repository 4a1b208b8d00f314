// Declarations of the native CPU kernels, for the bindings and for the decoder layer that calls them in C++.
#pragma once
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
torch::Tensor rope_store_at(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                            const torch::Tensor& cos, const torch::Tensor& sin, torch::Tensor& k_cache,
                            torch::Tensor& v_cache, int64_t start);
