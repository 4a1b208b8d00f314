"""Prompt lookup where the context repeats, a model elsewhere (the draft model, or a trained EAGLE head): each step
drafts with whichever is expected to make more tokens per second.

Copying is free and, where text repeats (code that reuses its names, an answer rewritten in a second turn), it
guesses long runs right; a draft model costs a forward per guess (~0.4 of the target's on a CPU) but guesses
well everywhere. So the n-gram draft is looked up first, and the planner values it (planner.StepPlan.copy_pays)
through the verify cost curve: its best nodes are expected to make (1 + sum of their scores) tokens in
C(nodes + 1) seconds (the scores: the share of earlier matches through a node times the request's running rate of
accepted copies). The model is valued by its own record in this request, which this drafter keeps: the tokens its
steps made over the seconds they took (its drafting plus the verify forward). The n-gram drafts when its value is
at least the model's. Only matches of two tokens or more are
looked up: a one-token match guesses little better than chance, and the model guesses better there.

The model sits out the steps the n-gram takes. A draft model feeds what it missed in one forward when it drafts
again; that catching up is not charged to its record (the draft model leaves it out of its forward count and
its time per forward). An EAGLE head is handed the target's features of those steps (`sat_out`) and reads them
with the next step's, in its usual catching up.
Which drafter proposes depends only on the context and on past steps, never on a draw of this step, so the
verifier's guarantees hold as for either drafter alone.
"""

from __future__ import annotations

from collections.abc import Generator

import torch

from specdecode.drafters.base import Draft, DraftContext, Drafter
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.eagle import EagleDrafter
from specdecode.drafters.ngram import NgramDrafter
from specdecode.model import Part
from specdecode.planner import FIXED, Record

MIN_NGRAM = 2
NGRAM_BRANCHES = 4  # earlier matches merged into the n-gram's tree, as the ngram method's default tree


class HybridDrafter(Drafter):
    def __init__(self, draft: DraftModelDrafter | EagleDrafter, max_ngram: int = 3) -> None:
        self.draft = draft
        self.ngram = NgramDrafter(max_ngram=max(max_ngram, MIN_NGRAM), min_ngram=MIN_NGRAM, branches=NGRAM_BRANCHES)
        # What the model it wraps needs, it needs: an EAGLE head reads every position's features, copied ones too.
        self.feature_layers = draft.feature_layers
        self.reads_every_position = draft.reads_every_position
        self.reset()

    @property
    def forward_model(self) -> torch.nn.Module | None:  # a draft model's forwards batch across requests, a head's not
        return self.draft.forward_model

    @property
    def trained_weights(self) -> torch.nn.Module | None:
        return self.draft.trained_weights

    @property
    def forward_s(self) -> float:
        return self.draft.forward_s

    @property
    def drafting_s(self) -> float:  # its last draft's cost: the model's when the model drafted, else copying's ~0
        return self.draft.drafting_s if self.used is self.draft else 0.0

    @property
    def cache_bytes_per_token(self) -> int:
        return self.draft.cache_bytes_per_token

    def fork(self) -> HybridDrafter:
        return HybridDrafter(self.draft.fork(), self.ngram.max_ngram)

    def reset(self) -> None:
        self.draft.reset()
        self.ngram.reset()
        self.used: NgramDrafter | DraftModelDrafter | EagleDrafter | None = None
        self.record = Record()  # the model's running tokens and seconds per step in this request
        self.plan = FIXED
        self.nodes = 0  # nodes of its last draft

    def behind(self, tokens: list[int]) -> int:
        return self.draft.behind(tokens)

    def forward_took(self, seconds: float) -> None:
        self.draft.forward_took(seconds)

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        return super().propose(ctx, max_tokens)

    def drafting(self, ctx: DraftContext, max_tokens: int) -> Generator[Part, torch.Tensor, Draft]:
        """`propose` as a generator of the model's forwards (none when the n-gram drafts, nor for a head, which
        runs its own)."""
        self.plan = ctx.plan
        copied = self.ngram.propose(ctx, max_tokens)
        if len(copied) and ctx.plan.copy_pays(copied.scores, max_tokens, self.record):
            self.used = self.ngram
            self.draft.sat_out(ctx)
            draft = copied
        else:
            self.used = self.draft
            if self.draft.forward_model is None:  # a head drafts in its own forwards
                draft = self.draft.propose(ctx, max_tokens)
            else:
                draft = yield from self.draft.drafting(ctx, max_tokens)
        self.nodes = len(draft)
        return draft

    def commit(self, accepted: list[int], verified: list[int] | None = None) -> None:
        if self.used is None:
            return
        self.used.commit(accepted, verified)
        if self.used is self.draft and self.plan.costs is not None:
            rows = 1 + (len(verified) if verified is not None else self.nodes)
            self.record.add(len(accepted) + 1.0, self.plan.step_seconds(self.draft.drafting_s, rows))
