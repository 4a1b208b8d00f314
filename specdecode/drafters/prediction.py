"""Predicted Outputs: the client sends the text it expects (a file it is editing), and the drafter copies it.

The prediction is a copy source aligned with the output. While the output follows it, the next tokens of the
prediction are the draft; when the output leaves it (the edit), the drafter finds where the output's last tokens
occur in the prediction again (nearest after where it was, since edits move forward) and copies from there.
Where no alignment is found, the request's own drafter (the method's: hybrid, a draft model, n-gram...) drafts,
while its record in this request (catching up on the copied tokens included) beats plain decoding.

A copy is valued as hybrid values its n-gram drafts (planner.StepPlan.copy_pays): node i of a copied run scores
rate^(i+1), with `rate` this request's running share of copied tokens the target accepted, against the record of
the request's own drafter. Which one proposes depends on the context and past steps only, never on a draw of this
step, so verification keeps the output exactly the target's.
"""

from __future__ import annotations

import time
from collections.abc import Generator

import numpy as np
import torch

from specdecode.drafters.base import Draft, DraftContext, Drafter
from specdecode.drafters.wrapping import Wrapping
from specdecode.model import Part
from specdecode.planner import FIXED, Record

MAX_MATCH = 8  # the longest output suffix looked up in the prediction when realigning
NEAR = 64  # a one-token match realigns only this close after the last aligned place (one token is ambiguous)
PRIOR_RATE, PRIOR_WEIGHT = 0.8, 4.0  # a prediction is usually right: 4 copied tokens tried, 3.2 accepted
RETRY_AFTER = 8  # plain steps off the prediction before the request's own drafter is tried again (not swept)


class PredictionDrafter(Wrapping):
    name = "prediction"

    def __init__(self, inner: Drafter, prediction: list[int]) -> None:
        if not prediction:
            raise ValueError("an empty prediction")
        super().__init__(inner)
        self.prediction = np.asarray(prediction, dtype=np.int64)
        self.reset()

    def fork(self) -> PredictionDrafter:
        return PredictionDrafter(self.inner.fork(), self.prediction.tolist())

    def reset(self) -> None:
        self.inner.reset()
        self.expected = 0  # index in the prediction of the last emitted token's counterpart (the first: 0)
        self.start: int | None = None  # where this step's output was expected in the prediction (None: lost)
        self.tried, self.hits = PRIOR_WEIGHT, PRIOR_RATE * PRIOR_WEIGHT
        self.accepted = 0  # prediction tokens the target accepted in this request
        self.copied = False  # whether the last draft was copied from the prediction
        self.record = Record()  # the request's own drafter: tokens and seconds per step, catching up included
        self.used_inner = False  # whether the request's own drafter drafted this step
        self.inner_s = 0.0  # what its last draft took
        self.skipped = 0  # steps decoded plainly since it last drafted
        self.plan = FIXED
        self.nodes = 0

    @property
    def proposer(self) -> str:
        return self.name if self.copied else self.inner.proposer

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        return super().propose(ctx, max_tokens)

    def drafting(self, ctx: DraftContext, max_tokens: int) -> Generator[Part, torch.Tensor, Draft]:
        self.plan = ctx.plan
        at = self.start = self.align(ctx.tokens)
        n = min(max_tokens, ctx.max_depth, self.prediction.size - at) if at is not None else 0
        if n > 0:
            rate = self.hits / self.tried
            scores = [rate ** (i + 1) for i in range(n)]
            if ctx.plan.copy_pays(scores, max_tokens, self.record):
                self.copied, self.nodes = True, n
                self.inner.sat_out(ctx)
                return Draft.chain(torch.from_numpy(self.prediction[at : at + n].copy()), scores=scores)
        self.copied = False
        self.used_inner = self.inner_pays(ctx.plan)
        if not self.used_inner:  # off the prediction, where the own drafter does not pay: plain decoding
            self.skipped += 1
            self.inner.sat_out(ctx)
            self.nodes = 0
            return Draft.empty()
        began = time.perf_counter()
        draft = yield from self.inner.drafting(ctx, max_tokens)
        self.inner_s = time.perf_counter() - began  # its catching up on the copied tokens included
        self.nodes = len(draft)
        return draft

    def inner_pays(self, plan) -> bool:
        """Off the prediction: is the request's own drafter worth more than plain decoding? A draft model first
        catches up on every token copied since it last drafted, so after each copied stretch its draft costs
        more than usual: its record here counts that. Benched, it is tried again now and then."""
        if self.skipped >= RETRY_AFTER or plan.beats_plain(self.record):
            self.skipped = 0
            return True
        return False

    def align(self, tokens: list[int]) -> int | None:
        """Where in the prediction the next output token is expected, or None when the output has left it."""
        p = self.prediction
        if self.expected < p.size and tokens[-1] == p[self.expected]:
            return self.expected + 1  # still on it: the last emitted token was the expected one
        tail = np.asarray(tokens[-MAX_MATCH:], dtype=np.int64)
        for n in range(min(MAX_MATCH, tail.size, p.size), 0, -1):
            windows = np.lib.stride_tricks.sliding_window_view(p, n)
            starts = np.flatnonzero((windows == tail[-n:]).all(axis=1))
            if n == 1:
                starts = starts[(starts >= self.expected) & (starts < self.expected + NEAR)]
            if starts.size == 0:
                continue
            ahead = starts[starts + n >= self.expected]
            start = int(ahead[0] if ahead.size else starts[-1])
            self.expected = start + n - 1
            return start + n
        return None

    def commit(self, accepted: list[int], verified: list[int] | None = None) -> None:
        if self.start is not None:  # the step's last token (the target's own) is expected to be this one
            self.expected = self.start + len(accepted)
        if self.copied:
            seen = self.nodes if verified is None else len(verified)
            self.tried += min(len(accepted) + 1, seen)
            self.hits += len(accepted)
            self.accepted += len(accepted)
            return
        if not self.used_inner:
            return
        self.inner.commit(accepted, verified)
        if self.plan.costs is not None:
            rows = 1 + (len(verified) if verified is not None else self.nodes)
            self.record.add(len(accepted) + 1.0, self.plan.step_seconds(self.inner_s, rows))
