"""Medusa heads draft a static tree from the target's last hidden state (trained/medusa.py; `specdecode train
medusa`).

Head k proposes its top few tokens for the position k + 1 after the root. Which combinations go into the tree is
fixed once, from the heads' measured accuracy per rank on held-back text (`top_accuracy` in the folder's
config.json): a path's score is the product of its ranks' accuracies, and the best `max_nodes` paths make the tree
(every prefix of a kept path scores at least as high, so the tree is closed under parents). The engine's budget
chooser cuts it further by those scores. Nodes are point masses: verification, greedy or sampled, stays exact
whatever the heads say.
"""

from __future__ import annotations

import heapq
from pathlib import Path

import torch

from specdecode.drafters.base import Draft, DraftContext
from specdecode.trained import store
from specdecode.trained.medusa import MedusaConfig, MedusaHeads

MAX_NODES = 24  # the static tree's size before the budget cut; a CPU rarely verifies more than 16


def static_tree(accuracy: list[list[float]], max_nodes: int) -> list[tuple[int, ...]]:
    """Rank paths (r_1, ..., r_m): r_k = which guess of head k) -> the `max_nodes` likeliest, parents first."""
    paths: list[tuple[float, tuple[int, ...]]] = []
    frontier = [(-accuracy[0][r], (r,)) for r in range(len(accuracy[0]))] if accuracy else []
    heapq.heapify(frontier)
    while frontier and len(paths) < max_nodes:
        neg, path = heapq.heappop(frontier)
        paths.append((-neg, path))
        if len(path) < len(accuracy):
            for r, acc in enumerate(accuracy[len(path)]):
                heapq.heappush(frontier, (neg * acc, (*path, r)))
    return [p for _, p in sorted(paths, key=lambda item: (len(item[1]), item[1]))]


class MedusaDrafter:
    def __init__(self, heads: MedusaHeads, accuracy: list[list[float]], width: int | None = None,
                 max_nodes: int = MAX_NODES) -> None:
        self.heads = heads
        self.accuracy = [row[:width] if width else row for row in accuracy]
        self.width = width
        self.max_nodes = max_nodes
        self.tree = static_tree(self.accuracy, max_nodes)
        self.scores = [_score(self.accuracy, p) for p in self.tree]
        index = {p: i for i, p in enumerate(self.tree)}
        self.parents = [index.get(p[:-1], -1) for p in self.tree]

    @classmethod
    def load(cls, folder: str | Path, target: torch.nn.Module, **kwargs) -> MedusaDrafter:
        meta, heads = store.load_head(folder, "medusa", target, lambda config: MedusaHeads(MedusaConfig(**config)))
        return cls(heads, meta["report"]["top_accuracy"], **kwargs)

    @property
    def weights(self) -> torch.nn.Module:
        """The trained head (what the benchmark counts as this drafter's weights)."""
        return self.heads

    @property
    def shape(self) -> str:
        return "chain" if self.width == 1 else "tree"

    def fork(self) -> MedusaDrafter:
        return MedusaDrafter(self.heads, self.accuracy, self.width, self.max_nodes)

    def reset(self) -> None:
        pass

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        if max_tokens <= 0 or ctx.hidden is None or not self.tree:
            return Draft.empty(self.heads.device)
        hidden = ctx.hidden[-1:, : self.heads.config.hidden_size]  # the position before the root
        ranks = max(len(row) for row in self.accuracy)
        guesses = torch.stack([self.heads.head_tokens[self.heads(hidden, k)[0].topk(ranks).indices]
                               for k in range(len(self.accuracy))]).tolist()  # [heads, ranks] target ids
        kept = [i for i, p in enumerate(self.tree) if len(p) <= ctx.max_depth]
        draft = Draft(torch.tensor([guesses[len(p) - 1][p[-1]] for p in self.tree], device=self.heads.device),
                      torch.tensor(self.parents, device=self.heads.device), None, list(self.scores))
        draft = draft.select(kept) if len(kept) < len(self.tree) else draft
        return draft.best(max_tokens)

    def commit(self, accepted: list[int], verified: list[int] | None = None) -> None:
        pass  # no state: the next draft reads the target's newest hidden state


def _score(accuracy: list[list[float]], path: tuple[int, ...]) -> float:
    score = 1.0
    for k, r in enumerate(path):
        score *= accuracy[k][r]
    return score
