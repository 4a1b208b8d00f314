"""Lookahead decoding: the Jacobi window rides as a chain under the root, the n-grams the target endorses on it
fill the pool, and the engine's guarantees hold with it (greedy identity alone and in a batch, the target's
exact distribution)."""

import pytest
import torch
from tiny import tiny_native
from toy import DRAFTER_PROMPTS, BigramModel, assert_exact_distribution, exact_sequence_probs, random_chain, tokens_of

from specdecode.config import SamplingParams
from specdecode.drafters import NoDrafter
from specdecode.drafters.base import DraftContext
from specdecode.drafters.draft import TargetSaw
from specdecode.drafters.lookahead import LookaheadDrafter
from specdecode.engine.engine import Engine
from specdecode.kernels import cpu_kernels
from specdecode.planner.budget import CostCurve
from specdecode.weights.quantize import quantize_

CPU_LIKE = CostCurve(tuple(1.0 + 0.08 * m for m in range(16)))
FLAT = CostCurve(tuple(1.0 + 0.001 * m for m in range(16)))  # extra rows nearly free: the window pays
PROMPTS = DRAFTER_PROMPTS


pytestmark = pytest.mark.usefixtures("costs_as_given")


def test_the_window_is_a_chain_and_the_targets_predictions_become_ngrams_and_the_next_guess():
    drafter = LookaheadDrafter(window=4, ngram=3)
    draft = drafter.propose(DraftContext([10, 11, 12, 13, 14, 5], SamplingParams(), None), max_tokens=8)
    assert draft.tokens.tolist() == [11, 12, 13, 14] and draft.is_chain  # no pool yet: the window alone
    # the target's argmax after the root and after each window row
    drafter.hear(TargetSaw(torch.tensor([5, 11, 12, 13, 14]), torch.tensor([[20], [21], [22], [23], [24]])))
    drafter.commit([], verified=[0, 1, 2, 3])
    assert drafter.guess == [21, 22, 23, 24]  # the next Jacobi guess: what the target predicted
    # endorsed 3-grams: (5, 11, 21), (11, 12, 22), (12, 13, 23), (13, 14, 24): drafted when their key comes up
    again = drafter.propose(DraftContext([1, 12], SamplingParams(), None), max_tokens=8)
    assert again.tokens.tolist()[:2] == [13, 23] and again.parents.tolist()[:2] == [-1, 0]
    assert again.scores[0] > again.scores[2]  # a pool hit ranks above the window's rows (their prior yield)


@pytest.mark.parametrize("costs", [None, FLAT, CPU_LIKE])
def test_greedy_is_token_identical_alone(costs):
    target = tiny_native("qwen2", seed=0)
    params = SamplingParams(max_new_tokens=40)
    engine = Engine(target, LookaheadDrafter(), None if costs else 6, costs=costs)
    for prompt in PROMPTS:
        assert tokens_of(engine, prompt, params) == tokens_of(Engine(target, NoDrafter()), prompt, params)
    if costs is not CPU_LIKE:
        assert engine.last.stats.drafted_tokens > 0


@pytest.mark.skipif(cpu_kernels() is None, reason="row-exact batching needs the native CPU kernel")
def test_greedy_is_token_identical_in_a_batch():
    from test_batch import run_batch

    target = quantize_(tiny_native("qwen2", seed=0, hidden_size=256, intermediate_size=512), "q8_0")
    requests = [(prompt, SamplingParams(max_new_tokens=24)) for prompt in PROMPTS]
    together = run_batch(Engine(target, LookaheadDrafter(), None, costs=FLAT), requests, arrivals=[0, 1, 1, 3])
    for (prompt, params), out in zip(requests, together):
        assert out == tokens_of(Engine(target, NoDrafter()), prompt, params)


@pytest.mark.parametrize("auto,in_flight", [(False, 1), (True, 4)])  # a fixed size alone, the planner's in a batch
def test_output_distribution_is_the_targets(auto, in_flight):
    from test_batch import run_batch

    vocab, eos, trials, length = 4, 3, 6000 // in_flight, 4
    target_chain = random_chain(vocab, 10)
    params = SamplingParams(temperature=1.0, max_new_tokens=length)
    prompt = [0, 1, 2, 0, 1]
    exact = exact_sequence_probs(target_chain, start=prompt[-1], length=length, eos=eos)
    engine = Engine(BigramModel(target_chain, eos=(eos,)), LookaheadDrafter(window=3, ngram=3), None if auto else 4,
                    costs=CostCurve((1.0, 1.01, 1.02, 1.03, 1.04, 1.05)) if auto else None)
    counts: dict[tuple, int] = {}
    for i in range(trials):
        requests = [(prompt, SamplingParams(**{**params.__dict__, "seed": in_flight * i + j})) for j in range(in_flight)]
        for out in run_batch(engine, requests, arrivals=list(range(in_flight))):
            counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    assert_exact_distribution(counts, exact)
