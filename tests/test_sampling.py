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
