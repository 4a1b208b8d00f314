"""Token recycling (Luo et al., ACL 2025): the target's own runner-up guesses, kept and drafted again.

Every verify forward computes the target's distribution after each of its rows, and all but the chosen token is
thrown away. This drafter keeps, for every token, the target's K likeliest next tokens the last time that token
was a row (`RecycleTable`: vocab x K int32, ~5 MB for a 152k vocabulary at K = 8), shared by every request of an
engine and kept across them. A draft grows from the last token, best first: a node's children are its token's
row of the table, so the tree follows the target's own recent opinions at no cost but a table read.

Scores (this drafter's estimate that a node is accepted, which the planner ranks): its parent's score times the
rate at which the target accepted a child of that rank whose parent it accepted: this request's own record,
starting from the engine's (every request's, kept with the table). A stale row (recorded after the same token in
another context) is what those rates measure. Drafts are point masses: the verifier treats them as the n-gram's (exact either way).
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from specdecode.drafters.base import Draft, DraftContext, Drafter
from specdecode.drafters.draft import Event, Needs, PassedOver, TargetSaw

TABLE_WIDTH = 8  # next tokens kept per token: the paper's choice; siblings beyond the 4th are rarely kept
PRIOR_RATES = (0.3, 0.1, 0.05, 0.03, 0.02, 0.02, 0.01, 0.01)  # by rank, before any request has a record
PRIOR_WEIGHT = 4.0  # trials the engine's rates are worth beside a request's own
MIN_SCORE = 0.01  # nodes less likely than this are never proposed (the planner would cut them anyway)


class RecycleTable:
    """For each token, the target's `width` likeliest next tokens when it last saw that token (-1: not seen)."""

    def __init__(self, vocab_size: int, width: int = TABLE_WIDTH) -> None:
        self.width = min(width, vocab_size)
        self.next = np.full((vocab_size, self.width), -1, dtype=np.int32)
        # Every request's record by rank: children tried under an accepted parent, and how many were accepted.
        self.tried = np.full(self.width, PRIOR_WEIGHT)
        self.hits = np.array(PRIOR_RATES[: self.width]) * PRIOR_WEIGHT

    @property
    def rates(self) -> np.ndarray:
        return self.hits / self.tried

    def snapshot(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return self.next.copy(), self.tried.copy(), self.hits.copy()

    def restore(self, state: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        self.next[...], self.tried[...], self.hits[...] = state

    def record(self, tokens: torch.Tensor, top: torch.Tensor) -> None:
        """The target's top next tokens [rows, >= width] after each of `tokens` [rows] (later rows win)."""
        ids = tokens.cpu().numpy()
        inside = ids < self.next.shape[0]
        self.next[ids[inside]] = top[:, : self.width].cpu().numpy()[inside]


class RecycleDrafter(Drafter):
    name = "recycle"

    def __init__(self, vocab_size: int, width: int = TABLE_WIDTH, table: RecycleTable | None = None) -> None:
        """`width`: children per node (1 drafts a chain). `table`: shared with the drafter forked from."""
        self.table = table or RecycleTable(vocab_size, TABLE_WIDTH)
        self.width = min(width, self.table.width)
        self.needs = Needs(target_topk=self.table.width)
        self.reset()

    def fork(self) -> RecycleDrafter:
        return RecycleDrafter(self.table.next.shape[0], self.width, self.table)

    def reset(self) -> None:
        self.tried = np.full(self.table.width, PRIOR_WEIGHT)
        self.hits = self.table.rates * PRIOR_WEIGHT
        self.parents: list[int] = []
        self.ranks: list[int] = []

    def memories(self) -> list:
        return [self.table]

    def hear(self, event: Event) -> None:
        if isinstance(event, TargetSaw):
            self.table.record(event.tokens, event.top)
        elif isinstance(event, PassedOver):  # all its commit does is learn, and a draft passed over teaches the same
            self.commit(event.accepted, event.verified)

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        rates = (self.hits / self.tried).tolist()
        rows = self.table.next
        tokens: list[int] = []
        parents: list[int] = []
        self.ranks, scores = [], []
        # Best first: (-score, order, parent node, token, rank, depth); a child is pushed once its parent is in.
        heap: list[tuple[float, int, int, int, int, int]] = []
        pushed = 0

        def push_children(node: int, token: int, score: float, at_depth: int) -> None:
            nonlocal pushed
            if at_depth >= ctx.max_depth or token >= rows.shape[0]:
                return
            for rank, child in enumerate(rows[token, : self.width].tolist()):
                child_score = score * rates[rank]
                if child >= 0 and child_score >= MIN_SCORE:
                    heapq.heappush(heap, (-child_score, pushed, node, child, rank, at_depth + 1))
                    pushed += 1

        push_children(-1, ctx.tokens[-1], 1.0, 0)
        while heap and len(tokens) < max_tokens:
            negative, _, parent, token, rank, at_depth = heapq.heappop(heap)
            tokens.append(token)
            parents.append(parent)
            self.ranks.append(rank)
            scores.append(-negative)
            push_children(len(tokens) - 1, token, -negative, at_depth)
        self.parents = parents
        return Draft(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), None, scores)

    def commit(self, accepted: list[int], verified: list[int] | None = None) -> None:
        # One trial per verified node whose parent the target accepted: was it accepted too? (by its rank)
        on_path = {-1, *accepted}
        taken = set(accepted)
        for node in range(len(self.parents)) if verified is None else verified:
            if self.parents[node] in on_path:
                for record in (self, self.table):
                    record.tried[self.ranks[node]] += 1
                    record.hits[self.ranks[node]] += node in taken

