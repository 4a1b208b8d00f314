"""Sampling helpers: the native greedy argmax answers as torch does."""

import pytest
import torch

from specdecode.kernels import cpu_kernels
from specdecode.sampling import greedy_tokens


@pytest.mark.skipif(cpu_kernels() is None, reason="the native CPU kernel needs AVX2, FMA and a C++ compiler")
def test_greedy_tokens_are_torchs_argmax():
    """The native argmax gives torch's answer: the first index on ties, NaN the largest, any row length."""
    torch.manual_seed(0)
    for vocab in (1, 5, 8, 13, 64, 151936):
        logits = torch.randn(6, vocab)
        logits[1] = 2.0  # all tied: index 0
        logits[2, vocab // 2 :] = 100.0  # tied in the middle and the tail
        logits[3] = float("-inf")
        if vocab > 3:
            logits[4, 3] = float("nan")
        assert torch.equal(greedy_tokens(logits), logits.argmax(-1))


def test_greedy_top1_is_the_softmax_maximum():
    """A greedy chain drafter's child and confidence: the argmax and its softmax probability."""
    from specdecode.sampling import greedy_top1

    torch.manual_seed(1)
    for vocab in (3, 32784, 151936):
        logits = torch.randn(4, vocab) * 3
        index, prob = greedy_top1(logits)
        ref = logits.softmax(-1).max(-1)
        assert torch.equal(index[:, 0], logits.argmax(-1))
        assert torch.allclose(prob[:, 0], ref.values, rtol=1e-5)


def test_greedy_topk_is_softmax_and_topk():
    """A greedy tree drafter's children and confidences: the k largest logits, largest first (the lower index among
    equals), and their softmax probabilities; rows the kernel cannot rank (a NaN, fewer than k finite values) go to
    torch."""
    from specdecode.sampling import greedy_topk

    torch.manual_seed(2)
    for vocab in (3, 17, 32784, 151936):
        logits = torch.randn(4, vocab) * 3
        logits[1] = torch.round(logits[1])  # many ties
        k = min(3, vocab)
        index, prob = greedy_topk(logits, k)
        values = logits.gather(-1, index)
        assert torch.equal(values, logits.topk(k, dim=-1).values)
        assert torch.allclose(prob.double(), logits.double().softmax(-1).gather(-1, index), rtol=1e-4)
        equal = values[:, 1:] == values[:, :-1]
        assert bool((index[:, 1:] > index[:, :-1])[equal].all())
    sparse = torch.full((2, 40), float("-inf"))
    sparse[:, 5] = 1.0
    sparse[1, 7] = float("nan")
    index, prob = greedy_topk(sparse, 2)  # torch's answer: the finite one first
    assert index[0, 0] == 5 and prob[0, 0] == 1.0


def test_greedy_topk_as_lists_is_greedy_topk():
    """What a tree drafter reads, straight into lists: greedy_topk's indices and probabilities, bit for bit, and
    torch's answer where the kernel cannot rank a row."""
    from specdecode.sampling import greedy_topk, greedy_topk_lists

    torch.manual_seed(3)
    for vocab in (17, 32784):
        logits = torch.randn(3, vocab) * 3
        logits[1] = torch.round(logits[1])  # many ties
        for k in (1, 2, 3):
            index, prob = greedy_topk(logits, k)
            assert greedy_topk_lists(logits, k) == (index.tolist(), prob.tolist())
    sparse = torch.full((2, 40), float("-inf"))
    sparse[:, 5] = 1.0
    sparse[1, 7] = float("nan")
    index, prob = greedy_topk(sparse, 2)
    assert greedy_topk_lists(sparse, 2)[0] == index.tolist()


def torch_top_p(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """The torch path of to_probs for temperature and top-p: the reference the native kernel must match."""
    from specdecode.sampling import _outside_nucleus

    scaled = logits / temperature
    return scaled.masked_fill(_outside_nucleus(scaled, top_p), float("-inf")).softmax(-1)


def test_top_p_on_the_kernel_keeps_torchs_nucleus_and_probabilities():
    gen = torch.Generator().manual_seed(4)
    peaked = torch.randn(5, 20_000, generator=gen) * 3
    peaked[:, :12] += 10
    peaked[1, 3:7] = float("-inf")  # masked tokens (a grammar, a logit bias) keep no probability
    flat = torch.randn(2, 20_000, generator=gen) * 0.1  # a nucleus of most of the vocabulary: the last floor
    for logits, temperature, top_p in ((peaked, 0.7, 0.9), (peaked, 1.3, 0.5), (flat, 1.0, 0.95)):
        got = cpu_kernels().nucleus_probs(logits, temperature, top_p)
        want = torch_top_p(logits, temperature, top_p)
        assert torch.equal(got > 0, want > 0)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    bad = peaked.clone()
    bad[2, 0] = float("nan")
    assert cpu_kernels().nucleus_probs(bad, 0.7, 0.9).numel() == 0  # to_probs then asks torch


def test_draws_on_the_kernel_follow_the_weights():
    from toy import l1_bound

    from specdecode.sampling import sample

    weights = torch.tensor([[0.1, 0.0, 0.5, 0.4, 0.0], [0.0, 0.0, 3.0, 0.0, 1.0]])  # any scale
    gen, trials = torch.Generator().manual_seed(9), 20_000
    counts = torch.zeros_like(weights, dtype=torch.float64)
    for _ in range(trials):
        for row, token in enumerate(sample(weights, gen).tolist()):
            counts[row, token] += 1
    expected = weights.double() / weights.double().sum(-1, keepdim=True)
    for row in range(2):
        assert counts[row][weights[row] == 0].sum() == 0
        assert (counts[row] / trials - expected[row]).abs().sum() < l1_bound(5, trials)
    assert cpu_kernels().draw_rows(torch.zeros(1, 5), torch.tensor([0.5], dtype=torch.float64)).item() == -1
    assert sample(torch.tensor([0.0, 0.0, 2.0]), gen).item() == 2
