"""A drafter around another (hybrid around its draft model, a prediction around the request's own drafter): what
the inner drafter needs from the engine, the wrapper needs, and what the engine tells the wrapper reaches it."""

from __future__ import annotations

import torch

from specdecode.drafters.base import DraftContext, Drafter


class Wrapping(Drafter):
    def __init__(self, inner: Drafter) -> None:
        self.inner = inner

    @property
    def feature_layers(self) -> tuple[int, ...]:  # an EAGLE head reads every position's features, copied ones too
        return self.inner.feature_layers

    @property
    def reads_every_position(self) -> bool:
        return self.inner.reads_every_position

    @property
    def cache_bytes_per_token(self) -> int:
        return self.inner.cache_bytes_per_token

    @property
    def target_topk(self) -> int:
        return self.inner.target_topk

    @property
    def proposer(self) -> str:
        return self.inner.proposer

    @property
    def forward_model(self) -> torch.nn.Module | None:
        return self.inner.forward_model

    @property
    def trained_weights(self) -> torch.nn.Module | None:
        return self.inner.trained_weights

    @property
    def forward_s(self) -> float:
        return self.inner.forward_s

    @property
    def drafting_s(self) -> float:
        return self.inner.drafting_s

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
