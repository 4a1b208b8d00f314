"""What a long cache adds to a verify forward (planner/context_cost.py): the fitted model, the curve at a context,
the planner drafting less where rows are dear, the in-use curve learning the short-prefix price, and the engine's
output unchanged."""

import json

import pytest
from tiny import tiny_native

from specdecode.config import SamplingParams
from specdecode.drafters import DraftModelDrafter, NgramDrafter, NoDrafter
from specdecode.engine.engine import Engine
from specdecode.kernels import cpu_kernels
from specdecode.planner import budget
from specdecode.planner.budget import CostCurve, load_cached
from specdecode.planner.context_cost import ContextCost, fit, measure_slopes
from specdecode.planner.planner import Planner, Request
from specdecode.planner.prices import best_count
from specdecode.weights.quantize import quantize_

CPU_LIKE = tuple(1.0 + 0.08 * m for m in range(16))
LONG = ContextCost(alpha=1e-4, beta=5e-5, base=128)  # at 8k: one row +0.8 of a forward, each more +0.4


def test_the_fit_recovers_alpha_and_beta_and_never_goes_negative():
    exact = fit({m: 3e-6 + 1e-6 * (m - 1) for m in (1, 2, 4, 8, 16)}, base=128)
    assert exact.alpha == pytest.approx(3e-6) and exact.beta == pytest.approx(1e-6)
    noisy = fit({1: 2e-6, 2: 1e-6, 4: 1.5e-6}, base=128)  # more rows timed cheaper: beta clamps to 0
    assert noisy.beta == 0.0 and noisy.alpha > 0
    assert fit({1: -1e-6, 8: -2e-6}, base=128) == ContextCost(0.0, 0.0, 128)  # a long cache never looks free


def test_the_curve_at_a_context_adds_the_cached_tokens_price():
    curve = CostCurve(CPU_LIKE, tail=((32, 4.0),), context=LONG)
    assert curve.at(100) is curve and CostCurve(CPU_LIKE).at(8000) == CostCurve(CPU_LIKE)
    at = curve.at(8128)
    assert at.cost(1) == pytest.approx(1.0 + 0.8)
    assert at.cost(3) == pytest.approx(1.16 + 0.8 + 2 * 0.4)
    assert at.cost(32) == pytest.approx(4.0 + 0.8 + 31 * 0.4)
    assert curve.at(8128, requests=4).cost(4) == pytest.approx(1.24 + 4 * 0.8)  # each request reads its own cache
    assert LONG.seconds(2, 100) == 0.0


def test_long_context_rows_cut_the_draft_to_what_pays():
    scores = [0.6, 0.4, 0.3, 0.2]
    curve = CostCurve(CPU_LIKE, context=LONG)
    assert best_count(curve, scores) == 4
    assert best_count(curve.at(8128), scores) < 4

    planner = Planner(curve)
    planner.join(1)

    def cut_at(cached: int) -> int:
        record = Request(1, True, True, scores, len(scores), 0.01, False, 0, 0, 100, cached)
        planner.choose([record], 0)
        return planner.cut([record], 0)[1]

    assert cut_at(200) == 4 and cut_at(8128) < 4


def test_the_in_use_curve_learns_the_short_prefix_price():
    planner = Planner(CostCurve(CPU_LIKE, context=LONG))
    for _ in range(6):  # one-row forwards at 8k that cost exactly what the model says
        planner.observe(1, 1.0 + 0.8, parts=[(1, 8128)])
    assert planner.costs.cost(1) == pytest.approx(1.0)
    assert planner.costs.context == LONG


def test_the_context_model_is_saved_and_read_back(tmp_path, monkeypatch):
    monkeypatch.setattr(budget, "measure", lambda target: CostCurve((1.0, 1.1), context=LONG))
    curve = budget.load_or_measure(None, "key", tmp_path)
    assert curve.context == LONG and load_cached("key", tmp_path).context == LONG
    path = budget.curve_path("key", tmp_path)
    saved = json.loads(path.read_text())
    saved["context"] = {"alpha": "nan", "beta": 0.0, "base": 128}  # damaged: the curve stands, without the model
    path.write_text(json.dumps(saved))
    assert load_cached("key", tmp_path).context is None


def test_measured_slopes_of_a_tiny_model_are_finite_and_not_negative():
    target = tiny_native("qwen2", seed=0)
    model = measure_slopes(target, dict.fromkeys((1, 2, 4), 0.0), base=128, repeats=1, long_prefix=256)
    assert model.alpha >= 0.0 and model.beta >= 0.0 and model.base == 128


@pytest.mark.skipif(cpu_kernels() is None, reason="row-exact verify forwards need the native CPU kernel")
@pytest.mark.parametrize("drafter", ["ngram", "draft"])
def test_greedy_output_is_plain_decodings_with_dear_context(drafter):
    """A context model that makes every row dear changes what is drafted, never the tokens."""
    wide = dict(hidden_size=256, intermediate_size=512)
    target, draft = (quantize_(tiny_native("qwen2", seed=s, **wide), "q8_0") for s in (0, 1))
    make = NgramDrafter() if drafter == "ngram" else DraftModelDrafter(draft, vocab_size=64)
    costs = CostCurve(CPU_LIKE, context=ContextCost(alpha=1e-3, beta=1e-3, base=4))
    prompt, params = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3], SamplingParams(max_new_tokens=40)
    got = [t for s in Engine(target, make, None, costs=costs).generate(prompt, params) for t in s.tokens]
    assert got == [t for s in Engine(target, NoDrafter()).generate(prompt, params) for t in s.tokens]
