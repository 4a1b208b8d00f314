"""Suffix decoding: the pool of earlier answers (longest matches, bounds, a file kept across runs and refused when
it is not ours), the drafts it makes, and the engine's guarantees with it (greedy identity alone and in a batch,
the target's exact distribution)."""

import numpy as np
import pytest
import torch
from tiny import tiny_native
from toy import DRAFTER_PROMPTS, BigramModel, assert_exact_distribution, exact_sequence_probs, random_chain, tokens_of

from specdecode.config import SamplingParams
from specdecode.drafters import NoDrafter
from specdecode.drafters.base import DraftContext
from specdecode.drafters.draft import Finished
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.drafters.suffix_pool import SuffixPool
from specdecode.engine.engine import Engine
from specdecode.errors import SpecdecodeError
from specdecode.kernels import cpu_kernels
from specdecode.planner.budget import CostCurve
from specdecode.weights.quantize import quantize_

CPU_LIKE = CostCurve(tuple(1.0 + 0.08 * m for m in range(16)))
PROMPTS = DRAFTER_PROMPTS


pytestmark = pytest.mark.usefixtures("costs_as_given")


def test_the_pool_finds_the_longest_match_its_index_merged_per_answer(monkeypatch):
    pool = SuffixPool(max_mb=1)
    pool.add([1, 2, 3, 4, 5])
    pool.add([9, 2, 3, 7, 8])
    positions, length = pool.matches(np.array([1, 2, 3]))
    assert length == 3 and [pool.flat[p] for p in positions] == [4]  # "1 2 3" beats "2 3"
    positions, length = pool.matches(np.array([6, 2, 3]))
    assert length == 2 and sorted(pool.flat[p] for p in positions) == [4, 7]  # both continuations of "2 3"
    monkeypatch.setattr("specdecode.drafters.suffix_pool.MAX_CANDIDATES", 512)
    for i in range(3000):  # 12,000 tokens, each answer merged into the index as it comes
        pool.add([100 + i % 50, 200, 201, 202])
    assert pool.indexed == pool.flat.size
    keys, at = pool.keys.copy(), pool.at.copy()
    pool._rebuild()  # each answer merged in as it came: the index a rebuild sorts from scratch
    assert np.array_equal(keys, pool.keys) and np.array_equal(at, pool.at)
    positions, length = pool.matches(np.array([5, 2, 3]))
    assert length == 2 and sorted(pool.flat[p] for p in positions) == [4, 7]
    assert pool.matches(np.array([149, 200]))[1] == 2


def test_matches_are_the_same_compared_in_python_or_numpy(monkeypatch):
    """A few candidates are compared in Python, many in numpy: the same positions and lengths either way, for the
    pool and for a request's own context (whose candidates come from its bigram index)."""
    import specdecode.drafters.suffix as suffix
    import specdecode.drafters.suffix_pool as suffix_pool

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 6, size=400).tolist()  # a small vocabulary: long and many matches
    pool = SuffixPool(max_mb=1)
    for start in range(0, 300, 60):
        pool.add(tokens[start : start + 60])
    # and a context whose last token occurred more than MAX_CANDIDATES times: only its latest occurrences count
    often = [1, 2] + [3, 2] * 600 + [1, 2]
    cases = [tokens[:end] for end in range(2, 400, 7)] + [often, often[:-1]]
    for context in cases:
        drafter = SuffixDrafter(pool)
        tail = np.asarray(context[-32:])
        found = {}
        for few in (suffix_pool.FEW_CANDIDATES, 0):
            monkeypatch.setattr(suffix_pool, "FEW_CANDIDATES", few)
            monkeypatch.setattr(suffix, "FEW_CANDIDATES", few)
            positions, length = pool.matches(tail)
            own, own_length = drafter._own_matches(context)
            found[few] = (list(positions), length, list(own), own_length)
        assert found[0] == found[suffix_pool.FEW_CANDIDATES]
        # the context's own matches: as every earlier position of its last token, compared in numpy, finds them
        own = np.asarray(context)
        reference, length = suffix_pool.best_matches(own, np.flatnonzero(own[:-1] == own[-1]) + 1, own[-32:])
        if length >= 2:
            assert (found[0][2], found[0][3]) == (reference.tolist(), length)
        else:
            assert found[0][3] < 2


def test_the_pool_stays_within_its_bytes_oldest_leaving_first():
    pool = SuffixPool(max_mb=0.01)  # ~520 tokens
    for i in range(200):
        pool.add([i, i + 1, i + 2])
    assert pool.size <= pool.max_tokens
    assert pool.matches(np.array([0, 1]))[1] == 0 and pool.matches(np.array([199, 200]))[1] == 2


def test_the_pool_file_round_trips_and_bad_files_are_refused(tmp_path):
    path = tmp_path / "pool.npz"
    pool = SuffixPool(1, "tok-a", str(path))
    pool.add([1, 2, 3, 4])
    pool.save()
    assert [a.tolist() for a in SuffixPool(1, "tok-a", str(path)).answers] == [[1, 2, 3, 4]]
    with pytest.raises(SpecdecodeError, match="another tokenizer"):
        SuffixPool(1, "tok-b", str(path))
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(path.read_bytes()[:40])
    with pytest.raises(SpecdecodeError, match="unreadable or truncated"):
        SuffixPool(1, "tok-a", str(truncated))
    (tmp_path / "text.npz").write_text("not a pool")
    with pytest.raises(SpecdecodeError, match="unreadable or truncated"):
        SuffixPool(1, "tok-a", str(tmp_path / "text.npz"))
    for limit in (0, -1, float("inf")):
        with pytest.raises(SpecdecodeError, match="more than 0"):
            SuffixPool(limit)
    assert not list(tmp_path.glob("*.tmp"))  # written by rename: no half-written file left behind


def test_drafts_merge_every_occurrence_of_the_longest_match_by_frequency():
    pool = SuffixPool(1)
    for answer in ([5, 6, 7, 8], [5, 6, 7, 9], [5, 6, 7, 8], [1, 6, 4]):
        pool.add(answer)
    drafter = SuffixDrafter(pool)
    draft = drafter.propose(DraftContext([0, 5, 6], SamplingParams(), None), max_tokens=8)
    assert draft.tokens.tolist()[:1] == [7] and sorted(draft.tokens.tolist()[1:]) == [8, 9]
    eight, nine = draft.tokens.tolist().index(8), draft.tokens.tolist().index(9)
    assert draft.scores[eight] > draft.scores[nine]  # 8 followed twice, 9 once
    chain = SuffixDrafter(pool, branches=1).propose(DraftContext([0, 5, 6], SamplingParams(), None), 8)
    assert chain.is_chain and chain.tokens.tolist()[:1] == [7]
    drafter.hear(Finished([40, 41, 42]))
    assert drafter.fork().pool is pool and pool.matches(np.array([40, 41]))[1] == 2
    # a seeded sampled request drafts from its own context only: its text may not depend on earlier traffic
    seeded = SamplingParams(temperature=1.0, seed=7)
    assert drafter.propose(DraftContext([0, 5, 6], seeded, torch.Generator()), 8).tokens.numel() == 0


@pytest.mark.parametrize("branches", [1, 32])
@pytest.mark.parametrize("auto", [False, True])
def test_greedy_is_token_identical_alone(branches, auto):
    target = tiny_native("qwen2", seed=0)
    params = SamplingParams(max_new_tokens=40)
    engine = Engine(target, SuffixDrafter(SuffixPool(1), branches=branches), None if auto else 4,
                    costs=CPU_LIKE if auto else None)
    for prompt in PROMPTS + PROMPTS:  # the second time round, the pool holds each answer
        assert tokens_of(engine, prompt, params) == tokens_of(Engine(target, NoDrafter()), prompt, params)
    assert engine.last.stats.acceptance_rate > 0.5


@pytest.mark.skipif(cpu_kernels() is None, reason="row-exact batching needs the native CPU kernel")
def test_greedy_is_token_identical_in_a_batch():
    from test_batch import run_batch

    target = quantize_(tiny_native("qwen2", seed=0, hidden_size=256, intermediate_size=512), "q8_0")
    requests = [(prompt, SamplingParams(max_new_tokens=24)) for prompt in PROMPTS + PROMPTS[:2]]
    engine = Engine(target, SuffixDrafter(SuffixPool(1)), None, costs=CPU_LIKE)
    together = run_batch(engine, requests, arrivals=[0, 1, 1, 3, 30, 31])  # the last two after answers joined
    for (prompt, params), out in zip(requests, together):
        assert out == tokens_of(Engine(target, NoDrafter()), prompt, params)


@pytest.mark.parametrize("auto,in_flight", [(False, 1), (True, 4)])  # a fixed size alone, the planner's in a batch
def test_output_distribution_is_the_targets(auto, in_flight):
    """A Markov-chain target whose answers fill the pool: drafts copied from earlier answers (right and wrong),
    alone and with other requests in the same forwards; chi-by-L1 bound."""
    from test_batch import run_batch

    vocab, eos, trials, length = 4, 3, 6000 // in_flight, 4
    target_chain = random_chain(vocab, 10)
    params = SamplingParams(temperature=1.0, max_new_tokens=length)
    prompt = [0, 1, 2, 0, 1]
    exact = exact_sequence_probs(target_chain, start=prompt[-1], length=length, eos=eos)
    pool = SuffixPool(0.01)
    engine = Engine(BigramModel(target_chain, eos=(eos,)), SuffixDrafter(pool), None if auto else 3,
                    costs=CostCurve((1.0, 1.1, 1.2, 1.3)) if auto else None)
    counts: dict[tuple, int] = {}
    for i in range(trials):
        requests = [(prompt, SamplingParams(**{**params.__dict__, "seed": in_flight * i + j})) for j in range(in_flight)]
        for out in run_batch(engine, requests, arrivals=list(range(in_flight))):
            counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    assert len(pool.answers) > 10
    assert_exact_distribution(counts, exact)


def test_copiers_sharing_one_ngram_index_draft_what_each_drafts_with_its_own():
    """hybrid's n-gram (2- and 3-grams) and suffix (its own 1- and 2-grams) copiers read one index of the request:
    step after step, each proposes what it proposes with an index of its own."""
    from specdecode.drafters.ngram import NgramDrafter, share_index

    rng = np.random.default_rng(3)
    tokens = [int(t) for t in rng.integers(0, 6, 40)]
    tokens += tokens[5:20] + [int(t) for t in rng.integers(0, 6, 30)]
    pool = SuffixPool()
    pool.add(tokens[10:40])
    shared = [NgramDrafter(max_ngram=3, min_ngram=2, branches=4), SuffixDrafter(pool)]
    alone = [NgramDrafter(max_ngram=3, min_ngram=2, branches=4), SuffixDrafter(pool)]
    share_index(shared)
    assert shared[0].index is shared[1].index and alone[0].index is not alone[1].index
    drafted = [0, 0]
    for end in range(3, len(tokens)):
        ctx = DraftContext(tokens[:end], SamplingParams(), None)
        for i, (mine, own) in enumerate(zip(shared, alone)):
            a, b = mine.propose(ctx, 8), own.propose(ctx, 8)
            assert (a.token_list, a.parent_list, a.scores) == (b.token_list, b.parent_list, b.scores)
            drafted[i] += len(a) > 0
    assert min(drafted) > 10  # both copied, step after step
