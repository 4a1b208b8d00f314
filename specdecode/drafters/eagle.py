"""An EAGLE head drafts a dynamic tree from the target's own features (trained/eagle.py; `specdecode train eagle`).

The head keeps its own one-layer KV cache over the committed context: row i holds the target's features at
position i with the token at i + 1. Each step it first catches up on the rows the target computed since (the
engine hands over every new position's features: `reads_hidden`), whose last row, the root's, predicts the first
draft token. Deeper nodes have no target features yet: each is fed with its parent's output hidden state, as the
head was trained (the unrolled training-time test). The tree grows best nodes first, cut by the machine's verify
cost curve, as a draft model's does (tree_growth.py). Nodes live in cache slots after the context; `commit` drops
them all: the accepted tokens come back next step with the target's true features. A step it sits out (another
drafter proposed, as in `hybrid-eagle`) hands it that step's features (`sat_out`), read at the next catching up.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from specdecode.drafters.base import Draft, DraftContext
from specdecode.drafters.tree_growth import GrowsTrees, Node
from specdecode.trained import store
from specdecode.trained.eagle import EagleConfig, EagleHead, target_embeddings

TREE_WIDTH = 4  # children per expanded node: a head's second and third guesses are often right
TREE_EXPAND = 2  # nodes of a depth fed on: a head forward is cheap next to the target's


class EagleDrafter(GrowsTrees):
    reads_hidden = True  # every position's target features, not just the last step's (sequence.py)

    def __init__(self, head: EagleHead, target: torch.nn.Module, feature_layers: tuple[int, ...],
                 width: int = TREE_WIDTH, expand: int = TREE_EXPAND, max_depth: int = 8,
                 min_confidence: float = 0.3) -> None:
        self.model = head
        self.target = target
        self.feature_layers = tuple(feature_layers)  # the engines have the target return their inputs
        self.width, self.expand, self.max_depth = width, expand, max_depth
        self.min_confidence = min_confidence
        self.vocab_size = target.config.vocab_size
        self.cache = None
        self.base_length = 0
        self.root_hidden: torch.Tensor | None = None  # [1, d] the head's output at the root's row
        self.nodes: list[Node] = []
        self.kept: list[int] = []
        self.hidden_of: dict[int, torch.Tensor] = {}  # fed node -> its output hidden state [d]
        self.pending: torch.Tensor | None = None  # target features of steps it sat out, not yet read
        self.forward_s = 0.0
        self.drafting_s = 0.0  # what its last draft took, catching up included (it catches up every step)

    @classmethod
    def load(cls, folder: str | Path, target: torch.nn.Module, **kwargs) -> EagleDrafter:
        meta, head = store.load_head(folder, "eagle", target, lambda config: EagleHead(EagleConfig(**config)))
        return cls(head, target, tuple(meta["feature_layers"]), **kwargs)

    @property
    def weights(self) -> torch.nn.Module:
        """The trained head (what the benchmark counts as this drafter's weights)."""
        return self.model

    @property
    def shape(self) -> str:
        return "tree" if self.width > 1 else "chain"

    def fork(self) -> EagleDrafter:
        return EagleDrafter(self.model, self.target, self.feature_layers, self.width, self.expand, self.max_depth,
                            self.min_confidence)

    def reset(self) -> None:
        if self.cache is not None:
            self.cache.reset()
        self.nodes, self.kept, self.base_length, self.root_hidden, self.pending = [], [], 0, None, None

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        if max_tokens <= 0:
            return Draft.empty(self.model.device)
        started = time.perf_counter()
        self._catch_up(ctx)
        logits = self.model.logits(self.root_hidden)  # [1, draft vocab]
        self.hidden_of = {}
        growth = self._grow_tree(logits, ctx, max_tokens, started, lambda expand, nodes: (expand, nodes))
        try:
            expand, nodes = next(growth)
            while True:  # the head's own forwards, one depth each
                began = time.perf_counter()
                logits = self._feed(expand, nodes)
                self.forward_took(time.perf_counter() - began)
                expand, nodes = growth.send(logits)
        except StopIteration as done:
            self.drafting_s = time.perf_counter() - started
            return done.value

    def sat_out(self, ctx: DraftContext) -> None:
        """Another drafter proposed this step: keep the features handed over, for the next catching up."""
        if ctx.hidden is not None:
            self.pending = ctx.hidden if self.pending is None else torch.cat((self.pending, ctx.hidden))

    def commit(self, accepted: list[int], verified: list[int] | None = None) -> None:
        # Draft nodes were fed with the head's own hidden states; the accepted ones come back next step with
        # the target's features, so every node's row goes.
        if self.cache is not None:
            self.cache.truncate(self.base_length)

    def _catch_up(self, ctx: DraftContext) -> None:
        """Feed the context rows the head lacks: positions [cache.length, len(tokens) - 1)."""
        head, target = self.model, self.target
        needed = len(ctx.tokens) + self.max_depth * self.expand + 1
        if self.cache is None or self.cache.max_len < needed:
            self._grow(needed)
        start, end = self.cache.length, len(ctx.tokens) - 1
        if end <= start:  # nothing new since the last draft (cannot happen in the engine: the root is new)
            return
        d = target.config.hidden_size
        rows = ctx.hidden  # [rows, d * num_features]: final hidden state, then the feature layers' inputs
        if self.pending is not None:
            rows = self.pending if rows is None else torch.cat((self.pending, rows))
            self.pending = None
        if rows is None or rows.shape[0] != end - start:  # features missing (should not happen): zeros stand in
            fill = torch.zeros(end - start, head.config.num_features * d, device=head.device)
            if rows is not None:
                take = min(rows.shape[0], end - start)
                fill[end - start - take :] = rows[rows.shape[0] - take :]
            rows = fill
        ids = torch.tensor(ctx.tokens[start + 1 : end + 1], device=head.device)
        embeds = target_embeddings(target)(ids[None])[0]
        positions = torch.arange(start, end, device=head.device)
        mask = torch.ones(end - start, end, dtype=torch.bool, device=head.device).tril(start)
        out = head.step(embeds, head.fuse(rows), positions, self.cache, mask)
        self.cache.truncate(end)
        self.base_length = end
        self.root_hidden = out[-1:]

    def _feed(self, expand: list[int], nodes: list[Node]) -> torch.Tensor:
        """One head forward over the nodes `expand` (one depth), each seeing the context and its ancestors;
        -> their logits [len(expand), draft vocab]."""
        head = self.model
        start = self.cache.length
        ids, positions, mask = self._place(expand, nodes, start, self.base_length, head.device)
        parents = [self.root_hidden[0] if nodes[i].parent < 0 else self.hidden_of[nodes[i].parent] for i in expand]
        embeds = target_embeddings(self.target)(ids[None])[0]
        out = head.step(embeds, torch.stack(parents), positions, self.cache, mask)
        self.cache.truncate(start + len(expand))
        for row, i in enumerate(expand):
            self.hidden_of[i] = out[row]
        return head.logits(out)

    def _grow(self, needed: int) -> None:
        if self.cache is None:
            self.cache = self.model.new_cache(max(needed, 1024), self.model.device)
        else:
            self.cache.grow(max(needed, 2 * self.cache.max_len))
