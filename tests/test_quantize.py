"""Weight-only int8/int4: close to the bf16 model, and speculation stays exact relative to the quantized target."""

import pytest
import torch

from specdecode.config import SamplingParams
from specdecode.drafters import DraftModelDrafter, NgramDrafter, NoDrafter
from specdecode.engine import Engine
from specdecode.masks import chain_mask
from specdecode.quantize import Int4Linear, Int8Linear, quantize_
from tiny import tiny_native


@pytest.mark.parametrize("make, tol", [(Int8Linear, 0.02), (Int4Linear, 0.15)])
def test_quantized_linear_is_close(make, tol):
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 48, bias=True).to(torch.bfloat16)
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    ref = linear(x).float()
    err = (make(linear)(x).float() - ref).abs().max() / ref.abs().max()
    assert err < tol


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_speculation_is_exact_for_the_quantized_target(mode):
    target = quantize_(tiny_native("qwen2", seed=0, dtype=torch.bfloat16), mode)
    draft = quantize_(tiny_native("qwen2", seed=1, dtype=torch.bfloat16), mode)
    assert not any(isinstance(m, torch.nn.Linear) for m in target.modules())
    prompt, params = [1, 2, 3, 4, 1, 2], SamplingParams(max_new_tokens=24)
    plain = [t for s in Engine(target, NoDrafter()).generate(prompt, params) for t in s.tokens]
    self_draft = Engine(target, DraftModelDrafter(target, vocab_size=64), num_draft_tokens=3)
    assert [t for s in self_draft.generate(prompt, params) for t in s.tokens] == plain
    for drafter in (NgramDrafter(), DraftModelDrafter(draft, vocab_size=64)):
        engine = Engine(target, drafter, num_draft_tokens=3)
        # Exact here; on other CPUs a bf16 verify forward could round a near-tie differently (see README).
        assert [t for s in engine.generate(prompt, params) for t in s.tokens] == plain
    with torch.inference_mode():
        logits, _ = target(torch.tensor([prompt]), torch.arange(6)[None], target.new_cache(1, 16), chain_mask(0, 6))
    assert torch.isfinite(logits).all()
