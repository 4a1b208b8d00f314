"""The whole loop: greedy identity for every drafter, cache invariants, and exact output distributions."""

import pytest
import torch
from tiny import tiny_native
from toy import (
    BigramModel,
    ScriptedDrafter,
    ScriptedTreeDrafter,
    assert_exact_distribution,
    exact_sequence_probs,
    l1_bound,
    random_chain,
)

from specdecode.config import SamplingParams
from specdecode.drafters import DraftModelDrafter, HybridDrafter, NgramDrafter, NoDrafter
from specdecode.drafters.draft_model import TREE_EXPAND, TREE_WIDTH
from specdecode.drafters.lookahead import LookaheadDrafter
from specdecode.drafters.recycle import RecycleDrafter
from specdecode.drafters.suffix import SuffixDrafter
from specdecode.drafters.suffix_pool import SuffixPool
from specdecode.engine.engine import Engine
from specdecode.models.masks import chain_mask
from specdecode.models.prompt_cache import PromptCache
from specdecode.planner.budget import CostCurve
from specdecode.planner.planner import Planner
from specdecode.planner.prices import best_count

CPU_LIKE = CostCurve(tuple(1.0 + 0.08 * m for m in range(16)))  # C(8) = 1.56 C(1), as measured on a 2-core CPU

PROMPT = [1, 2, 3, 4, 5, 6, 1, 2, 3, 9, 9, 1, 2]


def run(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    return [t for step in engine.generate(prompt, params) for t in step.tokens]


@pytest.fixture(autouse=True)
def costs_as_given(monkeypatch):
    """Toy forwards take microseconds: the curve each test gives is the cost model under test, not lowered to
    them (the engine lowers it to the fastest forwards it sees)."""
    monkeypatch.setattr(Planner, "observe", lambda self, rows, seconds, *more: None)


@pytest.fixture(scope="module")
def target():
    return tiny_native("qwen2", seed=0)


@pytest.fixture(scope="module")
def reference(target):
    return run(Engine(target, NoDrafter()), PROMPT, SamplingParams(max_new_tokens=40))


def subset_head_drafter(seed: int, width: int) -> DraftModelDrafter:
    """A draft whose LM head scores only half the vocabulary (vocab_subset.restrict_lm_head)."""
    from specdecode.weights.vocab_subset import restrict_lm_head

    model = tiny_native("qwen2", seed=seed)
    return DraftModelDrafter(model, vocab_size=64, width=width,
                             head_tokens=restrict_lm_head(model, torch.arange(0, 64, 2)))


def drafters(target):
    true = lambda: run(Engine(target, NoDrafter()), PROMPT, SamplingParams(max_new_tokens=60))
    full = PROMPT + true()
    return {
        "draft-model-subset-head": subset_head_drafter(1, width=2),
        "ngram": NgramDrafter(),
        "ngram-tree": NgramDrafter(branches=4),
        "recycle": RecycleDrafter(64),
        "recycle-chain": RecycleDrafter(64, width=1),
        "suffix": SuffixDrafter(SuffixPool(1)),
        "lookahead": LookaheadDrafter(),
        "draft-model-tree": DraftModelDrafter(tiny_native("qwen2", seed=1), vocab_size=64, width=3),
        "self-draft-tree": DraftModelDrafter(target, vocab_size=64, width=2),
        "scripted-tree": ScriptedTreeDrafter(lambda toks, k: full[len(toks): len(toks) + k], vocab=64),
        "draft-model": DraftModelDrafter(tiny_native("qwen2", seed=1), vocab_size=64),
        "draft-model-window": DraftModelDrafter(tiny_native("qwen2", seed=1), vocab_size=64, window=7),
        "hybrid-window": HybridDrafter(DraftModelDrafter(tiny_native("qwen2", seed=1), vocab_size=64, window=7)),
        "draft-model-llama": DraftModelDrafter(tiny_native("llama", seed=2), vocab_size=64),
        "draft-model-adaptive": DraftModelDrafter(tiny_native("qwen2", seed=1), vocab_size=64, min_confidence=0.03),
        "self-draft": DraftModelDrafter(target, vocab_size=64),
        "hybrid": HybridDrafter(DraftModelDrafter(tiny_native("qwen2", seed=1), vocab_size=64)),
        "hybrid-tree": HybridDrafter(DraftModelDrafter(tiny_native("qwen2", seed=1), vocab_size=64, width=2)),
        # the default shape of `draft` and `hybrid`: the best node of each depth fed, its siblings left as leaves
        "draft-model-tree-leaves": DraftModelDrafter(tiny_native("qwen2", seed=1), vocab_size=64, width=TREE_WIDTH,
                                                     expand=TREE_EXPAND),
        "hybrid-tree-leaves": HybridDrafter(DraftModelDrafter(tiny_native("qwen2", seed=1), vocab_size=64,
                                                              width=TREE_WIDTH, expand=TREE_EXPAND)),
        "always-right": ScriptedDrafter(lambda toks, k: full[len(toks): len(toks) + k]),
        "always-wrong": ScriptedDrafter(lambda toks, k: [(full[len(toks) + i] + 1) % 64 for i in range(k)]),
        "empty": ScriptedDrafter(lambda toks, k: []),
    }


@pytest.mark.parametrize("k", [0, 1, 3, 6])  # 0: a request that asks for no drafts at all
def test_greedy_is_token_identical_for_every_drafter(target, reference, k):
    for name, drafter in drafters(target).items():
        engine = Engine(target, drafter, num_draft_tokens=k)
        assert run(engine, PROMPT, SamplingParams(max_new_tokens=40)) == reference, name
        stats = engine.last.stats
        if name in ("always-right", "self-draft") and k:
            assert stats.acceptance_rate == 1.0, name
        if name in ("self-draft-tree", "scripted-tree") and k > 1:
            assert stats.accepted_path_length >= 1.0 and stats.tree_steps > 0, name
        if name in ("always-wrong", "empty"):
            assert stats.accepted_tokens == 0 and stats.mean_accepted_length == 1.0, name


@pytest.mark.parametrize("k", [3, None])  # None: sized by the planner
def test_greedy_is_token_identical_with_a_bfloat16_kv_cache(k):
    """Keys and values rounded to bfloat16 as they are stored: every drafter's output is plain decoding's with
    that cache, chains and trees."""
    target = tiny_native("qwen2", seed=0)
    target.kv_dtype = torch.bfloat16
    assert target.new_cache(1, 4).k.dtype == torch.bfloat16
    reference = run(Engine(target, NoDrafter()), PROMPT, SamplingParams(max_new_tokens=40))
    for name, drafter in drafters(target).items():
        engine = Engine(target, drafter, num_draft_tokens=k, costs=CPU_LIKE if k is None else None)
        assert run(engine, PROMPT, SamplingParams(max_new_tokens=40)) == reference, name


def test_greedy_is_token_identical_with_an_automatic_budget(target, reference):
    for name, drafter in drafters(target).items():
        engine = Engine(target, drafter, num_draft_tokens=None, costs=CPU_LIKE)
        assert run(engine, PROMPT, SamplingParams(max_new_tokens=40)) == reference, name
        assert engine.last.stats.draft_budget == "auto" and engine.last.stats.verify_costs is CPU_LIKE


def test_budget_keeps_the_best_ancestor_closed_nodes():
    from specdecode.drafters.base import Draft

    draft = Draft(torch.tensor([5, 6, 7, 8, 9]), torch.tensor([-1, -1, 0, 0, 2]), None, [0.9, 0.05, 0.6, 0.2, 0.5])
    best = draft.best(3)
    assert best.tokens.tolist() == [5, 7, 9] and best.parents.tolist() == [-1, 0, 1] and best.scores == [0.9, 0.6, 0.5]
    assert best_count(CPU_LIKE, [0.9, 0.6, 0.5, 0.01]) == 3  # the last node costs more than it is expected to bring
    assert best_count(CostCurve((1.0, 3.0)), [0.9]) == 0  # verifying a second token triples the cost: draft nothing
    with pytest.raises(AssertionError, match="parent"):
        Draft(torch.tensor([1, 2]), torch.tensor([1, -1])).check()


def test_stops_inside_a_draft(target, reference):
    eos = reference[7]
    first_eos = reference.index(eos)
    target.config.eos_token_ids = (eos,)
    try:
        for drafter in drafters(target).values():
            out = run(Engine(target, drafter, num_draft_tokens=5), PROMPT, SamplingParams(max_new_tokens=40))
            assert out == reference[: first_eos + 1]
    finally:
        target.config.eos_token_ids = ()
    for n in (1, 2, 7, 13):  # max_new_tokens cuts inside a draft too
        engine = Engine(target, drafters(target)["always-right"], num_draft_tokens=5)
        steps = list(engine.generate(PROMPT, SamplingParams(max_new_tokens=n)))
        assert [t for s in steps for t in s.tokens] == reference[:n]
        assert steps[-1].finish_reason == "length" and engine.last.stats.new_tokens == n


def test_context_limit_stops_cleanly(target, reference):
    engine = Engine(target, drafters(target)["always-right"], num_draft_tokens=4, max_len=len(PROMPT) + 10)
    steps = list(engine.generate(PROMPT, SamplingParams(max_new_tokens=40)))
    assert [t for s in steps for t in s.tokens] == reference[:10]
    assert steps[-1].finish_reason == "length"


@pytest.mark.parametrize("width", [1, 3])
def test_cache_matches_a_fresh_prefill_after_every_step(target, width):
    engine = Engine(target, DraftModelDrafter(tiny_native("qwen2", seed=1), vocab_size=64, width=width),
                    num_draft_tokens=6)
    params = SamplingParams(max_new_tokens=30, temperature=1.0, seed=0)
    for _ in engine.generate(PROMPT, params):
        cache, tokens = engine.last.cache, engine.last.tokens
        assert cache.length == len(tokens) - 1
        fresh = target.new_cache(1, 64)
        ids = torch.tensor([tokens[:-1]])
        target(ids, torch.arange(ids.shape[1])[None], fresh, chain_mask(0, ids.shape[1]))
        n = cache.length
        assert torch.allclose(cache.k[:, :, :, :n], fresh.k[:, :, :, :n], atol=1e-5)
        assert torch.allclose(cache.v[:, :, :, :n], fresh.v[:, :, :, :n], atol=1e-5)
        drafter_cache = engine.last.drafter.cache  # holds a prefix of the tokens (None before the first draft)
        assert drafter_cache is None or drafter_cache.length <= len(tokens)


def test_draft_forward_time_leaves_out_the_prompt_and_catching_up(target, monkeypatch):
    """What one draft forward costs (the budget's estimate) is learnt from one-depth forwards only: the draft's
    prompt and the steps it sat out go in as many rows at once, and on the CPU as decode rows too."""
    from specdecode.drafters.base import DraftContext
    from specdecode.drafters.tree_growth import GrowsTrees

    timed = []
    monkeypatch.setattr(GrowsTrees, "hear", lambda self, event: timed.append(event.seconds))
    drafter = DraftModelDrafter(tiny_native("qwen2", seed=1), vocab_size=64)
    params = SamplingParams(max_new_tokens=8)
    draft = drafter.propose(DraftContext(PROMPT, params, None), 4)  # the prompt, the root, then 3 deeper forwards
    assert len(draft) == 4 and drafter.forwards == 4 and len(timed) == 4
    drafter.commit([0, 1, 2, 3])
    drafter.propose(DraftContext(PROMPT + draft.tokens.tolist() + [5, 6, 7], params, None), 2)  # sat out 2 steps
    assert drafter.forwards == 1 and len(timed) == 5  # the catching up is not timed, the one deeper forward is


def test_a_windowed_draft_reads_the_first_and_newest_prompt_tokens(target):
    """A draft model with a window keeps the prompt's first SINK_TOKENS and its newest tokens, at consecutive
    positions; what it catches up on later follows the window, and its guesses are those of a draft that only ever
    saw those tokens."""
    from specdecode.drafters.base import DraftContext
    from specdecode.drafters.draft_model import SINK_TOKENS

    prompt = list(range(1, 30))
    params = SamplingParams(max_new_tokens=8)
    model = tiny_native("qwen2", seed=1)
    windowed = DraftModelDrafter(model, vocab_size=64, window=10)
    assert windowed.behind(prompt) == 11  # what its first draft will feed: the window and the root
    draft = windowed.propose(DraftContext(prompt, params, None), 3)
    read = prompt[:SINK_TOKENS] + prompt[-1 - (10 - SINK_TOKENS):]  # the window, then the root
    assert windowed.skipped == len(prompt) - 1 - 10
    alone = DraftModelDrafter(model, vocab_size=64)
    assert torch.equal(draft.tokens, alone.propose(DraftContext(read, params, None), 3).tokens)
    windowed.commit([0])
    later = prompt + [draft.tokens[0].item(), 7, 8]  # one accepted, then steps it sat out
    alone.commit([0])
    assert windowed.behind(later) == alone.behind(read + later[len(prompt):]) > 1
    assert torch.equal(windowed.propose(DraftContext(later, params, None), 2).tokens,
                       alone.propose(DraftContext(read + later[len(prompt):], params, None), 2).tokens)


def test_sampling_with_seed_is_reproducible(target):
    params = SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9, seed=123)
    engine = Engine(target, DraftModelDrafter(tiny_native("qwen2", seed=1), vocab_size=64))
    assert run(engine, PROMPT, params) == run(engine, PROMPT, params)


@pytest.mark.parametrize("shape", ["chain", "tree", "ngram-tree", "subset-head-tree", "chain-auto", "tree-auto",
                                   "hybrid-leaves-auto", "windowed-kept-tree"])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0, max_new_tokens=3),
                                    SamplingParams(temperature=0.6, top_k=3, max_new_tokens=3)])
def test_whole_loop_output_distribution_is_the_targets(params, shape):
    """Real engine, EOS and the token budget landing inside drafts; chi-by-L1 bound. Drafters: a draft model's
    chain, its tree (siblings drawn without replacement), n-gram trees (point-mass siblings), and `hybrid` over a
    tree whose siblings stay leaves (the default shape), and a draft that reads a window of a longer prompt and
    keeps what it read and answered across requests (its own prompt cache)."""
    vocab, eos, trials = 4, 3, 6000
    target_chain, draft_chain = random_chain(vocab, 10), random_chain(vocab, 11, sharpness=2.0)
    transformed = torch.stack([torch.as_tensor(p) for p in
                               __import__("specdecode.sampling", fromlist=["to_probs"]).to_probs(
                                   target_chain.log(), params)])
    exact = exact_sequence_probs(transformed, start=0, length=3, eos=eos)
    target = BigramModel(target_chain, eos=(eos,))
    if shape == "ngram-tree":
        drafter = NgramDrafter(max_ngram=2, branches=3)
    elif shape == "subset-head-tree":  # the draft can only propose tokens 0 and 2: q is the renormalised subset
        draft = BigramModel(draft_chain[:, [0, 2]] / draft_chain[:, [0, 2]].sum(-1, keepdim=True))
        drafter = DraftModelDrafter(draft, vocab_size=vocab, width=2, head_tokens=torch.tensor([0, 2]))
    elif shape == "hybrid-leaves-auto":
        drafter = HybridDrafter(DraftModelDrafter(BigramModel(draft_chain), vocab_size=vocab, width=2, expand=1))
    elif shape == "windowed-kept-tree":
        drafter = DraftModelDrafter(BigramModel(draft_chain), vocab_size=vocab, width=2, window=6,
                                    prompts=PromptCache(1))
    else:
        drafter = DraftModelDrafter(BigramModel(draft_chain), vocab_size=vocab, width=1 if "chain" in shape else 2)
    # "-auto": the size is chosen per step from a steep cost curve, so drafts get cut: what is cut must never
    # depend on the token drawn for the node itself, or the output distribution drifts.
    auto = shape.endswith("-auto")
    engine = Engine(target, drafter, num_draft_tokens=None if auto else 4,
                    costs=CostCurve((1.0, 1.5, 2.0)) if auto else None)
    prompt = [1, 2, 1, 2, 1, 2, 0] if shape == "windowed-kept-tree" else [0]  # the bigram target reads its last
    counts: dict[tuple, int] = {}
    for i in range(trials):
        out = tuple(run(engine, prompt, SamplingParams(**{**params.__dict__, "seed": i})))
        counts[out] = counts.get(out, 0) + 1
    assert_exact_distribution(counts, exact)


@pytest.mark.parametrize("width", [1, 2])
def test_sampled_drafts_cut_per_step_keep_the_targets_marginal(width):
    """Under sampling the budget chooser may keep or drop a drafted node only on what was known before the node
    was drawn. Here the target is a fair coin and the draft says 0.8 / 0.2; with this cost curve a node is worth
    verifying when its score exceeds 0.5, so a cut on the node's own draft probability would verify token 0 only
    and the second token would come out 0 with probability 0.6 instead of 0.5."""
    trials = 8000
    target = BigramModel(torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    drafter = DraftModelDrafter(BigramModel(torch.tensor([[0.8, 0.2], [0.8, 0.2]])), vocab_size=2, width=width)
    engine = Engine(target, drafter, num_draft_tokens=None, costs=CostCurve((1.0, 1.5, 2.0)))
    zeros = drafted = 0
    for seed in range(trials):
        zeros += run(engine, [0], SamplingParams(temperature=1.0, max_new_tokens=3, seed=seed))[1] == 0
        drafted += engine.last.stats.drafted_tokens
    assert drafted >= trials  # the chooser did verify drafts
    assert abs(zeros / trials - 0.5) < l1_bound(2, trials) / 2


@pytest.mark.parametrize("auto", [False, True])
def test_hybrid_output_distribution_is_the_targets_whichever_drafter_proposes(auto):
    """A repetitive prompt gives the n-gram matches: steps switch between copying and the draft model (both are
    checked to happen), and the outputs keep the target's distribution."""
    vocab, eos, trials, length = 4, 3, 6000, 4
    target_chain, draft_chain = random_chain(vocab, 10), random_chain(vocab, 11, sharpness=2.0)
    prompt = [0, 1, 2, 0, 1, 0, 2, 1, 0, 1]
    params = SamplingParams(temperature=1.0, max_new_tokens=length)
    exact = exact_sequence_probs(target_chain, start=prompt[-1], length=length, eos=eos)
    # the draft reads a window of the prompt, as by default (there: 128 tokens)
    drafter = HybridDrafter(DraftModelDrafter(BigramModel(draft_chain), vocab_size=vocab, window=6))
    used = {"copy": 0, "model": 0}

    def counted_fork(fork=drafter.fork):  # each request's drafter counts which of its two drafters committed
        forked = fork()
        for kind, part in (("copy", forked.ngram), ("model", forked.draft)):
            def counted(accepted, verified=None, commit=part.commit, kind=kind):
                used[kind] += 1
                commit(accepted, verified)
            part.commit = counted
        return forked
    drafter.fork = counted_fork
    engine = Engine(BigramModel(target_chain, eos=(eos,)), drafter, num_draft_tokens=None if auto else 3,
                    costs=CostCurve((1.0, 1.1, 1.2, 1.3)) if auto else None)
    counts: dict[tuple, int] = {}
    for i in range(trials):
        out = tuple(run(engine, prompt, SamplingParams(**{**params.__dict__, "seed": i})))
        counts[out] = counts.get(out, 0) + 1
    assert used["copy"] > trials / 10 and used["model"] > trials / 10, used
    assert_exact_distribution(counts, exact)


def test_a_passed_over_draft_is_judged_against_the_tokens_that_followed():
    from specdecode.drafters.base import Draft
    from specdecode.drafters.hybrid import hindsight

    tree = Draft(torch.tensor([5, 6, 7, 9, 6]), torch.tensor([-1, 0, 1, 0, -1]))  # two depth-1 nodes say 5 and 6
    assert hindsight(tree, [5, 6, 8]) == ([0, 1], [0, 1, 2, 3, 4])
    assert hindsight(tree, [5]) == ([0], [0, 4])  # deeper nodes cannot be judged yet
    assert hindsight(tree, [6, 6]) == ([4], [0, 1, 3, 4])
    assert hindsight(tree, []) == ([], [])


def test_a_copier_passed_over_learns_from_what_followed():
    """A copier the hybrid did not take still learns from its draft once the next tokens are known: right guesses
    raise its own rate, so it is taken again where it copies well; wrong ones lower it. Its trust, which only
    verified drafts move, stays."""
    from specdecode.drafters.base import Draft

    hybrid = HybridDrafter(DraftModelDrafter(tiny_native("qwen2", seed=1), vocab_size=64))
    copier = hybrid.ngram
    rate = copier.rate.value
    copier.parents = [-1, 0, 1, 2]  # its last draft, a chain of four
    chain = Draft.chain(torch.tensor([7, 8, 9, 10]), scores=[0.5, 0.25, 0.125, 0.0625])
    hybrid.not_taken, hybrid.not_taken_at = [(copier, chain)], 3
    hybrid._learn_in_hindsight([1, 2, 3, 7, 8, 9, 10, 11])
    assert copier.rate.value > rate and hybrid.trust[copier].value == 1.0
    assert hybrid.not_taken == []  # judged once

    wrong = HybridDrafter(DraftModelDrafter(tiny_native("qwen2", seed=1), vocab_size=64))
    wrong.ngram.parents = [-1, 0, 1, 2]
    wrong.not_taken, wrong.not_taken_at = [(wrong.ngram, chain)], 3
    wrong._learn_in_hindsight([1, 2, 3, 4, 5])
    assert wrong.ngram.rate.value < rate


def test_ngram_matches_merge_into_a_trie():
    from specdecode.drafters.ngram import NgramIndex, trie

    tokens = [5, 1, 2, 3, 9, 5, 1, 2, 4, 9, 5, 1]  # "5 1" was followed by "2 3" and "2 4"
    found = NgramIndex(1, 2).lookup(tokens, 3, count=4)
    assert found[:2] == [[2, 4, 9], [2, 3, 9]]  # longest n-gram, most recent first
    nodes, parents, share = trie(found[:2], max_tokens=8)
    assert nodes == [2, 4, 9, 3, 9] and parents == [-1, 0, 1, 0, 3]  # the shared "2" once, then two branches
    assert share == [1.0, 0.5, 1.0, 0.5, 1.0]
    assert trie(found[:2], max_tokens=2)[0] == [2, 4]  # the budget cuts, parents first


def test_the_ngram_index_follows_a_growing_context():
    """Indexed as the tokens grow (and again when the list is another one), its matches are those of a scan of the
    whole context each time: longest n-gram first, most recent first, distinct continuations."""
    import random

    from specdecode.drafters.ngram import NgramIndex

    def scan(tokens, depth, low, high, count):
        found = []
        for n in range(min(high, len(tokens) - 1), low - 1, -1):
            for start in range(len(tokens) - 1 - n, -1, -1):
                run = tokens[start + n : start + n + depth]
                if tokens[start : start + n] == tokens[-n:] and run not in found:
                    found.append(run)
        return found[:count]

    rng = random.Random(3)
    for low, high in ((1, 3), (2, 3), (2, 2)):
        index, tokens = NgramIndex(low, high), []
        for step in range(120):
            if step == 70:
                tokens = tokens[:40]  # another request's list: indexed again
            if step == 100:
                tokens = tokens[:-8] + [(t + 1) % 6 for t in tokens[-8:]]  # as long, its newest tokens others
            tokens = tokens + [rng.randrange(6) for _ in range(rng.randrange(1, 4))]
            depth, count = rng.randrange(0, 6), rng.randrange(1, 5)
            expect = scan(tokens, depth, low, high, count) if depth > 0 else []
            assert index.lookup(tokens, depth, count) == expect, (step, tokens)
