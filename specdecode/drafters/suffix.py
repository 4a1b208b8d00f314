"""Suffix decoding (ArcticInference's method, in vLLM as `suffix`): copy what followed the longest earlier match of
the context's end, in this request's own tokens or in the answers of earlier requests (a `SuffixPool` shared by
every request of an engine), weighting each continuation by how often it occurred.

Where the n-gram drafter looks at three tokens at most and takes a few matches, this one compares up to
suffix_pool.MAX_MATCH tokens and merges every occurrence of the longest match into a trie, so a node's share is
the frequency of its branch; a draft may go deeper the longer the match (SPEC_FACTOR tokens per matched token),
since a long match predicts long runs (agentic loops, code rewritten, a template answered again). Scores and the
running acceptance rate are the n-gram drafter's (ngram.py). When the request ends, its answer joins the pool.
Drafts are point masses; which nodes are proposed depends on the context and the pool, never on a draw.
"""

from __future__ import annotations

import bisect

import numpy as np

from specdecode.drafters.base import DraftContext
from specdecode.drafters.draft import Event, Finished
from specdecode.drafters.ngram import NgramDrafter
from specdecode.drafters.suffix_pool import (
    FEW_CANDIDATES,
    MAX_CANDIDATES,
    MAX_MATCH,
    SuffixPool,
    best_matches,
    best_of_few,
    continuations,
)

MIN_MATCH = 2  # a one-token match guesses little better than chance
SPEC_FACTOR = 2  # draft depth per matched token (not swept)
MAX_CONTINUATIONS = 32  # occurrences merged into one draft (their trie costs Python time)


class SuffixDrafter(NgramDrafter):
    name = "suffix"

    def __init__(self, pool: SuffixPool | None = None, branches: int = MAX_CONTINUATIONS) -> None:
        """`pool`: earlier answers, shared with the drafters forked from this one (None: a fresh 64 MB pool).
        `branches` 1 drafts a chain (the most frequent continuation's run)."""
        # its index: where each token and each pair of tokens occurred in the request (lookup is its own)
        super().__init__(max_ngram=MIN_MATCH, min_ngram=1, branches=branches)
        self.pool = pool if pool is not None else SuffixPool()

    def fork(self) -> SuffixDrafter:
        return SuffixDrafter(self.pool, self.branches)

    def lookup(self, ctx: DraftContext, depth: int) -> list[list[int]]:
        tokens = ctx.tokens
        if len(tokens) < MIN_MATCH or depth <= 0:
            return []
        here, here_len = self._own_matches(tokens)
        # A seeded sampled request must give the same text whatever ran before it: its draft (and so which draws
        # verification takes) may depend on its own context only, not on what the shared pool holds.
        seeded = ctx.params.seed is not None and ctx.params.temperature > 0
        there, there_len = ([], 0) if seeded else self.pool.matches(tokens[-MAX_MATCH:])
        best = max(here_len, there_len)
        if best < MIN_MATCH:
            return []
        depth = min(depth, SPEC_FACTOR * best)
        found = [tokens[p : p + depth] for p in here] if here_len == best else []
        if there_len == best:
            found += continuations(self.pool.flat, there, depth)
        found = found[:MAX_CONTINUATIONS]
        if self.branches == 1 and found:  # a chain: the most frequent first token's most recent run
            firsts = [run[0] for run in found]
            common = max(set(firsts), key=firsts.count)
            found = [run for run in found if run[0] == common][:1]
        return found

    def _own_matches(self, tokens: list[int]) -> tuple[list[int], int]:
        """The positions after the longest earlier matches of the context's end in the context itself, most recent
        first, and that length (0: the last two tokens never occurred together before). Candidates come from the
        bigram index kept up to date as the context grows; a few are compared in Python, many in numpy (each
        numpy call costs tens of microseconds on the caches a forward flushed)."""
        self.index.update(tokens)
        candidates = self.index.follows.get(tuple(tokens[-MIN_MATCH:]), [])  # ascending
        singles = self.index.follows.get((tokens[-1],), [])
        if len(singles) > MAX_CANDIDATES:  # only among the last token's MAX_CANDIDATES latest occurrences
            candidates = candidates[bisect.bisect_left(candidates, singles[-MAX_CANDIDATES]) :]
        if len(candidates) <= FEW_CANDIDATES:
            return best_of_few(tokens, candidates[::-1], tokens[-MAX_MATCH:])
        positions, length = best_matches(np.asarray(tokens, dtype=np.int64), np.asarray(candidates, dtype=np.int64),
                                         np.asarray(tokens[-MAX_MATCH:], dtype=np.int64))
        return positions.tolist(), length

    def memories(self) -> list:
        return [self.pool]

    def hear(self, event: Event) -> None:
        if isinstance(event, Finished):
            self.pool.add(event.answer)
            self.pool.save_soon()
        else:
            super().hear(event)
