"""What a drafter hands the engine and what it reads: a `Draft` (tokens, their parents, scores, the distributions
they were drawn from), the `DraftContext` of one step, and the events it may hear (`Drafter.hear`).

A chain is a tree whose parents are [-1, 0, 1, ...]; tree drafters fill `parents` with every parent before its
child. `probs=None` means each token is a point mass (a deterministic guess); otherwise row i is the distribution
node i was drawn from (see verify.py for siblings). `scores[i]` is the drafter's estimate that node i is accepted
(for a draft model, the product of draft probabilities along its path): the planner keeps the best nodes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from specdecode.config import SamplingParams
from specdecode.models.masks import tree_depths
from specdecode.planner.prices import FIXED, StepPlan


class Draft:
    """A drafter's guesses: tokens [n] (the root, the last committed token, excluded), each one's parent [n] (-1 =
    the root), the distributions they were drawn from (`probs` [n, vocab], None = point masses), `scores` [n]
    (estimated P(node accepted), non-increasing from parent to child), and after the engine cut a draft, `origin`:
    each node's index in the drafter's own draft.

    Tokens and parents are held as lists or as tensors, whichever the drafter built, and made into the other on
    first use only: a draft has a few nodes, and between two forwards every tensor made or read back costs ~10 us
    on the caches a forward flushed, where the engine's bookkeeping (cutting, verifying greedily) needs lists."""

    __slots__ = ("_tokens", "_parents", "_token_list", "_parent_list", "device", "probs", "scores", "origin")

    def __init__(self, tokens: torch.Tensor | list[int], parents: torch.Tensor | list[int],
                 probs: torch.Tensor | None = None, scores: list[float] | None = None,
                 origin: list[int] | None = None, device: torch.device | str | None = None) -> None:
        self._tokens, self._token_list = (None, tokens) if isinstance(tokens, list) else (tokens, None)
        self._parents, self._parent_list = (None, parents) if isinstance(parents, list) else (parents, None)
        if device is None:  # where its tensors live: the one given, else a tensor's own, else the CPU
            held = tokens if isinstance(tokens, torch.Tensor) else parents
            device = held.device if isinstance(held, torch.Tensor) else "cpu"
        self.device = torch.device(device)
        self.probs, self.scores, self.origin = probs, scores, origin

    @property
    def tokens(self) -> torch.Tensor:  # [n] int64
        if self._tokens is None:
            self._tokens = torch.tensor(self._token_list, dtype=torch.long, device=self.device)
        return self._tokens

    @property
    def parents(self) -> torch.Tensor:  # [n] int64
        if self._parents is None:
            self._parents = torch.tensor(self._parent_list, dtype=torch.long, device=self.device)
        return self._parents

    @property
    def token_list(self) -> list[int]:
        if self._token_list is None:
            self._token_list = self._tokens.tolist()
        return self._token_list

    @property
    def parent_list(self) -> list[int]:
        if self._parent_list is None:
            self._parent_list = self._parents.tolist()
        return self._parent_list

    @classmethod
    def chain(cls, tokens: torch.Tensor | list[int], probs: torch.Tensor | None = None,
              scores: list[float] | None = None, device: torch.device | str | None = None) -> Draft:
        return cls(tokens, list(range(-1, len(tokens) - 1)), probs, scores, device=device)

    @property
    def is_chain(self) -> bool:
        parents = self.parent_list
        return all(p == i - 1 for i, p in enumerate(parents))

    def check(self) -> None:
        """Assert the shape invariants every drafter must keep (a broken drafter is a programming error)."""
        n = len(self)
        parents = self.parent_list
        assert len(parents) == n, f"{len(parents)} parents for {n} tokens"
        assert all(-1 <= p < i for i, p in enumerate(parents)), f"a parent must come before its child: {parents}"
        assert self.probs is None or self.probs.shape[0] == n, "one draft distribution per token"
        assert self.scores is None or len(self.scores) == n, "one score per token"

    def depth_list(self) -> list[int]:
        """Depth of each node (a child of the root has depth 1)."""
        return list(range(1, len(self) + 1)) if self.is_chain else tree_depths(self.parent_list)

    def within_depth(self, max_depth: int) -> Draft:
        """The nodes at depth <= max_depth (a drafter that ignored DraftContext.max_depth)."""
        if len(self) <= max_depth:
            return self
        depths = self.depth_list()
        if max(depths, default=0) <= max_depth:
            return self
        return self.select([i for i, d in enumerate(depths) if d <= max_depth])

    def best(self, count: int) -> Draft:
        """The `count` nodes with the highest scores (first in draft order on ties), renumbered in draft order.
        Scores never grow from parent to child, so the kept set holds every kept node's ancestors."""
        if count >= len(self):
            return self
        order = sorted(range(len(self)), key=lambda i: (-self.scores[i], i)) if self.scores else range(len(self))
        return self.select(sorted(order[:count]))

    def select(self, kept: list[int]) -> Draft:
        """The nodes `kept` (ascending, every kept node's parent kept too), renumbered in draft order."""
        index = {node: i for i, node in enumerate(kept)}
        parents, tokens = self.parent_list, self.token_list
        probs = None
        if self.probs is not None:
            probs = self.probs[torch.tensor(kept, dtype=torch.long, device=self.probs.device)]
        scores = None if self.scores is None else [self.scores[i] for i in kept]
        origin = [self.origin[i] for i in kept] if self.origin is not None else list(kept)
        return Draft([tokens[i] for i in kept], [index[parents[i]] if parents[i] >= 0 else -1 for i in kept],
                     probs, scores, origin, self.device)

    def as_proposed(self, nodes: list[int]) -> list[int]:
        """Node indices of this draft -> indices in the draft the drafter proposed (what `commit` takes)."""
        return nodes if self.origin is None else [self.origin[i] for i in nodes]

    @classmethod
    def empty(cls, device: torch.device | str = "cpu") -> Draft:
        return cls([], [], device=device)

    def __len__(self) -> int:
        return len(self._token_list) if self._token_list is not None else self._tokens.numel()

    def __repr__(self) -> str:
        return f"Draft(tokens={self.token_list}, parents={self.parent_list}, scores={self.scores})"


@dataclass(slots=True)
class DraftContext:
    tokens: list[int]  # prompt + every emitted token so far; the last one is not yet in the target's cache
    params: SamplingParams  # the request's sampling settings, so draft probabilities match the target's
    generator: torch.Generator | None  # the request's generator (None when greedy)
    # [T, d] target hidden states of the last step's emitted tokens, if any. A drafter whose `Needs.every_position`
    # gets every position it has not seen yet instead (the prompt's first), with its `feature_layers`' inputs.
    hidden: torch.Tensor | None = None
    plan: StepPlan = FIXED  # what this draft may cost: ask it whether to grow, whether to copy
    max_depth: int = 1 << 30  # deeper nodes could not be emitted (the request's token budget is nearly spent)
    # The request's penalties and grammar (rules.OutputRules), None when it has none: a drafter that scores tokens
    # applies them along each node's path, so its guesses follow the same rules the target's are checked under.
    rules: Any = None


@dataclass(frozen=True)
class Needs:
    """What a drafter needs from the engine, declared once (`Drafter.needs`); the default needs nothing."""

    hidden: bool = False  # the target's hidden states in DraftContext.hidden (a trained head); others get None
    every_position: bool = False  # of every position it has not seen yet, not just the last step's (EAGLE)
    feature_layers: tuple[int, ...] = ()  # target layers whose inputs follow the final hidden state
    target_topk: int = 0  # the target's likeliest next tokens after every forward (the TargetSaw event)
    # The model whose forwards `drafting` yields: the engine batches them across requests. None: it drafts without
    # forwards of its own, or runs them itself (`propose`).
    forward_model: torch.nn.Module | None = None
    cache_bytes_per_token: int = 0  # what its own KV cache holds per token of context (in the engine's KV budget)


# --- events: what a drafter may hear besides `commit` (Drafter.hear), one typed value each ---------------------


@dataclass(frozen=True, slots=True)
class TargetSaw:
    """After the target's forward over `tokens` [rows] (the root and the draft nodes it verified, whoever proposed
    them): its `target_topk` likeliest next tokens after each row, `top` [rows, k]. `proposed`: each draft row's
    index in the draft as proposed (the planner may have cut it), None = the same. Heard by a drafter whose
    `target_topk` is above 0 (token recycling, lookahead)."""

    tokens: torch.Tensor
    top: torch.Tensor
    proposed: list[int] | None = None


@dataclass(frozen=True, slots=True)
class PassedOver:
    """Its last draft was not taken (another drafter proposed): what it would have given against the tokens that
    followed, as `commit` takes them, to learn from; its state stays as it is."""

    accepted: list[int]
    verified: list[int]


@dataclass(frozen=True, slots=True)
class SatOut:
    """Another drafter proposed this step in its place (hybrid): what it will need later is in `ctx`."""

    ctx: DraftContext


@dataclass(frozen=True, slots=True)
class Finished:
    """Its request ended with this answer (not cancelled, not failed): a drafter that learns across requests
    (suffix decoding's pool) keeps it, one that holds a cache lends it on."""

    answer: list[int]


@dataclass(frozen=True, slots=True)
class ForwardTook:
    """One of its forwards (its share, when batched with other requests') took `seconds`."""

    seconds: float


Event = TargetSaw | PassedOver | SatOut | Finished | ForwardTook
