"""A drafter around another (hybrid around its draft model, a prediction around the request's own drafter): what
the inner drafter needs from the engine, the wrapper needs, and what the engine tells the wrapper reaches it."""

from __future__ import annotations

from operator import attrgetter

from specdecode.drafters.base import Drafter
from specdecode.drafters.draft import Event


def _inner(name: str) -> property:
    """A capability read from the inner drafter (a wrapper that knows better overrides it)."""
    return property(attrgetter(f"inner.{name}"))


class Wrapping(Drafter):
    def __init__(self, inner: Drafter) -> None:
        self.inner = inner

    needs = _inner("needs")  # an EAGLE head reads every position's features, copied ones too
    proposer = _inner("proposer")
    trained_weights = _inner("trained_weights")
    forward_s = _inner("forward_s")
    drafting_s = _inner("drafting_s")

    def behind(self, tokens: list[int]) -> int:
        return self.inner.behind(tokens)

    def hear(self, event: Event) -> None:
        self.inner.hear(event)

    def memories(self) -> list:
        return self.inner.memories()
