"""Prompt lookup (n-gram) drafting: no model, just copying.

If the last n tokens of the context already occurred earlier (in the prompt or in what was generated), guess
that what followed them then follows them now (Saxena 2023, "prompt lookup decoding"; Yang et al. 2023, LLMA).
Longer n-grams are tried first because they predict better; the most recent occurrence wins because generated
text tends to repeat what is near. Drafts are point masses (probs=None).
"""

from __future__ import annotations

import numpy as np
import torch

from specdecode.drafters.base import Draft, DraftContext


class NgramDrafter:
    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def reset(self) -> None:
        pass

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        found = lookup(np.asarray(ctx.tokens, dtype=np.int64), max_tokens, self.max_ngram, self.min_ngram)
        return Draft.chain(torch.from_numpy(found))

    def commit(self, num_accepted: int) -> None:
        pass


def lookup(tokens: np.ndarray, max_tokens: int, max_ngram: int, min_ngram: int) -> np.ndarray:
    """Continuation (up to max_tokens) of the latest earlier match of the longest matching suffix -> [m]."""
    length = tokens.size
    if max_tokens <= 0:
        return tokens[:0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        suffix = tokens[length - n :]
        windows = np.lib.stride_tricks.sliding_window_view(tokens[: length - 1], n)  # [length - n, n]
        starts = np.flatnonzero((windows == suffix).all(axis=1))
        if starts.size:
            follow = starts[-1] + n  # the latest match; its continuation is non-empty as it ends before the suffix
            return tokens[follow : follow + max_tokens].copy()
    return tokens[:0]
