// A decoder layer's decode step in one call: see layer_cpu.h. Each step below is the call model.py's Python path
// makes, in the same order.
#include "layer_cpu.h"

#include <ATen/ATen.h>

#include "kernels.h"

torch::Tensor LinearOp::operator()(const torch::Tensor& x) const {
  const auto& w = tensors;
  switch (kind) {
    case kC16: return linear_c16(x, w[0], w[1], w[2], w[3], w[4], w[5], bias, ints[0], ints[1]);
    case kC16Legacy: return linear_c16_legacy(x, w[0], w[1], w[2], w[3], bias, ints[0], ints[1]);
    case kQuant: return linear_quant(x, w[0], w[1], w[2], w[3], w[4], w[5], bias, ints[0], ints[1], ints[2]);
    case kFp32:
    case kBf16: {  // the float kernels take no bias: added after, as KernelLinear does
      auto y = kind == kFp32 ? linear_fp32(x, w[0]) : linear_bf16(x, w[0]);
      return bias.defined() && bias.numel() ? y + bias : y;
    }
  }
  TORCH_CHECK(false, "unknown linear kind ", kind);
}

torch::Tensor DecoderLayer::forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                                    const DecodeRows& rows) const {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(), "x must be [T, d] float32");
  const int64_t T = x.size(0), H = heads, Hkv = kv_heads, D = head_dim;
  const auto h = rms_norm(x, input_norm, eps);
  auto qx = q(h).view({1, T, H, D}), kx = k(h).view({1, T, Hkv, D});
  const auto vx = v(h).view({1, T, Hkv, D});
  if (q_norm.defined() && q_norm.numel()) qx = rms_norm(qx, q_norm, eps), kx = rms_norm(kx, k_norm, eps);
  std::vector<torch::Tensor> parts;
  for (size_t s = 0; s < rows.begin.size(); ++s) {
    const int64_t b = rows.begin[s], e = rows.end[s];
    auto k_cache = rows.k[s].select(0, index), v_cache = rows.v[s].select(0, index);
    const bool all = b == 0 && e == T;  // the common case slices nothing
    const auto qs = all ? qx : qx.slice(1, b, e), ks = all ? kx : kx.slice(1, b, e);
    const auto vs = all ? vx : vx.slice(1, b, e);
    const auto cs = (all ? cos : cos.slice(0, b, e)).view({1, e - b, D});
    const auto ss = (all ? sin : sin.slice(0, b, e)).view({1, e - b, D});
    const auto rotated = rope_store_at(qs, ks, vs, cs, ss, k_cache, v_cache, rows.start[s]);
    parts.push_back(decode_attention(rotated, k_cache, v_cache, rows.spans[s], rows.extras[s]));
  }
  const auto attn = parts.size() == 1 ? parts[0] : at::cat(parts, 2);  // [1, H, T, D]
  const auto out = x + o(attn.transpose(1, 2).reshape({T, H * D}));
  const auto h2 = rms_norm(out, post_norm, eps);
  return out + down(at::silu(gate(h2)) * up(h2));
}
