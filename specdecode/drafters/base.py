"""The drafter interface: every way of guessing tokens speaks `propose` and `commit`.

A drafter reads a `DraftContext` (the request's tokens so far, the target's hidden states, a generator) and
returns a `Draft`. After verification the engine calls `commit(num_accepted)` so the drafter can roll its own
state (a draft model's KV cache, a lookup pool) back to the accepted prefix; adaptive drafters learn there too.
Drafters never touch the target's cache, never sample the output and never see the tokenizer.

A chain is a tree whose parents are [-1, 0, 1, ...]; tree drafters fill `parents` freely. `probs=None` means each
token is a point mass (a deterministic guess), which the verifier handles with the same rejection rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from specdecode.config import SamplingParams


@dataclass(slots=True)
class Draft:
    tokens: torch.Tensor  # [n] int64, the root (last committed token) excluded
    parents: torch.Tensor  # [n] int64, index of each token's parent, -1 = root
    probs: torch.Tensor | None = None  # [n, vocab] draft distribution, None = point masses

    @classmethod
    def chain(cls, tokens: torch.Tensor, probs: torch.Tensor | None = None) -> Draft:
        return cls(tokens, torch.arange(-1, tokens.numel() - 1, device=tokens.device), probs)

    @classmethod
    def empty(cls, device: torch.device | str = "cpu") -> Draft:
        return cls.chain(torch.empty(0, dtype=torch.long, device=device))

    def __len__(self) -> int:
        return self.tokens.numel()


@dataclass(slots=True)
class DraftContext:
    tokens: list[int]  # prompt + every emitted token so far; the last one is not yet in the target's cache
    params: SamplingParams  # the request's sampling settings, so draft probabilities match the target's
    generator: torch.Generator | None  # the request's generator (None when greedy)
    hidden: torch.Tensor | None = None  # [T, d] target hidden states of the last step's emitted tokens, if any


class Drafter(Protocol):
    def reset(self) -> None:
        """Forget everything about the previous request."""

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        """Guess up to `max_tokens` tokens that follow `ctx.tokens`."""

    def commit(self, num_accepted: int) -> None:
        """The target kept the first `num_accepted` tokens of the last draft; roll own state to match."""
