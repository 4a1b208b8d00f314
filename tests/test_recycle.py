"""Token recycling: the table it keeps of the target's top guesses, the trees it grows from it, and the engine's
guarantees with it (greedy identity alone and in a batch, the target's exact distribution)."""

import pytest
import torch
from tiny import tiny_native
from toy import DRAFTER_PROMPTS, BigramModel, assert_exact_distribution, exact_sequence_probs, random_chain, tokens_of

from specdecode.config import SamplingParams
from specdecode.drafters import NoDrafter
from specdecode.drafters.base import DraftContext
from specdecode.drafters.draft import TargetSaw
from specdecode.drafters.recycle import RecycleDrafter
from specdecode.engine.engine import Engine
from specdecode.kernels import cpu_kernels
from specdecode.planner.budget import CostCurve
from specdecode.weights.quantize import quantize_

CPU_LIKE = CostCurve(tuple(1.0 + 0.08 * m for m in range(16)))
PROMPTS = DRAFTER_PROMPTS


pytestmark = pytest.mark.usefixtures("costs_as_given")


def test_a_tree_grows_best_first_from_the_targets_recorded_guesses():
    drafter = RecycleDrafter(vocab_size=10, width=2)
    drafter.hear(TargetSaw(torch.tensor([1, 2, 3]), torch.tensor([[2, 5] + [0] * 6, [3, 6] + [0] * 6,
                                                                  [4, 7] + [0] * 6])))
    draft = drafter.propose(DraftContext([9, 1], SamplingParams(), None), max_tokens=4)
    draft.check()
    # best first by the product of the prior rates along the path: 2 (0.3), 1's runner-up 5 (0.1), 3 (0.09),
    # 2's runner-up 6 (0.03) before 3's child 4 (0.027)
    assert draft.tokens.tolist() == [2, 5, 3, 6] and draft.parents.tolist() == [-1, -1, 0, 0]
    assert draft.scores == sorted(draft.scores, reverse=True)
    before = drafter.hits[0] / drafter.tried[0]
    drafter.commit([0, 2], verified=[0, 1, 2, 3])  # 2 and 3 accepted, 5 and 6 rejected
    assert drafter.hits[0] / drafter.tried[0] > before
    assert drafter.propose(DraftContext([9, 8], SamplingParams(), None), 4).tokens.numel() == 0  # 8: never seen
    assert drafter.fork().table is drafter.table  # requests of one engine share what the target said


@pytest.mark.parametrize("width", [1, 8])
@pytest.mark.parametrize("auto", [False, True])
def test_greedy_is_token_identical_alone(width, auto):
    target = tiny_native("qwen2", seed=0)
    params = SamplingParams(max_new_tokens=40)
    engine = Engine(target, RecycleDrafter(64, width=width), None if auto else 4, costs=CPU_LIKE if auto else None)
    for prompt in PROMPTS:
        plain = tokens_of(Engine(target, NoDrafter()), prompt, params)
        assert tokens_of(engine, prompt, params) == plain  # the table warms across the requests
    assert engine.last.stats.drafted_tokens > 0


@pytest.mark.skipif(cpu_kernels() is None, reason="row-exact batching needs the native CPU kernel")
def test_greedy_is_token_identical_in_a_batch():
    from test_batch import run_batch

    target = quantize_(tiny_native("qwen2", seed=0, hidden_size=256, intermediate_size=512), "q8_0")
    requests = [(prompt, SamplingParams(max_new_tokens=24)) for prompt in PROMPTS]
    engine = Engine(target, RecycleDrafter(64), None, costs=CPU_LIKE)
    together = run_batch(engine, requests, arrivals=[0, 1, 1, 3])
    for (prompt, params), out in zip(requests, together):
        assert out == tokens_of(Engine(target, NoDrafter()), prompt, params)


@pytest.mark.parametrize("auto,in_flight", [(False, 1), (True, 4)])  # a fixed size alone, the planner's in a batch
def test_output_distribution_is_the_targets(auto, in_flight):
    """A Markov-chain target: the table fills with its top guesses (right and wrong ones), trees of point masses
    are verified; alone and with other requests in the same forwards; chi-by-L1 bound."""
    from test_batch import run_batch

    vocab, eos, trials, length = 4, 3, 6000 // in_flight, 3
    target_chain = random_chain(vocab, 10)
    params = SamplingParams(temperature=1.0, max_new_tokens=length)
    exact = exact_sequence_probs(target_chain, start=0, length=length, eos=eos)
    engine = Engine(BigramModel(target_chain, eos=(eos,)), RecycleDrafter(vocab, width=2), None if auto else 3,
                    costs=CostCurve((1.0, 1.1, 1.2, 1.3)) if auto else None)
    counts: dict[tuple, int] = {}
    for i in range(trials):
        requests = [([0], SamplingParams(**{**params.__dict__, "seed": in_flight * i + j})) for j in range(in_flight)]
        for out in run_batch(engine, requests, arrivals=list(range(in_flight))):
            counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    assert (engine.drafter.table.next[:eos] >= 0).all()  # every token's row was recorded and drafted from
    assert_exact_distribution(counts, exact)
