"""Prompt lookup where the context repeats, a model elsewhere (the draft model, or a trained EAGLE head): each step
drafts with whichever is expected to make more tokens per second.

Copying is free and, where text repeats (code that reuses its names, an answer rewritten in a second turn), it
guesses long runs right; a draft model costs a forward per guess (~0.4 of the target's on a CPU) but guesses
well everywhere. So the n-gram draft is looked up first and valued through the verify cost curve: its best nodes
are expected to make (1 + sum of their scores) tokens in C(nodes + 1) seconds (the scores: the share of earlier
matches through a node times the request's running rate of accepted copies). The model is valued by its own
record in this request: the tokens its steps made over the seconds they took (its drafting plus the verify
forward). The n-gram drafts when its value is at least the model's. Only matches of two tokens or more are
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

from specdecode.drafters.base import Draft, DraftContext
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.eagle import EagleDrafter
from specdecode.drafters.lockstep import run_alone
from specdecode.drafters.ngram import NgramDrafter
from specdecode.model import Part

MIN_NGRAM = 2
NGRAM_BRANCHES = 4  # earlier matches merged into the n-gram's tree, as the ngram method's default tree
PRIOR_SPEEDUP = 1.3  # the model's value before its first step: tokens per one-token forward's time
RECORD_WEIGHT = 0.25  # weight of the newest step in the model's running record
FIXED_MIN_SCORE = 0.5  # without a cost curve: copy when the first copied token is at least this likely


class HybridDrafter:
    def __init__(self, draft: DraftModelDrafter | EagleDrafter, max_ngram: int = 3) -> None:
        self.draft = draft
        self.ngram = NgramDrafter(max_ngram=max(max_ngram, MIN_NGRAM), min_ngram=MIN_NGRAM, branches=NGRAM_BRANCHES)
        self.reset()

    @property
    def model(self) -> torch.nn.Module:  # the batch engine batches the draft model's forwards across requests
        return self.draft.model

    @property
    def forwards_batch(self) -> bool:  # a draft model's forwards batch across requests (lockstep.py), a head's not
        return hasattr(self.draft, "drafting")

    @property
    def reads_hidden(self) -> bool:  # an EAGLE head reads every position's target features, copied ones too
        return getattr(self.draft, "reads_hidden", False)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        return getattr(self.draft, "feature_layers", ())

    @property
    def weights(self) -> torch.nn.Module | None:
        """A trained head's weights (the benchmark counts them); a draft model is counted as the draft."""
        return getattr(self.draft, "weights", None)

    @property
    def shape(self) -> str:
        return self.draft.shape

    def fork(self) -> HybridDrafter:
        return HybridDrafter(self.draft.fork(), self.ngram.max_ngram)

    def reset(self) -> None:
        self.draft.reset()
        self.ngram.reset()
        self.used: NgramDrafter | DraftModelDrafter | EagleDrafter | None = None
        self.record_tokens = self.record_seconds = 0.0  # running means per step of the model (0: no step yet)
        self.costs = None

    def behind(self, tokens: list[int]) -> int:
        return self.draft.behind(tokens) if hasattr(self.draft, "behind") else 0

    def forward_took(self, seconds: float) -> None:
        self.draft.forward_took(seconds)

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        return run_alone(self.drafting(ctx, max_tokens), self.draft.model, self)

    def drafting(self, ctx: DraftContext, max_tokens: int) -> Generator[Part, torch.Tensor, Draft]:
        """`propose` as a generator of draft-model forwards (none when the n-gram or a head drafts), as the draft
        model's."""
        self.costs = ctx.costs
        copied = self.ngram.propose(ctx, max_tokens)
        if len(copied) and self._copy_is_worth_more(copied, max_tokens):
            self.used = self.ngram
            if hasattr(self.draft, "sat_out"):
                self.draft.sat_out(ctx)
            return copied
        self.used = self.draft
        if not self.forwards_batch:  # a head drafts in its own forwards
            return self.draft.propose(ctx, max_tokens)
        return (yield from self.draft.drafting(ctx, max_tokens))

    def commit(self, accepted: list[int], verified: list[int] | None = None) -> None:
        if self.used is None:
            return
        self.used.commit(accepted, verified)
        if self.used is self.draft and self.costs is not None:
            rows = 1 + (len(verified) if verified is not None else len(self.draft.kept))
            seconds = self.draft.drafting_s + self.costs.cost(rows)
            self._record(len(accepted) + 1.0, seconds)

    def _record(self, tokens: float, seconds: float) -> None:
        if self.record_seconds == 0.0:
            self.record_tokens, self.record_seconds = tokens, seconds
            return
        w = RECORD_WEIGHT
        self.record_tokens = (1 - w) * self.record_tokens + w * tokens
        self.record_seconds = (1 - w) * self.record_seconds + w * seconds

    def _copy_is_worth_more(self, copied: Draft, max_tokens: int) -> bool:
        costs = self.costs
        if costs is None:
            return copied.scores[0] >= FIXED_MIN_SCORE
        ranked = sorted(copied.scores, reverse=True)[:max_tokens]
        n = costs.best_count(ranked)
        if n == 0:
            return False
        copy_rate = (1.0 + sum(ranked[:n])) / costs.cost(n + 1)
        if self.record_seconds == 0.0:
            draft_rate = PRIOR_SPEEDUP / costs.cost(1)
        else:
            draft_rate = self.record_tokens / self.record_seconds
        return copy_rate >= draft_rate
