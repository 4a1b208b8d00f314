"""The native CPU linear kernel and the weight formats on it: right numbers, rows independent of the batch, and
speculation exact relative to the target as run (bf16, int8 and int4 weights)."""

import pytest
import torch

from specdecode.config import SamplingParams
from specdecode.drafters import DraftModelDrafter, NgramDrafter, NoDrafter
from specdecode.engine import Engine
from specdecode.kernels import cpu_kernels
from specdecode.masks import chain_mask
from specdecode.quantize import KernelLinear, pack_int4, quantize_
from tiny import tiny_native

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the native CPU kernel needs AVX2, FMA and a C++ compiler")


def decoded_weight(layer: KernelLinear) -> torch.Tensor:
    """The float32 weights the kernel multiplies by, rebuilt in Python: the reference."""
    if layer.format in ("fp32", "bf16"):
        return layer.weight.float()
    if layer.format == "int8":
        return layer.weight_q.float() * layer.scales[:, None]
    low, high = layer.weight_q & 15, layer.weight_q >> 4  # [out, in / 2]
    out_features = low.shape[0]
    q = torch.cat((low.view(out_features, -1, 16), high.view(out_features, -1, 16)), -1).float()  # [out, groups, 32]
    return (q * layer.scales[..., None] + layer.mins[..., None]).view(out_features, -1)


@pytest.mark.parametrize("mode, dtype, tol", [
    ("none", torch.float32, 1e-5), ("none", torch.bfloat16, 1e-2), ("int8", torch.bfloat16, 0.02),
    ("int4", torch.float32, 0.15),
])  # fmt: skip
def test_kernel_matches_its_weights_and_the_float_layer(mode, dtype, tol):
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 70, bias=True).to(dtype)  # 70 rows: a ragged last block of weight rows
    layer = KernelLinear(linear, mode, kernels)
    x = torch.randn(5, 96)
    out = layer(x.to(dtype)).float()
    exact = x.to(dtype).float() @ decoded_weight(layer).T + linear.bias.float()
    assert torch.allclose(out, exact, atol=1e-4 if dtype == torch.float32 else 0.05, rtol=1e-4)
    ref = linear(x.to(dtype)).float()
    assert (out - ref).abs().max() / ref.abs().max() < tol


def test_int4_packing_round_trips_a_grid():
    torch.manual_seed(0)
    q = torch.randint(0, 16, (8, 64)).float()
    q[:, ::32], q[:, 1::32] = 0, 15  # every group spans the whole grid, so min-max recovers it exactly
    scale = torch.rand(8, 2) + 0.1
    w = q * scale.repeat_interleave(32, dim=1) - 0.5
    packed, scales, mins = pack_int4(w)
    layer = KernelLinear(torch.nn.Linear(64, 8, bias=False), "int4", kernels)
    layer.weight_q, layer.scales, layer.mins = packed, scales, mins
    assert torch.allclose(decoded_weight(layer), w, atol=1e-5)


@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
def test_every_row_is_computed_as_if_alone(mode):
    """Batch invariance, bit for bit: the property that makes a verify forward equal one-token forwards."""
    torch.manual_seed(0)
    layer = KernelLinear(torch.nn.Linear(256, 38, bias=False), mode, kernels)
    x = torch.randn(13, 256)
    for rows in (2, 3, 5, 7, 13):
        batch = layer(x[:rows])
        for j in range(rows):
            assert torch.equal(batch[j], layer(x[j : j + 1])[0])


@pytest.mark.parametrize("mode, dtype", [("none", torch.float32), ("none", torch.bfloat16), ("int4", torch.bfloat16)])
def test_decode_forward_rows_equal_one_token_forwards(mode, dtype):
    model = quantize_(tiny_native("qwen2", seed=0, dtype=dtype), mode)
    tokens = torch.tensor([[5, 9, 2, 7, 1, 3, 3, 8, 4, 6]])
    prefix, new = 4, 6
    with torch.inference_mode():
        cache = model.new_cache(1, 32)
        model(tokens[:, :prefix], torch.arange(prefix)[None], cache, chain_mask(0, prefix))
        cache.truncate(prefix)
        batch, _ = model(tokens[:, prefix:], torch.arange(prefix, prefix + new)[None], cache,
                         chain_mask(prefix, new), decode=True)
        for j in range(new):
            cache.truncate(prefix + j)
            pos = prefix + j
            one, _ = model(tokens[:, pos : pos + 1], torch.tensor([[pos]]), cache, chain_mask(pos, 1), decode=True)
            assert torch.equal(batch[0, j], one[0, 0]), f"row {j} differs"


@pytest.mark.parametrize("mode", ["none", "int8", "int4"])
def test_speculation_is_exact_for_the_target_as_run(mode):
    target = quantize_(tiny_native("qwen2", seed=0, dtype=torch.bfloat16), mode)
    draft = quantize_(tiny_native("qwen2", seed=1, dtype=torch.bfloat16), mode)
    assert not any(isinstance(m, torch.nn.Linear) for m in target.modules())
    prompt, params = [1, 2, 3, 4, 1, 2], SamplingParams(max_new_tokens=24)
    plain = [t for s in Engine(target, NoDrafter()).generate(prompt, params) for t in s.tokens]
    self_draft = Engine(target, DraftModelDrafter(target, vocab_size=64), num_draft_tokens=3)
    assert [t for s in self_draft.generate(prompt, params) for t in s.tokens] == plain
    for drafter in (NgramDrafter(), DraftModelDrafter(draft, vocab_size=64)):
        engine = Engine(target, drafter, num_draft_tokens=3)
        assert [t for s in engine.generate(prompt, params) for t in s.tokens] == plain


def test_unknown_mode_is_refused():
    with pytest.raises(Exception, match="unknown quantization"):
        quantize_(tiny_native("qwen2"), "int3")
