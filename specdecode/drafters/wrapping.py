"""A drafter around another (hybrid around its draft model, a prediction around the request's own drafter): what
the inner drafter needs from the engine, the wrapper needs, and what the engine tells the wrapper reaches it."""

from __future__ import annotations

from operator import attrgetter

import torch

from specdecode.drafters.base import DraftContext, Drafter


def _inner(name: str) -> property:
    """A capability read from the inner drafter (a wrapper that knows better overrides it)."""
    return property(attrgetter(f"inner.{name}"))


class Wrapping(Drafter):
    def __init__(self, inner: Drafter) -> None:
        self.inner = inner

    feature_layers = _inner("feature_layers")  # an EAGLE head reads every position's features, copied ones too
    reads_every_position = _inner("reads_every_position")
    reads_hidden = _inner("reads_hidden")
    cache_bytes_per_token = _inner("cache_bytes_per_token")
    target_topk = _inner("target_topk")
    proposer = _inner("proposer")
    forward_model = _inner("forward_model")
    trained_weights = _inner("trained_weights")
    forward_s = _inner("forward_s")
    drafting_s = _inner("drafting_s")

    def behind(self, tokens: list[int]) -> int:
        return self.inner.behind(tokens)

    def forward_took(self, seconds: float) -> None:
        self.inner.forward_took(seconds)

    def sat_out(self, ctx: DraftContext) -> None:
        self.inner.sat_out(ctx)

    def saw_target(self, tokens: torch.Tensor, top: torch.Tensor, proposed: list[int] | None = None) -> None:
        self.inner.saw_target(tokens, top, proposed)

    def finished(self, answer: list[int]) -> None:
        self.inner.finished(answer)

    def memories(self) -> list:
        return self.inner.memories()
