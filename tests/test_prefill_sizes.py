"""Prompt chunks sized by the planner (planner/prefill.py): the step's time capped, the cap growing with the wait,
the row price learned from timed steps, and the engine's prompts fed in those chunks."""

import pytest
import torch
from toy import BigramModel

from specdecode.config import SamplingParams
from specdecode.drafters.none import NoDrafter
from specdecode.engine.engine import Engine
from specdecode.planner.budget import CostCurve
from specdecode.planner.prefill import PrefillSizer

# 50 ms a one-row forward, 5 ms a row past the first few (a 2-core CPU's shape, rounded)
CURVE = CostCurve(tuple(0.05 + 0.005 * (m - 1) for m in range(1, 17)), ((32, 0.205), (64, 0.365), (128, 0.685)))


def test_nobody_decoding_feeds_the_idle_chunk():
    assert PrefillSizer(busy=64, idle=512).rows(CURVE, 0, 0.0) == 512


def test_a_busy_step_fills_its_time_cap_from_the_curve():
    sizer = PrefillSizer(busy=64, idle=512, step_s=1.0, wait_share=0.1)
    rows = sizer.rows(CURVE, 4, 0.0)
    assert CURVE.cost(4) + rows * 0.005 == pytest.approx(1.0, abs=0.006)  # ~190 rows: the step lasts ~1 s


def test_the_cap_grows_with_the_oldest_prompts_wait_and_stays_in_its_bounds():
    sizer = PrefillSizer(busy=64, idle=512, step_s=1.0, wait_share=0.1)
    assert sizer.rows(CURVE, 4, 0.0) < sizer.rows(CURVE, 4, 20.0) < 512
    assert sizer.rows(CURVE, 4, 1000.0) == 512
    slow = CostCurve((1.0,) * 16, ((128, 5.0),))  # a step of the decoders alone over the cap: the fixed chunk
    assert sizer.rows(slow, 4, 0.0) == 64


def test_the_row_price_follows_timed_steps():
    sizer = PrefillSizer(busy=64, idle=512, step_s=1.0, wait_share=0.0)
    before = sizer.rows(CURVE, 2, 0.0)
    sizer.observe(0, 0.06)  # the decoders alone
    for _ in range(10):
        sizer.observe(100, 0.06 + 100 * 0.01)  # a prompt row deep in a long prompt: twice the curve's price
    assert sizer.row_seconds(CURVE) == pytest.approx(0.01, rel=0.01)
    after = sizer.rows(CURVE, 2, 0.0)
    assert after == pytest.approx((1.0 - 0.06) / 0.01, abs=1) and after < before
    sizer.observe(10, 5.0)  # a prompt's last few rows: not a price
    assert sizer.row_seconds(CURVE) == pytest.approx(0.01, rel=0.01)


def test_without_a_curve_the_fixed_chunk_until_steps_are_timed():
    sizer = PrefillSizer(busy=64, idle=512, step_s=1.0, wait_share=0.0)
    assert sizer.rows(None, 3, 0.0) == 64
    sizer.observe(0, 0.1)
    sizer.observe(64, 0.1 + 64 * 0.003)
    assert sizer.rows(None, 3, 0.0) == pytest.approx((1.0 - 0.1) / 0.003, abs=1)


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="busy rows"):
        PrefillSizer(busy=600, idle=512)


def test_the_engine_feeds_a_prompt_beside_a_decoder_in_the_sizers_chunks():
    """One request decodes while a 300-token prompt waits: its chunks are what the sizer says, and its answer is
    the one it gets alone."""
    model = BigramModel(torch.softmax(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)), -1))
    engine = Engine(model, NoDrafter(), 0)
    engine.planner.prefill = PrefillSizer(busy=16, idle=512, step_s=0.0, wait_share=0.0)
    first = engine.add([1, 2, 3], SamplingParams(max_new_tokens=40, ignore_eos=True))
    engine.step()  # its prefill alone; it decodes from now on
    prompt = [(5 * i + 1) % 64 for i in range(300)]
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    second = engine.add(prompt, params)
    chunks, tokens = [], []
    while second in engine.running or second.prefilling:
        fed = second.fed
        for seq, step in engine.step():
            if seq is second:
                tokens += step.tokens
        if second.fed > fed:
            chunks.append(second.fed - fed)
        if not engine.running:
            break
    assert chunks[:3] == [16, 16, 16] and sum(chunks) == 300
    alone = [t for s in Engine(model, NoDrafter(), 0).generate(prompt, params) for t in s.tokens]
    assert tokens == alone
    assert first.finish_reason is not None or first in engine.running
