"""Prompt chunks sized by the planner (planner/prefill.py): the smallest chunk that feeds a prompt at its share of
the rate it would get alone, from the prices as steps are timed, within its bounds; the engine's prompts fed in
those chunks and their answers unchanged."""

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
    assert PrefillSizer(busy=64, idle=512).rows(CURVE, 0) == 512


def test_a_busy_chunk_feeds_the_prompt_at_its_share_of_the_rate_alone():
    sizer = PrefillSizer(busy=64, idle=512, overhead=0.2)
    rows = sizer.rows(CURVE, 4)
    plain = CURVE.cost(4)
    assert rows * 0.005 / (plain + rows * 0.005) == pytest.approx(0.8, abs=0.01)
    assert PrefillSizer(busy=64, idle=512, overhead=0.1).rows(CURVE, 4) > rows  # a larger share: larger chunks


def test_chunks_stay_within_their_bounds():
    flat = CostCurve((0.01,) * 16, ((128, 0.0101),))  # a GPU's curve: rows nearly free
    assert PrefillSizer(busy=64, idle=512).rows(flat, 4) == 512
    steep = CostCurve(tuple(0.01 * m for m in range(1, 17)), ((128, 1.28),))  # rows dear beside the decoders'
    assert PrefillSizer(busy=64, idle=512, least=16).rows(steep, 1) == 16


def test_the_prices_follow_timed_steps():
    sizer = PrefillSizer(busy=64, idle=512, overhead=0.2)
    before = sizer.rows(CURVE, 2)
    sizer.observe(0, 0.06)  # the decoders alone
    for _ in range(10):
        sizer.observe(100, 0.06 + 100 * 0.01)  # a prompt row deep in a long prompt: twice the curve's price
    assert sizer.row_seconds(CURVE) == pytest.approx(0.01, rel=0.01)
    after = sizer.rows(CURVE, 2)
    assert after == pytest.approx(0.06 * 0.8 / (0.2 * 0.01), abs=1) and after < before
    sizer.observe(10, 5.0)  # a prompt's last few rows: not a price
    assert sizer.row_seconds(CURVE) == pytest.approx(0.01, rel=0.01)


def test_without_a_curve_the_fixed_chunk_until_steps_are_timed():
    sizer = PrefillSizer(busy=64, idle=512, overhead=0.2)
    assert sizer.rows(None, 3) == 64
    sizer.observe(0, 0.1)
    sizer.observe(64, 0.1 + 64 * 0.003)
    assert sizer.rows(None, 3) == pytest.approx(0.1 * 0.8 / (0.2 * 0.003), abs=1)


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="busy rows"):
        PrefillSizer(busy=600, idle=512)
    with pytest.raises(ValueError, match="share"):
        PrefillSizer(overhead=1.0)


def test_the_engine_feeds_a_prompt_beside_a_decoder_in_the_sizers_chunks():
    """One request decodes while a 300-token prompt waits: its chunks are what the sizer says, and its answer is
    the one it gets alone."""
    model = BigramModel(torch.softmax(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)), -1))
    engine = Engine(model, NoDrafter(), 0)
    engine.planner.prefill = PrefillSizer(busy=16, idle=512, least=16)
    engine.planner.prefill.rows = lambda costs, decode_rows: 16 if decode_rows else 512
    first = engine.add([1, 2, 3], SamplingParams(max_new_tokens=40, ignore_eos=True))
    engine.step()  # its prefill alone; it decodes from now on
    prompt = [(5 * i + 1) % 64 for i in range(300)]
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    second = engine.add(prompt, params)
    chunks, tokens = [], []
    while engine.running:
        fed = second.fed
        for seq, step in engine.step():
            if seq is second:
                tokens += step.tokens
        if second.fed > fed:
            chunks.append(second.fed - fed)
    assert chunks[:3] == [16, 16, 16] and sum(chunks) == 300
    alone = [t for s in Engine(model, NoDrafter(), 0).generate(prompt, params) for t in s.tokens]
    assert tokens == alone
    assert first.finish_reason is not None
