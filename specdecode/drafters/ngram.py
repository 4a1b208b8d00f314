"""Prompt lookup (n-gram) drafting: no model, just copying.

If the last n tokens of the context already occurred earlier (in the prompt or in what was generated), guess
that what followed them then follows them now (Saxena 2023, "prompt lookup decoding"; Yang et al. 2023, LLMA).
Longer n-grams are tried first because they predict better; the most recent occurrence wins because generated
text tends to repeat what is near. A tree draft takes several matches (longest n-gram first, most recent first)
and merges their continuations into a trie: where the earlier occurrences disagree, the branches become siblings.
Drafts are point masses (probs=None).

Scores (this drafter's estimate that a node is accepted, which the planner ranks): the share of the matches that
pass through the node among those through its parent, times the running rate at which the target accepted an
n-gram guess whose parent it accepted (this request's own record, starting from an even guess).
"""

from __future__ import annotations

import gc
from collections.abc import Sequence

from specdecode.drafters.base import Draft, DraftContext, Drafter
from specdecode.drafters.draft import Event, PassedOver
from specdecode.planner.estimates import RunningRate
from specdecode.planner.tuning import NGRAM_PRIOR_RATE, NGRAM_PRIOR_WEIGHT


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, branches: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.branches = branches  # continuations merged into the draft; 1 drafts a chain
        self.sizes = range(min_ngram, max_ngram + 1)  # the n-grams it matches (its index may hold more)
        self.reset()

    def fork(self) -> NgramDrafter:
        return NgramDrafter(self.max_ngram, self.min_ngram, self.branches)

    def reset(self) -> None:
        self.rate = RunningRate(NGRAM_PRIOR_RATE, NGRAM_PRIOR_WEIGHT)  # children accepted, per node tried
        self.parents: list[int] = []
        self.index = NgramIndex(self.min_ngram, self.max_ngram)

    def lookup(self, ctx: DraftContext, depth: int) -> list[list[int]]:
        """Continuations to merge into the draft, best first, each at most `depth` tokens."""
        return self.index.lookup(ctx.tokens, depth, self.branches, self.sizes)

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        tokens, parents, share = trie(self.lookup(ctx, min(max_tokens, ctx.max_depth)), max_tokens)
        self.parents = parents
        rate = self.rate.value
        scores: list[float] = []
        for parent, fraction in zip(parents, share):
            scores.append((1.0 if parent < 0 else scores[parent]) * rate * fraction)
        return Draft(tokens, parents, None, scores)

    def commit(self, accepted: list[int], verified: list[int] | None = None) -> None:
        # One trial per accepted node that had verified children (and the root): was one of them accepted?
        seen = range(len(self.parents)) if verified is None else verified
        has_children = {self.parents[i] for i in seen}
        on_path = [-1] + accepted
        for i, node in enumerate(on_path):
            if node in has_children:
                self.rate.add(i + 1 < len(on_path), 1)

    def hear(self, event: Event) -> None:
        if isinstance(event, PassedOver):  # all its commit does is learn, and a draft passed over teaches the same
            self.commit(event.accepted, event.verified)


def share_index(drafters: Sequence[object]) -> None:
    """One index of the request's n-grams for every n-gram drafter among `drafters` (hybrid's n-gram and suffix
    copiers): each step indexes the new tokens once, not once per copier (~15 us a step on the caches a forward
    flushed). Call after their `reset`."""
    copiers = [d for d in drafters if isinstance(d, NgramDrafter)]
    if len(copiers) < 2:
        return
    shared = NgramIndex(min(d.sizes.start for d in copiers), max(d.sizes.stop for d in copiers) - 1)
    for drafter in copiers:
        drafter.index = shared


def trie(continuations: Sequence[Sequence[int]], max_tokens: int) -> tuple[list[int], list[int], list[float]]:
    """Merge continuations (best first) into a trie of at most max_tokens nodes, parents before children.
    -> (tokens, parents, share of the parent's continuations that pass through each node)."""
    tokens: list[int] = []
    parents: list[int] = []
    through: list[int] = []  # continuations passing through each node
    child_of: dict[tuple[int, int], int] = {}
    for continuation in continuations:
        node = -1
        for token in continuation:
            key = (node, token)
            if key not in child_of:
                if len(tokens) == max_tokens:
                    break
                child_of[key] = len(tokens)
                tokens.append(token)
                parents.append(node)
                through.append(0)
            node = child_of[key]
            through[node] += 1
    total = len(continuations)
    share = [through[i] / (through[p] if p >= 0 else total) for i, p in enumerate(parents)]
    return tokens, parents, share


BULK = 512  # tokens indexed at once past which the garbage collector waits (a prompt, not a step's few)


class NgramIndex:
    """Where each n-gram of a request's growing token list occurred, kept up to date as the list grows: a lookup
    indexes only the tokens added since the last one (rescanning a 600-token context with numpy each step cost
    ~0.1 ms)."""

    def __init__(self, min_ngram: int, max_ngram: int) -> None:
        self.sizes = range(min_ngram, max_ngram + 1)
        self.follows: dict[tuple[int, ...], list[int]] = {}  # n-gram -> the positions after it, ascending
        self.seen: list[int] = []  # the tokens indexed so far

    def update(self, tokens: list[int]) -> None:
        done = len(self.seen)
        # Not the list it indexed, grown: start again. Its last few tokens stand for the whole list (comparing all of
        # a 32k-token context cost ~0.1 ms a step); a different list that agrees there only drafts worse guesses,
        # which verification drops.
        tail = max(done - 8, 0)
        if len(tokens) < done or tokens[tail:done] != self.seen[tail:]:
            self.follows.clear()
            self.seen = []
            done = 0
        # a position f follows the n-gram tokens[f - n : f] once a token sits there (the match ends before the
        # context's last token). A whole prompt's index is ~100k small objects at 32k tokens: the collector's
        # passes over them took 0.3-0.4 s of an 8k-32k prompt's first lookup, ~0.1 s without them.
        paused = len(tokens) - done > BULK and gc.isenabled()
        if paused:
            gc.disable()
        try:
            for follow in range(max(done, 1), len(tokens)):
                for n in self.sizes:
                    if follow >= n:
                        self.follows.setdefault(tuple(tokens[follow - n : follow]), []).append(follow)
        finally:
            if paused:
                gc.enable()
        self.seen.extend(tokens[done:])

    def lookup(self, tokens: list[int], max_tokens: int, count: int, sizes: range | None = None) -> list[list[int]]:
        """Continuations (up to `max_tokens` each) of up to `count` earlier matches of the context's suffix:
        longest n-gram first (of `sizes`, within the index's; None: all it holds), most recent first, distinct
        ones only."""
        if max_tokens <= 0:
            return []
        self.update(tokens)
        length, found, seen = len(tokens), [], set()
        for n in reversed(sizes or self.sizes):
            if n > length - 1:
                continue
            for follow in reversed(self.follows.get(tuple(tokens[length - n :]), ())):
                continuation = tokens[follow : follow + max_tokens]
                if (key := tuple(continuation)) not in seen:
                    seen.add(key)
                    found.append(continuation)
                    if len(found) == count:
                        return found
        return found
