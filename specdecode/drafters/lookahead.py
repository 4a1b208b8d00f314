"""Lookahead decoding (Fu et al., ICML 2024) on the one drafter contract: a Jacobi window rides along in the
verify forward, and the n-grams the target endorses on it are drafted when their first token comes up.

Jacobi decoding guesses WINDOW future tokens at once and refines them in parallel: fed a guess y_1..y_W after
the last token, the target's argmax at row j predicts position j + 1 given y_1..y_j, and those predictions are
the next guess. The guess rarely converges whole, but on the way the target endorses n-grams: the NGRAM - 1
tokens ending at row j, then its prediction there. They go to a pool keyed by their first token (the newest
POOL_PER_KEY per key); when the context's last token has n-grams in the pool, they are drafted, merged into a trie
and scored like prompt lookup's copies (ngram.py: share of the n-grams through a node times the running rate).

Here the window is one chain under the root, in the same verify forward as the candidates: the tree mask shows
each row its own chain, so the window needs nothing of the engine but the target's top guesses at every row
(`TargetSaw`), and a window that does converge is accepted like any draft. The window's rows cost verify rows
but yield tokens only later, through the pool: each row is scored at the pool's measured yield (draft tokens
accepted from pool n-grams, over window rows fed), so the planner keeps as many rows as pay on this machine's
cost curve. On a CPU, where rows beyond the eighth cost ~8% of a forward each, that is often none.
"""

from __future__ import annotations

from collections import deque

import torch

from specdecode.drafters.base import Draft, DraftContext, Drafter
from specdecode.drafters.draft import Event, Needs, TargetSaw
from specdecode.drafters.ngram import trie
from specdecode.planner.estimates import RunningRate
from specdecode.planner.tuning import (
    LOOKAHEAD_DECAY,
    LOOKAHEAD_PRIOR_YIELD,
    LOOKAHEAD_YIELD_WEIGHT,
    NGRAM_PRIOR_RATE,
    NGRAM_PRIOR_WEIGHT,
)

WINDOW = 8  # Jacobi guesses fed per step at most (the paper's W; the planner may keep fewer)
NGRAM = 4  # n-grams of this many tokens: a pool hit drafts NGRAM - 1 (the paper's N)
POOL_PER_KEY = 4  # n-grams kept per first token, newest first (the paper's G)


class LookaheadDrafter(Drafter):
    name = "lookahead"

    def __init__(self, window: int = WINDOW, ngram: int = NGRAM, per_key: int = POOL_PER_KEY) -> None:
        self.window, self.ngram, self.per_key = window, ngram, per_key
        self.needs = Needs(target_topk=1)
        self.reset()

    def fork(self) -> LookaheadDrafter:
        return LookaheadDrafter(self.window, self.ngram, self.per_key)

    def reset(self) -> None:
        self.pool: dict[int, deque[tuple[int, ...]]] = {}
        self.guess: list[int] = []  # the Jacobi window: guesses for the positions after the root
        self.rate = RunningRate(NGRAM_PRIOR_RATE, NGRAM_PRIOR_WEIGHT)  # pool candidates, as the n-gram's rate
        # pool tokens accepted per window row fed
        self.yield_ = RunningRate(LOOKAHEAD_PRIOR_YIELD, LOOKAHEAD_YIELD_WEIGHT, LOOKAHEAD_DECAY)
        self.parents: list[int] = []
        self.candidates = 0  # nodes of the last draft from the pool; the window's follow
        self.outputs: dict[int, int] = {}  # window depth -> the target's argmax there, in the last forward
        self.root = -1  # the last draft's root token

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        root = self.root = ctx.tokens[-1]
        if not self.guess:  # start the window from the context: any tokens will do, the target corrects them
            self.guess = (ctx.tokens[-self.window - 1 : -1] or [root]) * self.window
            self.guess = self.guess[: self.window]
        depth = min(max_tokens, ctx.max_depth)
        found = [g[:depth] for g in self.pool.get(root, ())]
        tokens, parents, share = trie(found, max_tokens)
        rate = self.rate.value
        scores: list[float] = []
        for parent, fraction in zip(parents, share):
            scores.append((1.0 if parent < 0 else scores[parent]) * rate * fraction)
        self.candidates = len(tokens)
        row_value = min(1.0, self.yield_.value)  # pool hits go on after the window is cut: rows fed stop
        rows = min(self.window, max_tokens - len(tokens), depth)
        for j in range(rows):  # the window: a chain under the root, each row worth the pool's yield per row
            tokens.append(self.guess[j])
            parents.append(-1 if j == 0 else len(tokens) - 2)
            scores.append(row_value * (1.0 - 1e-3 * j))  # never above its parent's: the planner keeps a prefix
        self.parents = parents
        self.outputs = {}
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), None, scores)

    def hear(self, event: Event) -> None:
        """Keep the target's argmax at each window row it verified (row 0 is the root)."""
        if not isinstance(event, TargetSaw):
            return
        best = event.top[:, 0].tolist()
        nodes = range(len(best) - 1) if event.proposed is None else event.proposed
        for row, node in enumerate(nodes, start=1):
            if node >= self.candidates:
                self.outputs[node - self.candidates + 1] = best[row]
        self.outputs[0] = best[0]

    def commit(self, accepted: list[int], verified: list[int] | None = None) -> None:
        seen = range(len(self.parents)) if verified is None else verified
        window_rows = sum(1 for node in seen if node >= self.candidates)
        from_pool = [node for node in accepted if node < self.candidates]
        # the pool's rate, as the n-gram drafter keeps it: one trial per accepted node with verified candidates
        has_children = {self.parents[i] for i in seen if i < self.candidates}
        on_path = [-1] + from_pool
        for i, node in enumerate(on_path):
            if node in has_children:
                self.rate.add(i + 1 < len(on_path), 1)
        self.yield_.step(len(from_pool), window_rows)
        self._learn(window_rows, len(accepted))

    def _learn(self, rows: int, accepted: int) -> None:
        """The n-grams the target endorsed on the window, then the next Jacobi guess: the target's predictions,
        from where the next root will be."""
        outputs = self.outputs
        chain = [self.root, *self.guess[:rows]]  # chain[j]: the token at depth j under the last root
        for j in range(self.ngram - 2, rows + 1):
            if j in outputs:
                gram = (*chain[j - self.ngram + 2 : j + 1], outputs[j])
                keyed = self.pool.setdefault(int(gram[0]), deque(maxlen=self.per_key))
                if gram[1:] not in keyed:
                    keyed.appendleft(gram[1:])
        predicted = []  # predicted[j]: the target's guess for depth j + 1, given the window up to depth j
        while len(predicted) in outputs and len(predicted) <= rows:
            predicted.append(outputs[len(predicted)])
        if rows:
            fresh = predicted[accepted + 1 :]
            self.guess = (fresh + self.guess[rows:] + self.guess)[: self.window]
