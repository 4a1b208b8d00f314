"""Decode attention: the kernel's per-row prefix attention equals the stock one, and the decode path (kernel or
the per-row fallback) computes every row exactly as a one-token forward."""

import pytest
import torch
import torch.nn.functional as F

from specdecode import model as model_module
from specdecode.kernels import cpu_kernels
from specdecode.masks import chain_mask
from specdecode.quantize import quantize_
from tiny import tiny_native

kernels = cpu_kernels()


@pytest.mark.skipif(kernels is None, reason="the native CPU kernel needs AVX2, FMA and a C++ compiler")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_attention_matches_sdpa(dtype):
    torch.manual_seed(0)
    heads, kv_heads, dim, slots = 6, 2, 16, 40
    q = torch.randn(1, heads, 4, dim)
    k, v = torch.randn(1, kv_heads, slots, dim).to(dtype), torch.randn(1, kv_heads, slots, dim).to(dtype)
    spans = [21, 22, 23, 24]  # a prefix of 20 cached slots, then a chain of 4 new tokens
    out = kernels.decode_attention(q, k, v, spans)
    for t, span in enumerate(spans):
        ref = F.scaled_dot_product_attention(q[:, :, t : t + 1], k[:, :, :span].float(), v[:, :, :span].float(),
                                             enable_gqa=True)
        assert torch.allclose(out[:, :, t : t + 1], ref, atol=1e-5)
    with pytest.raises(RuntimeError, match="span"):
        kernels.decode_attention(q, k, v, [0, 1, 2, 3])


@pytest.mark.parametrize("use_kernel", [True, False])
def test_decode_rows_equal_one_token_forwards(monkeypatch, use_kernel):
    if use_kernel and kernels is None:
        pytest.skip("no native CPU kernel here")
    if not use_kernel:  # the path CUDA and CPUs without AVX2 take: one stock attention call per row
        monkeypatch.setattr(model_module, "cpu_kernels", lambda: None)
    model = tiny_native("llama", seed=3)
    if use_kernel:
        model = quantize_(model, "none")  # linear layers on the kernel too: only there are they batch-invariant
    tokens = torch.tensor([[7, 3, 9, 1, 4, 4, 2, 8]])
    with torch.inference_mode():
        cache = model.new_cache(1, 16)
        model(tokens[:, :3], torch.arange(3)[None], cache, chain_mask(0, 3))
        cache.truncate(3)
        batch, _ = model(tokens[:, 3:], torch.arange(3, 8)[None], cache, chain_mask(3, 5), decode=True)
        for j in range(5):
            cache.truncate(3 + j)
            one, _ = model(tokens[:, 3 + j : 4 + j], torch.tensor([[3 + j]]), cache, chain_mask(3 + j, 1),
                           decode=True)
            if use_kernel:
                assert torch.equal(batch[0, j], one[0, 0])
            else:
                assert torch.allclose(batch[0, j], one[0, 0], atol=1e-5)


def test_decode_refuses_tree_masks():
    model = tiny_native("qwen2")
    mask = torch.tensor([[[[True, True, False], [True, False, True]]]])  # row 1 skips slot 1: not a prefix
    with torch.inference_mode(), pytest.raises(NotImplementedError, match="chain"):
        model(torch.tensor([[1, 2]]), torch.tensor([[1, 1]]), model.new_cache(1, 8), mask, decode=True)
