"""Predicted Outputs: the prediction is copied where the output follows it and realigned after an edit; the output
is plain decoding's (greedy) or the target's distribution (sampling) whatever the prediction, alone and in a batch;
usage counts the accepted and rejected prediction tokens; bad predictions are refused clearly."""

import pytest
import torch
from test_batch import CPU_LIKE, draft, needs_kernels, target  # noqa: F401 - the tiny models, fixtures there
from toy import BigramModel, assert_exact_distribution, exact_sequence_probs, random_chain

from specdecode.config import SamplingParams
from specdecode.drafters import DraftModelDrafter, HybridDrafter, NgramDrafter, NoDrafter
from specdecode.drafters.base import DraftContext
from specdecode.drafters.prediction import PredictionDrafter
from specdecode.engine.engine import Engine
from specdecode.errors import SpecdecodeError
from specdecode.planner.prices import Record, StepPlan


def proposed(drafter: PredictionDrafter, tokens: list[int], k: int = 4) -> list[int]:
    return drafter.propose(context(tokens), k).tokens.tolist()


def context(tokens: list[int]) -> DraftContext:
    """A step sized by a CPU-like verify cost curve: guesses less likely than an even bet are drafted where they pay."""
    return DraftContext(tokens, SamplingParams(), None, plan=StepPlan(CPU_LIKE))


def test_copies_while_the_output_follows_and_guesses_where_it_comes_back_after_an_edit():
    drafter = PredictionDrafter(NoDrafter(), [10, 11, 12, 13, 14, 15, 16, 17])
    prompt = [1, 2, 3]
    assert proposed(drafter, prompt + [10]) == [11, 12, 13, 14]  # the first token is the prediction's
    drafter.commit([0, 1])  # 11, 12 accepted; the target then said 99 instead of 13: the edit
    # 99 was inserted (13 comes next) or replaced 13 (14 comes next): both guessed, one tree, likelier first
    draft = drafter.propose(context(prompt + [10, 11, 12, 99]), 4)
    tokens, parents = draft.tokens.tolist(), draft.parents.tolist()
    assert [t for t, p in zip(tokens, parents) if p == -1] == [13, 14]
    assert tokens[:3] == [13, 14, 15] and parents[:3] == [-1, 0, 1]
    assert draft.scores[0] > draft.scores[3]  # an insertion is likelier than a replacement
    drafter.commit([0, 1])  # 13, 14 accepted: the insertion is over
    assert proposed(drafter, prompt + [10, 11, 12, 99, 13, 14, 15]) == [16, 17]  # back on it
    drafter.commit([0, 1])
    assert drafter.accepted == 6
    assert proposed(drafter, prompt + [10, 11, 12, 99, 13, 14, 15, 16, 17, 5]) == []  # the prediction is used up


def test_a_long_insertion_makes_its_end_a_worse_guess_each_step():
    drafter = PredictionDrafter(NoDrafter(), [10, 11, 12, 13, 14, 15, 16, 17])
    output = [1, 10, 11]
    proposed(drafter, output)
    drafter.commit([])  # the target said 50, not 12
    kinds = ("resume", "replace")
    best, drafted = [max(drafter.rate(kind) for kind in kinds)], []  # the likeliest guess's rate
    for inserted in range(50, 58):
        output.append(inserted)
        guess = proposed(drafter, output, k=2)
        assert guess[:1] in ([], [12], [13])  # the anchor stays where the output left
        drafted.append(len(guess))
        drafter.commit([])
        best.append(max(drafter.rate(kind) for kind in kinds))
    assert best == sorted(best, reverse=True) and best[-1] < best[0] / 2
    assert drafted[0] == 2  # guessed at once (later only where a verify row is that cheap: the planner decides)
    output.append(12)  # the insertion ended: back on the prediction after its anchor
    assert proposed(drafter, output) == [13, 14, 15, 16]


def test_an_edit_made_once_is_guessed_again_where_its_token_comes_again():
    """A rename: the prediction's 20 became 20, 99. After the first, 99 is guessed after every 20 of the
    prediction, beside the prediction as it stands."""
    drafter = PredictionDrafter(NoDrafter(), [10, 20, 11, 12, 20, 13, 14, 15])
    assert proposed(drafter, [1, 10]) == [20, 11, 12, 20]
    drafter.commit([0])  # 20 accepted, then the target said 99
    assert proposed(drafter, [1, 10, 20, 99])[:1] == [11]  # the insertion is over, likeliest
    drafter.commit([0, 1])  # 11, 12: back on the prediction; the edit was "99 after 20"
    draft = drafter.propose(context([1, 10, 20, 99, 11, 12, 20]), 4)
    tokens, parents = draft.tokens.tolist(), draft.parents.tolist()
    assert tokens[:3] == [99, 13, 14] and parents[:3] == [-1, 0, 1]  # the edit again, then the prediction
    assert 13 in [t for t, p in zip(tokens, parents) if p == -1] or len(tokens) == 4  # the prediction as it stands
    before = drafter.accepted
    drafter.commit([0, 1])  # the edit again (99), then 13
    assert drafter.accepted == before + 1  # 99 is the edit's, not a prediction token
    assert proposed(drafter, [1, 10, 20, 99, 11, 12, 20, 99, 13, 14]) == [15]  # on the prediction after it


def test_on_the_prediction_its_copy_is_not_weighed_against_a_copying_drafters_record():
    """hybrid's n-gram may copy the same function from the prompt, with a record far above plain decoding's: the
    prediction still drafts while the output follows it; off it, the own drafter's record decides."""
    drafter = PredictionDrafter(NgramDrafter(), [10, 11, 12, 13, 14, 15])
    drafter.record = Record(8.0, 1.0)  # 8 tokens a second-long step: far above what the guesses are worth
    assert proposed(drafter, [1, 10]) == [11, 12, 13, 14]
    drafter.commit([0])
    assert drafter.propose(context([1, 10, 11, 99]), 4).tokens.tolist() != [12, 13, 14, 15]  # off it: the n-gram


def test_a_deletion_in_the_output_realigns_on_the_longest_match():
    drafter = PredictionDrafter(NoDrafter(), [5, 6, 7, 8, 9, 20, 21, 22, 23, 24])
    # the output skipped 7, 8, 9 (deleted in the edit) and goes on with 20, 21
    assert proposed(drafter, [1, 5, 6, 20, 21]) == [22, 23, 24]


def run(engine: Engine, requests, arrivals=None) -> tuple[list[list[int]], list]:
    """(prompt, params, prediction) requests to the end; -> each one's tokens and its Sequence."""
    arrivals = arrivals or [0] * len(requests)
    out: dict[int, list[int]] = {}
    seqs: dict[int, object] = {}
    index, done, step = {}, 0, 0
    while done < len(requests):
        for i, (prompt, params, prediction) in enumerate(requests):
            if arrivals[i] == step:
                seq = engine.add(prompt, params, prediction=prediction)
                index[seq], seqs[i] = i, seq
        for seq, outcome in engine.step():
            assert not isinstance(outcome, Exception), outcome
            out.setdefault(index[seq], []).extend(outcome.tokens)
            done += outcome.finish_reason is not None
        step += 1
        assert step < 2000
    return [out[i] for i in range(len(requests))], [seqs[i] for i in range(len(requests))]


def plain(target, prompt, params) -> list[int]:
    return [t for s in Engine(target, NoDrafter()).generate(prompt, params) for t in s.tokens]


@needs_kernels
@pytest.mark.parametrize("method", ["none", "none-curve", "ngram", "hybrid"])
def test_greedy_output_is_plain_decodings_whatever_the_prediction(target, draft, method):
    """A right prediction, an edited one (tokens changed, inserted, dropped) and a wrong one, in one batch and
    alone, under a drafter that never drafts (copies of a fixed size, or sized by a cost curve), a copying one and
    hybrid: plain decoding's tokens every time, and a right prediction makes most tokens free."""
    make = {"none": NoDrafter, "none-curve": NoDrafter, "ngram": NgramDrafter,
            "hybrid": lambda: HybridDrafter(DraftModelDrafter(draft, vocab_size=64))}[method]
    k, costs = {"none": (0, None), "none-curve": (0, CPU_LIKE)}.get(method, (None, CPU_LIKE))
    params = SamplingParams(max_new_tokens=40)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    expected = plain(target, prompt, params)
    edited = expected[:10] + [63, 62] + expected[10:20] + expected[25:]
    wrong = [(t * 7 + 3) % 64 for t in expected]
    requests = [(prompt, params, p) for p in (expected, edited, wrong)]
    together, seqs = run(Engine(target, make(), k, costs=costs), requests, arrivals=[0, 1, 3])
    assert together == [expected] * 3
    assert all(seq.auto == (costs is not None) for seq in seqs)  # never drafting, a prediction is sized by the curve
    right = seqs[0].stats
    assert right.prediction_tokens == 40 and right.accepted_prediction_tokens >= 30
    assert right.rejected_prediction_tokens == 40 - right.accepted_prediction_tokens
    assert right.target_forwards < 15
    for prompt_, params_, prediction in requests:
        alone, _ = run(Engine(target, make(), k, costs=costs), [(prompt_, params_, prediction)])
        assert alone[0] == expected


@pytest.mark.parametrize("batched,costs", [(False, None), (True, None), (False, CPU_LIKE)])
def test_output_distribution_is_the_targets_with_a_prediction(batched, costs):
    """Sampling with a prediction that is sometimes right: the outputs follow the target's exact distribution
    (chi-by-L1 bound), a request alone and four in a batch; with a cost curve the guesses' trees where the output
    left the prediction are drafted too."""
    vocab, eos, trials, length = 4, 3, 3000, 3
    chain = random_chain(vocab, 10)
    exact = exact_sequence_probs(chain, start=0, length=length, eos=eos)
    engine = Engine(BigramModel(chain, eos=(eos,)), NoDrafter(), 0, costs=costs)
    counts: dict[tuple, int] = {}
    for i in range(trials):
        n = 4 if batched else 1
        requests = [([0], SamplingParams(temperature=1.0, max_new_tokens=length, seed=4 * i + j), [1, 2, 0])
                    for j in range(n)]
        outs, _ = run(engine, requests, arrivals=[0, 0, 1, 2][:n])
        for out in outs:
            counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    assert_exact_distribution(counts, exact)


def test_bad_predictions_are_refused_with_a_clear_error():
    engine = Engine(BigramModel(random_chain(4, 1)), NoDrafter(), 0)
    with pytest.raises(SpecdecodeError, match="prediction is empty"):
        engine.add([0], SamplingParams(max_new_tokens=4), prediction=[])
    with pytest.raises(SpecdecodeError, match="context window leaves 1023 after the prompt: shorten the prediction"):
        engine.add([0], SamplingParams(max_new_tokens=4), prediction=[1] * 1024)
    assert engine.running == []  # nothing was half-added
    seq = engine.add([0], SamplingParams(max_new_tokens=4), prediction=[1] * 50)  # past max_tokens: allowed
    while seq in engine.reserved:
        engine.step()
    assert seq.stats.rejected_prediction_tokens >= 46


def test_usage_without_a_prediction_says_none():
    engine = Engine(BigramModel(random_chain(4, 1)), NoDrafter(), 0)
    seq = engine.add([0], SamplingParams(max_new_tokens=4))
    assert seq.stats.prediction_tokens is None and seq.stats.to_dict()["rejected_prediction_tokens"] == 0
    assert torch.equal(torch.tensor(0), torch.tensor(seq.stats.accepted_prediction_tokens))
