"""Continuous batching: a request's output does not depend on what it is batched with (greedy identity, seeded
sampling reproducible), the output distribution is the target's with several requests in flight, drafts shrink
under load, and the KV budget holds."""

import math

import pytest
import torch
from tiny import tiny_native
from toy import BigramModel, Cycling, assert_exact_distribution, exact_sequence_probs, random_chain

from specdecode.config import SamplingParams
from specdecode.drafters import DraftModelDrafter, HybridDrafter, NgramDrafter, NoDrafter
from specdecode.drafters.base import Draft
from specdecode.drafters.draft_model import TREE_EXPAND, TREE_WIDTH
from specdecode.engine.engine import Engine
from specdecode.errors import SpecdecodeError
from specdecode.kernels import cpu_kernels
from specdecode.models.masks import chain_mask
from specdecode.planner.budget import CostCurve
from specdecode.weights.quantize import quantize_

WIDE = dict(hidden_size=256, intermediate_size=512)
CPU_LIKE = CostCurve(tuple(1.0 + 0.08 * m for m in range(16)))

needs_kernels = pytest.mark.skipif(cpu_kernels() is None, reason="row-exact batching needs the native CPU kernel")


@pytest.fixture(scope="module")
def target():
    # Weights in blocks on the CPU kernel: each row is computed as if alone, whatever else is in the forward.
    return quantize_(tiny_native("qwen2", seed=0, **WIDE), "q8_0")


@pytest.fixture(scope="module")
def draft():
    return quantize_(tiny_native("qwen2", seed=1, **WIDE), "q8_0")


def cycle(*makers) -> Cycling:
    """A prototype drafter whose forks are each kind in turn: requests in one batch draft differently."""
    return Cycling(*makers)


def run_batch(engine: Engine, requests, arrivals=None) -> list[list[int]]:
    """Run requests (prompt, params) to the end; request i joins before step arrivals[i]. -> tokens of each."""
    arrivals = arrivals or [0] * len(requests)
    out: dict[int, list[int]] = {}
    index = {}  # sequence -> request number (holding the sequence keeps its identity unique)
    done = 0
    step = 0
    while done < len(requests):
        for i, (prompt, params) in enumerate(requests):
            if arrivals[i] == step:
                index[engine.add(prompt, params)] = i
        for seq, outcome in engine.step():
            assert not isinstance(outcome, Exception), outcome
            out.setdefault(index[seq], []).extend(outcome.tokens)
            if outcome.finish_reason is None:
                assert seq.cache.length == len(seq.tokens) - 1  # the engine's invariant holds in a batch too
            else:
                done += 1
        step += 1
        assert step < 2000
    return [out[i] for i in range(len(requests))]


PROMPTS = [[1, 2, 3, 4, 1, 2, 3], list(range(5, 45)), [7, 7, 7, 7], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9]]


@needs_kernels
@pytest.mark.parametrize(("auto", "kv_dtype"), [(False, None), (True, None), (True, torch.bfloat16)])
def test_greedy_output_is_the_same_batched_or_alone(target, draft, monkeypatch, fixed_prefill, auto, kv_dtype):
    """Four requests with different prompt lengths (one prefilled in chunks while others decode), drafters,
    draft sizes and sampling settings, arriving at different steps: each greedy one equals itself run alone,
    and equals the one-request engine; with the activations' and with a bfloat16 KV cache."""
    fixed_prefill(busy=8)
    monkeypatch.setattr(target, "kv_dtype", kv_dtype)
    assert target.new_cache(1, 4).k.dtype == (kv_dtype or torch.float32)
    costs = CPU_LIKE if auto else None
    k = None if auto else 3
    make = cycle(lambda: DraftModelDrafter(draft, vocab_size=64, width=2), NgramDrafter, NoDrafter,
                 lambda: DraftModelDrafter(draft, vocab_size=64))
    greedy = [SamplingParams(max_new_tokens=n) for n in (30, 25, 18, 33)]
    mixed = list(zip(PROMPTS, greedy))
    mixed[2] = (PROMPTS[2], SamplingParams(max_new_tokens=20, temperature=0.9, seed=5))  # sampled, in the batch
    together = run_batch(Engine(target, make, k, costs=costs), mixed, arrivals=[0, 1, 1, 4])
    for i, (prompt, params) in enumerate(mixed):
        alone = run_batch(Engine(target, make, k, costs=costs), [(prompt, params)])[0]
        assert together[i] == alone, i
        if params.greedy:
            plain = [t for s in Engine(target, NoDrafter()).generate(prompt, params) for t in s.tokens]
            assert together[i] == plain, i


@needs_kernels
@pytest.mark.parametrize("tree", [False, True])
def test_hybrid_drafters_in_a_batch_give_the_plain_output(target, draft, tree):
    """Requests whose drafters switch between copying and the draft model (whose forwards are batched only in
    the steps they draft with it) still give plain decoding's tokens, with chains and with the default tree."""
    shape = {"width": TREE_WIDTH, "expand": TREE_EXPAND} if tree else {}
    make = cycle(lambda: HybridDrafter(DraftModelDrafter(draft, vocab_size=64, **shape)))
    requests = [(prompt, SamplingParams(max_new_tokens=24)) for prompt in PROMPTS]
    together = run_batch(Engine(target, make, None, costs=CPU_LIKE), requests, arrivals=[0, 1, 1, 3])
    for (prompt, params), out in zip(requests, together):
        assert out == [t for s in Engine(target, NoDrafter()).generate(prompt, params) for t in s.tokens]


@needs_kernels
def test_prefill_in_chunks_leaves_the_same_cache(target, fixed_prefill):
    fixed_prefill(idle=7)
    engine = Engine(target, NoDrafter(), 0)
    seq = engine.add(PROMPTS[1], SamplingParams(max_new_tokens=2))
    while seq.prefilling:
        engine.step()
    whole = target.new_cache(1, 64)
    target(torch.tensor([PROMPTS[1]]), torch.arange(40)[None], whole, chain_mask(0, 40), decode=True)
    assert torch.equal(seq.cache.k[:, :, :, :40], whole.k[:, :, :, :40])


@pytest.mark.parametrize("drafter", ["ngram-tree", "draft-model-tree"])
@pytest.mark.parametrize("kv_dtype", [None, torch.bfloat16])
def test_sampled_outputs_with_a_seed_do_not_depend_on_the_batch(target, draft, drafter, kv_dtype, monkeypatch):
    """With a fixed draft size a seeded request's random draws are its own: the same tokens in any company, with
    the activations' and with a bfloat16 cache. (An automatic size adapts to load and timing, so there only the
    distribution is fixed: the server drafts a fixed size for seeded sampled requests.)"""
    monkeypatch.setattr(target, "kv_dtype", kv_dtype)
    params = SamplingParams(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=11)
    requests = [(PROMPTS[0], params), (PROMPTS[3], params), (PROMPTS[1], SamplingParams(max_new_tokens=9))]
    make = NgramDrafter(branches=3) if drafter == "ngram-tree" else DraftModelDrafter(draft, vocab_size=64, width=2)
    first = run_batch(Engine(target, make, 3), requests)
    again = run_batch(Engine(target, make, 3), requests, arrivals=[0, 2, 1])
    alone = run_batch(Engine(target, make, 3), requests[1:2])
    assert first == again and first[1] == alone[0]


@pytest.mark.parametrize("auto", [False, True])
def test_output_distribution_is_the_targets_with_requests_in_flight(auto):
    """A Markov-chain target, draft-model trees and chains and n-gram drafts; four requests in every batch, each
    with its own seed, joining at different steps; chi-by-L1 bound on the first request's outputs."""
    vocab, eos, trials, length = 4, 3, 3000, 3
    target_chain, draft_chain = random_chain(vocab, 10), random_chain(vocab, 11, sharpness=2.0)
    params = SamplingParams(temperature=1.0, max_new_tokens=length)
    exact = exact_sequence_probs(target_chain, start=0, length=length, eos=eos)
    target = BigramModel(target_chain, eos=(eos,))
    draft = BigramModel(draft_chain)
    make = cycle(lambda: DraftModelDrafter(draft, vocab_size=vocab, width=2), lambda: NgramDrafter(max_ngram=2),
                 lambda: DraftModelDrafter(draft, vocab_size=vocab))
    engine = Engine(target, make, None if auto else 3, costs=CostCurve((1.0, 1.5, 2.0)) if auto else None)
    counts: dict[tuple, int] = {}
    for i in range(trials):
        requests = [([0], SamplingParams(**{**params.__dict__, "seed": 4 * i + j})) for j in range(4)]
        outs = run_batch(engine, requests, arrivals=[i % 2, 0, 1, 2])
        for out in outs:
            counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    assert_exact_distribution(counts, exact)


def test_drafting_turns_off_when_the_batch_is_large(target, draft):
    """A draft model whose forward costs as much as a target forward: worth it for one request on a cost
    curve that makes extra rows cheap, not for sixteen requests on a CPU-like slope."""
    flat = CostCurve(tuple(1.0 + 0.001 * m for m in range(16)))
    engine = Engine(target, DraftModelDrafter(draft, vocab_size=64), None, costs=flat)
    seqs = [engine.add(PROMPTS[0], SamplingParams(max_new_tokens=50)) for _ in range(16)]
    planner = engine.planner
    planner.costs = planner.step_costs = CPU_LIKE  # the step's prices too: choose() sets them, not called here
    for seq in seqs:
        seq.fed = seq.stats.prompt_tokens  # pretend prefilled: only the gate is under test
        planner.outlook[id(seq)].draft_s = 0.5  # half a one-token target forward per draft
    records, lag = [seq.record() for seq in seqs], engine.lag_of(seqs)
    assert planner._gate(records, 16, 0, lag) == []
    assert planner._gate(records[:1], 1, 0, lag) == [id(seqs[0])]
    planner.outlook[id(seqs[0])].draft_s = 0.0  # an n-gram drafter costs nothing: always proposes
    assert id(seqs[0]) in planner._gate(records, 16, 0, lag)


def test_kv_budget_bounds_admission_and_refuses_what_never_fits(target):
    engine = Engine(target, NoDrafter(), 0, max_len=256, max_running=4, kv_budget_tokens=200)
    params = SamplingParams(max_new_tokens=50)
    with pytest.raises(SpecdecodeError, match="KV budget is 200"):
        engine.check(list(range(1, 60)), SamplingParams(max_new_tokens=150))
    engine.add([1, 2, 3], params)  # reserves 3 + 50 + 17 = 70
    engine.add([1, 2, 3], params)
    assert not engine.can_admit(3, params)  # 140 + 70 > 200
    assert engine.can_admit(3, SamplingParams(max_new_tokens=30))


def test_a_draft_models_cache_counts_in_the_kv_budget(target, draft):
    """The draft model's cache grows with the context as the target's does: the budget counts both."""
    from specdecode.models.kv_cache import bytes_per_token

    engine = Engine(target, DraftModelDrafter(draft, vocab_size=64), 0, max_len=256, kv_budget_tokens=200)
    share = bytes_per_token(draft) / bytes_per_token(target)
    assert engine.kv_cost(100) == math.ceil(100 * (1 + share)) > 100
    params = SamplingParams(max_new_tokens=50)  # 3 + 50 + 17 = 70 target slots, more with the draft's
    engine.add([1, 2, 3], params)
    assert engine.kv_reserved == engine.kv_cost(70) and not engine.can_admit(3, params)  # 2 x 140 > 200
    with pytest.raises(SpecdecodeError, match="KV budget is 200"):
        engine.check(list(range(1, 60)), SamplingParams(max_new_tokens=50))  # fits the target alone, not both


@needs_kernels
def test_draft_model_forwards_are_batched_across_requests_and_draft_the_same(target, draft, monkeypatch):
    """Four requests' draft models run one forward per depth together; each request's drafts (and so its
    acceptance) equal those it drafts alone."""
    calls: list[int] = []
    batched = draft.forward_parts

    def counting(parts):
        calls.append(len(parts))
        return batched(parts)

    monkeypatch.setattr(draft, "forward_parts", counting)
    make = DraftModelDrafter(draft, vocab_size=64, width=2)
    requests = [(prompt, SamplingParams(max_new_tokens=20)) for prompt in PROMPTS]
    engine = Engine(target, make, 3)
    stats = []
    index = {engine.add(p, params): i for i, (p, params) in enumerate(requests)}
    out: dict[int, list[int]] = {}
    while engine.running:
        for seq, step in engine.step():
            out.setdefault(index[seq], []).extend(step.tokens)
            if step.finish_reason:
                stats.append((index[seq], seq.stats.drafted_tokens, seq.stats.accepted_tokens))
    assert max(calls) == 4  # one draft forward served all four requests
    for i, drafted, accepted in stats:
        alone = Engine(target, make, 3)
        seq = alone.add(*requests[i])
        while alone.running:
            alone.step()
        assert (seq.stats.drafted_tokens, seq.stats.accepted_tokens) == (drafted, accepted), i


class Malformed(NgramDrafter):
    """A drafter whose draft holds a token that is not a token id (`bad`): its shape passes `Draft.check`."""

    def __init__(self, bad=None) -> None:
        super().__init__()
        self.bad = bad

    def fork(self) -> NgramDrafter:
        return Malformed(self.bad)

    def propose(self, ctx, max_tokens):
        return Draft([5, self.bad], [-1, 0], None, [0.9, 0.8])


@pytest.mark.parametrize("bad", [None, -1, 64, 2**70])  # not an int; outside the vocabulary [0, 64); past int64
def test_a_malformed_draft_fails_its_own_request_only(target, bad):
    engine = Engine(target, cycle(lambda: Malformed(bad), NgramDrafter), 4)
    params = SamplingParams(max_new_tokens=12)
    bad, good = engine.add([1, 2, 3], params), engine.add([4, 5, 6, 4, 5], params)
    failed, tokens = [], []
    while engine.running:
        for seq, outcome in engine.step():
            if isinstance(outcome, Exception):
                failed.append(seq)
            elif seq is good:
                tokens += outcome.tokens
    assert failed == [bad] and bad not in engine.running
    assert tokens == [t for s in Engine(target, NoDrafter()).generate([4, 5, 6, 4, 5], params) for t in s.tokens]


@needs_kernels
@pytest.mark.parametrize("dots", [True, False], ids=["bf16-dots", "float-path"])
def test_greedy_over_a_bfloat16_cache_past_its_tiles(target, draft, monkeypatch, fixed_prefill, dots):
    """Prompts of 70-150 tokens with a bfloat16 cache (head dim 64: past 64 slots attention runs on AMX tiles, or
    in BF16 dot products, where the CPU has them): chains and trees, batched and prefilled in chunks, give plain
    decoding's tokens."""
    from specdecode.kernels import cpu_kernels

    fixed_prefill(busy=24)
    monkeypatch.setattr(target, "kv_dtype", torch.bfloat16)
    prompts = [[(7 * i + 3) % 64 for i in range(n)] for n in (70, 97, 150)]
    make = cycle(lambda: DraftModelDrafter(draft, vocab_size=64, width=TREE_WIDTH, expand=TREE_EXPAND),
                 lambda: HybridDrafter(DraftModelDrafter(draft, vocab_size=64)), NgramDrafter)
    requests = [(prompt, SamplingParams(max_new_tokens=30)) for prompt in prompts]
    cpu_kernels().set_bf16_dots(dots)
    try:
        together = run_batch(Engine(target, make, None, costs=CPU_LIKE), requests, arrivals=[0, 2, 3])
        for (prompt, params), out in zip(requests, together):
            assert out == [t for s in Engine(target, NoDrafter()).generate(prompt, params) for t in s.tokens]
    finally:
        cpu_kernels().set_bf16_dots(True)
