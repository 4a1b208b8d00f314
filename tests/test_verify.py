"""Verifier algebra (exact, float64) and the sampled distribution of the first emitted token (seeded)."""

import itertools

import pytest
import torch
from toy import l1_bound

from specdecode.config import SamplingParams
from specdecode.sampling import make_generator, sample, to_probs
from specdecode.verify import acceptance_probs, residual, sibling_round, verify_chain, verify_tree


def random_probs(vocab: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(vocab, generator=gen, dtype=torch.float64).mul(2).softmax(-1)


def test_rejection_rule_reproduces_target_exactly():
    gen = torch.Generator().manual_seed(0)
    for vocab in (4, 7, 16):
        for _ in range(20):
            target, draft = random_probs(vocab, gen), random_probs(vocab, gen)
            tokens = torch.arange(vocab)
            accept = acceptance_probs(target.expand(vocab, -1), tokens, draft.expand(vocab, -1))  # a(x)
            rest = residual(target, tokens[0], draft)
            rest = rest / rest.sum()
            emitted = draft * accept + (1 - (draft * accept).sum()) * rest
            assert torch.allclose(emitted, target, atol=1e-12, rtol=0)


def test_rejection_rule_with_point_mass_draft_is_exact():
    gen = torch.Generator().manual_seed(1)
    for vocab in (4, 9):
        target = random_probs(vocab, gen)
        for guess in range(vocab):
            accept = acceptance_probs(target[None], torch.tensor([guess]), None)[0]
            rest = residual(target, torch.tensor(guess), None)
            emitted = (1 - accept) * rest / rest.sum()
            emitted[guess] += accept
            assert torch.allclose(emitted, target, atol=1e-12, rtol=0)


def test_residual_falls_back_to_target_when_draft_equals_target():
    target = torch.tensor([0.25, 0.25, 0.5], dtype=torch.float64)
    assert torch.equal(residual(target, torch.tensor(0), target.clone()), target)


def test_sample_follows_probs():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    gen = make_generator(0)
    draws = sample(probs.expand(200_000, -1), gen)
    freq = torch.bincount(draws, minlength=4).double() / draws.numel()
    assert freq[1] == 0
    assert (freq - probs.double()).abs().sum() < l1_bound(4, 200_000)


def test_greedy_accepts_longest_matching_prefix():
    logits = torch.full((4, 10), -1.0)
    logits[0, 3] = logits[1, 5] = logits[2, 7] = logits[3, 9] = 1.0  # target argmax: 3 5 7 9
    params = SamplingParams()
    verdict = verify_chain(logits, torch.tensor([3, 5, 1]), None, params, None)
    assert verdict.num_accepted == 2 and verdict.emitted == [3, 5, 7]
    verdict = verify_chain(logits, torch.tensor([3, 5, 7]), None, params, None)
    assert verdict.num_accepted == 3 and verdict.emitted == [3, 5, 7, 9]  # bonus token
    verdict = verify_chain(logits[:1], torch.tensor([], dtype=torch.long), None, params, None)
    assert verdict.num_accepted == 0 and verdict.emitted == [3]


def test_first_emitted_token_is_distributed_as_target():
    """Sampled drafts of 2 tokens from q; the first emitted token must follow p after the transform."""
    vocab, trials = 6, 15_000
    gen = torch.Generator().manual_seed(2)
    target_logits = torch.randn(3, vocab, generator=gen)
    draft_logits = torch.randn(2, vocab, generator=gen)
    for params in (SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4, top_p=0.9)):
        target = to_probs(target_logits, params)
        draft_probs = to_probs(draft_logits, params)
        rng = make_generator(3)
        counts = torch.zeros(vocab, dtype=torch.float64)
        draft_tokens = sample(draft_probs.expand(trials, -1, -1), rng)  # [trials, 2]
        for row in draft_tokens:
            verdict = verify_chain(target_logits, row, draft_probs, params, rng)
            counts[verdict.emitted[0]] += 1
        assert (counts / trials - target[0].double()).abs().sum() < l1_bound(vocab, trials)


def test_top_k_top_p_transform():
    logits = torch.tensor([3.0, 2.0, 1.0, 0.0])
    assert torch.count_nonzero(to_probs(logits, SamplingParams(temperature=1.0, top_k=2))) == 2
    probs = to_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))  # p = .64 .24 .09 .03
    assert torch.count_nonzero(probs) == 2 and abs(float(probs.sum()) - 1) < 1e-6
    greedy = to_probs(logits, SamplingParams())
    assert greedy.tolist() == [1.0, 0.0, 0.0, 0.0]


def emitted_by_rounds(target: torch.Tensor, candidates: list[int], proposals: list) -> torch.Tensor:
    """Exact distribution of the token a node emits when its children are tried in order (sibling_round)."""
    dist, reach, row = torch.zeros_like(target), 1.0, target
    for token, proposal in zip(candidates, proposals):
        accept, rest = sibling_round(row, torch.tensor(token), proposal)
        dist[token] += reach * accept
        reach, row = reach * (1 - accept), rest
    return dist + reach * row


def test_tree_rounds_with_point_mass_siblings_reproduce_target_exactly():
    gen = torch.Generator().manual_seed(2)
    for vocab in (4, 6):
        target = random_probs(vocab, gen)
        for m in (1, 2, 3):
            for candidates in itertools.permutations(range(vocab), m):
                got = emitted_by_rounds(target, list(candidates), [None] * m)
                assert torch.allclose(got, target, atol=1e-12, rtol=0)


def iid_draws(draft: torch.Tensor, m: int):
    """Every way to draw m siblings i.i.d. from `draft` -> (candidates, probability, each one's proposal row)."""
    for candidates in itertools.product(range(draft.numel()), repeat=m):  # duplicates allowed
        yield list(candidates), float(torch.prod(draft[list(candidates)])), [draft] * m


def draws_without_replacement(draft: torch.Tensor, m: int):
    """Every ordered draw of m distinct siblings, each from what is left of `draft`, renormalised."""
    for candidates in itertools.permutations(range(draft.numel()), m):
        weight, proposals, left = 1.0, [], draft.clone()
        for token in candidates:
            left = left / left.sum()
            proposals.append(left.clone())
            weight *= float(left[token])
            left[token] = 0.0
        yield list(candidates), weight, proposals


@pytest.mark.parametrize("draws", [iid_draws, draws_without_replacement])
def test_tree_rounds_with_drawn_siblings_reproduce_target_exactly(draws):
    gen = torch.Generator().manual_seed(3)
    for vocab in (3, 5):
        target, draft = random_probs(vocab, gen), random_probs(vocab, gen)
        for m in (2, 3):
            total = torch.zeros_like(target)
            for candidates, weight, proposals in draws(draft, m):
                total += weight * emitted_by_rounds(target, candidates, proposals)
            assert torch.allclose(total, target, atol=1e-12, rtol=0)


def test_greedy_tree_follows_the_targets_argmax():
    logits = torch.full((6, 10), -1.0)
    # root -> argmax 3; node 1 (token 3) -> argmax 5; node 3 (token 5) -> argmax 9
    logits[0, 3] = logits[2, 5] = logits[4, 9] = logits[1, 0] = logits[3, 0] = logits[5, 0] = 1.0
    tokens = torch.tensor([4, 3, 7, 5, 6])  # node 0: 4, node 1: 3 (right), node 2 under 0, node 3 under 1, 4 under 1
    parents = [-1, -1, 0, 1, 1]
    verdict = verify_tree(logits, tokens, parents, None, SamplingParams(), None)
    assert verdict.path == [1, 3] and verdict.emitted == [3, 5, 9]
    verdict = verify_tree(logits, torch.tensor([1, 2, 7, 5, 6]), parents, None, SamplingParams(), None)
    assert verdict.path == [] and verdict.emitted == [3]


def test_sampled_tree_first_token_follows_the_target():
    """verify_tree itself, seeded: the first emitted token of a point-mass tree is distributed as the target."""
    vocab, trials = 5, 40_000
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(5))
    params = SamplingParams(temperature=1.0)
    target = to_probs(logits[0], params).double()
    gen = make_generator(0)
    counts = torch.zeros(vocab, dtype=torch.float64)
    tokens, parents = torch.tensor([2, 0, 4]), [-1, -1, 0]
    for _ in range(trials):
        counts[int(verify_tree(logits, tokens, parents, None, params, gen).emitted[0])] += 1
    assert (counts / trials - target).abs().sum() < l1_bound(vocab, trials)


def test_sampled_point_mass_tree_paths_follow_the_target():
    """Two depths of a point-mass tree, seeded: each emitted pair (x0, x1) comes with probability p0(x0) p(x1 | x0)
    where x0 is a child that has children, and x0 alone ends the step elsewhere."""
    vocab, trials = 5, 40_000
    logits = torch.randn(6, vocab, generator=torch.Generator().manual_seed(6))
    params = SamplingParams(temperature=1.0)
    p = to_probs(logits, params).double()  # row 0: the root; row i + 1: after node i
    tokens, parents = torch.tensor([2, 0, 4, 1, 3]), [-1, -1, 0, 1, 1]  # 2 -> {4}, 0 -> {1, 3}
    expected = torch.zeros(vocab, vocab + 1, dtype=torch.float64)  # [x0, x1], column vocab: nothing after x0
    for x0 in range(vocab):
        row = {2: 1, 0: 2}.get(x0)
        if row is None:
            expected[x0, vocab] = p[0, x0]
        else:
            expected[x0, :vocab] = p[0, x0] * p[row]
    gen = make_generator(1)
    counts = torch.zeros_like(expected)
    for _ in range(trials):
        emitted = verify_tree(logits, tokens, parents, None, params, gen).emitted
        counts[emitted[0], emitted[1] if len(emitted) > 1 else vocab] += 1
    assert (counts / trials - expected).abs().sum() < l1_bound(expected.numel(), trials)


def test_top_p_over_the_likeliest_tokens_keeps_what_a_full_sort_keeps():
    """The nucleus is looked for among the likeliest 256, then 4,096 tokens, then all: rows of each kind."""
    gen = torch.Generator().manual_seed(5)
    vocab, top_p = 20_000, 0.9
    logits = torch.randn(6, vocab, generator=gen) * torch.tensor([12.0, 9.0, 3.0, 2.0, 0.5, 30.0])[:, None]
    probs = logits.softmax(-1)
    ranked, order = probs.sort(dim=-1, descending=True)
    expected = torch.zeros_like(probs, dtype=torch.bool).scatter(-1, order, ranked.cumsum(-1) - ranked < top_p)
    got = to_probs(logits, SamplingParams(temperature=1.0, top_p=top_p)) > 0
    kept = expected.sum(-1)
    assert kept.min() < 256 and ((kept > 256) & (kept < 4096)).any() and kept.max() > 4096  # every path taken
    assert torch.equal(got, expected)


def test_sample_over_a_few_tokens_of_a_large_vocabulary():
    """After top-p only a few tokens keep probability: the draw runs over those alone, and follows them."""
    probs = torch.zeros(3, 5_000)
    probs[:, [17, 4_000, 4_999]] = torch.tensor([0.2, 0.5, 0.3])
    draws = torch.cat([sample(probs, make_generator(seed)) for seed in range(4_000)])
    freq = torch.bincount(draws, minlength=5_000).double() / draws.numel()
    assert freq.sum() == freq[[17, 4_000, 4_999]].sum()  # nothing else is ever drawn
    expected = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    assert (freq[[17, 4_000, 4_999]] - expected).abs().sum() < l1_bound(3, draws.numel())
