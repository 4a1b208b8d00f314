"""Medusa heads (Cai et al. 2024) and the drafter that drafts a static tree with them from the target's last hidden
state (`specdecode train medusa` trains them).

K small heads sit on the target's last hidden state, head k guessing the token k + 2 positions ahead (the target's
own head guesses k + 1). Each head is a residual block, h + SiLU(W h + b), starting as the identity (W = 0); all
share one LM head over a reduced draft vocabulary (`head_tokens`), the target's own rows for those tokens.

Head k proposes its top few tokens for the position k + 1 after the root. Which combinations go into the tree is
fixed once, from the heads' measured accuracy per rank on held-back text (`top_accuracy` in the folder's
config.json): a path's score is the product of its ranks' accuracies, and the best `max_nodes` paths make the tree
(every prefix of a kept path scores at least as high, so the tree is closed under parents). The planner cuts it
further by those scores. Nodes are point masses: verification, greedy or sampled, stays exact whatever the heads
say.
"""

from __future__ import annotations

import heapq
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.drafters.base import Draft, DraftContext, Drafter
from specdecode.drafters.draft import Needs
from specdecode.weights.store import load_head


@dataclass(slots=True)
class MedusaConfig:
    hidden_size: int
    num_heads: int
    draft_vocab: int

    def to_dict(self) -> dict:
        return asdict(self)


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(config.num_heads))
        self.lm_head = nn.Linear(d, config.draft_vocab, bias=False)
        self.register_buffer("head_tokens", torch.zeros(config.draft_vocab, dtype=torch.long))

    @property
    def device(self) -> torch.device:
        return self.head_tokens.device

    def forward(self, hidden: torch.Tensor, head: int) -> torch.Tensor:
        """[T, d] final hidden states -> head `head`'s logits [T, draft_vocab] over `head_tokens`."""
        hidden = hidden.float()
        return self.lm_head(hidden + F.silu(self.blocks[head](hidden))).float()


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


class MedusaDrafter(Drafter):
    name = "medusa"
    needs = Needs(hidden=True)  # its heads read the target's last hidden state

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
        meta, heads = load_head(folder, "medusa", target, lambda config: MedusaHeads(MedusaConfig(**config)))
        return cls(heads, meta["report"]["top_accuracy"], **kwargs)

    @property
    def trained_weights(self) -> torch.nn.Module:
        return self.heads

    def fork(self) -> MedusaDrafter:
        return MedusaDrafter(self.heads, self.accuracy, self.width, self.max_nodes)

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


def _score(accuracy: list[list[float]], path: tuple[int, ...]) -> float:
    score = 1.0
    for k, r in enumerate(path):
        score *= accuracy[k][r]
    return score
