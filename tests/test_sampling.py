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
