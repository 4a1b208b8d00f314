"""Copying where it pays, a model elsewhere (the draft model, or a trained EAGLE head): each step drafts with
whichever drafter is expected to make the most tokens per second.

Copiers cost well under a millisecond a step: prompt lookup (the request's own text, 2-3 token matches), and in
the `hybrid` method also suffix decoding (the longest match in this request and in earlier answers). Where text repeats they guess long runs right; a draft model
costs a forward per guess (~0.4 of the target's on a CPU) but guesses well everywhere. So every copier looks
first, and the planner values each draft (planner.StepPlan.copy_value) through the verify cost curve: its best
nodes are expected to make (1 + sum of their scores) tokens in C(nodes + 1) seconds, the scores discounted by the
copier's trust in this request (the tokens its drafts gave over what their scores promised). The best copy
drafts when its value is at least the model's record in this request: the tokens its steps made over the
seconds they took (its drafting plus the verify forward). Only matches of two tokens or more are looked up: a
one-token match guesses little better than chance, and the model guesses better there.

Decoding plainly where neither a copy nor the model's record beats plain decoding (benching the model, trying it
again after 8, 16, ... steps) was measured and lost: 0.89x vs 0.97x `none` on five kinds of prompts, 1.02x vs
1.10x on the dev sets (BENCHMARKS.md, "Drafting for free"). The record is too noisy to bench on, and a benched
model misses the stretches where it would pay.

A copier whose draft was passed over still learns from it: at its next look the tokens that followed are known,
and what its draft would have given against them (its nodes no deeper than those tokens, `hindsight`) goes into
its own record (`PassedOver`: the n-gram's rate of accepted guesses). Learning only from the steps it drafts,
a copier whose first guesses were scored low was never taken again, even while it guessed whole lines right (a
function's body repeated with a new name: 16 of 16 copied tokens right, step after step, while the model
drafted). Its trust (`copy_trust`) learns from verified drafts only: judged in hindsight, only as deep as a step's tokens
reach, where copies are right most often, it overrated copies (1.67-1.70x `none` on the dev sets against
1.72-1.77x without; with the record alone 1.73-1.74x against 1.68-1.69x, BENCHMARKS.md).

The model sits out the steps a copier takes. A draft model feeds what it missed in one forward when it drafts
again; that catching up is not charged to its record (the draft model leaves it out of its forward count and
its time per forward). An EAGLE head is handed the target's features of those steps (`SatOut`) and reads them
with the next step's, in its usual catching up.
Which drafter proposes depends only on the context and on past steps, never on a draw of this step, so the
verifier's guarantees hold as for any drafter alone.
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import replace

import torch

from specdecode.drafters.base import Draft, DraftContext, Drafter
from specdecode.drafters.draft import Event, Finished, Needs, PassedOver, SatOut, TargetSaw
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.eagle import EagleDrafter
from specdecode.drafters.ngram import NgramDrafter, share_index
from specdecode.drafters.wrapping import Wrapping
from specdecode.models.parts import Part
from specdecode.planner.estimates import RunningRate
from specdecode.planner.prices import FIXED, Record
from specdecode.planner.tuning import COPY_TRUST_DECAY, COPY_TRUST_PRIOR

MIN_NGRAM = 2
NGRAM_BRANCHES = 4  # earlier matches merged into the n-gram's tree, as the ngram method's default tree


class HybridDrafter(Wrapping):
    def __init__(self, draft: DraftModelDrafter | EagleDrafter, max_ngram: int = 3,
                 others: tuple[Drafter, ...] = (), copy_trees: bool = True) -> None:
        """`others`: more drafters without forwards of their own (suffix, recycle), valued beside the n-gram.
        `copy_trees`: the n-gram merges earlier matches into a tree (False for a target that verifies chains
        only)."""
        super().__init__(draft)
        self.copy_trees = copy_trees
        self.ngram = NgramDrafter(max_ngram=max(max_ngram, MIN_NGRAM), min_ngram=MIN_NGRAM,
                                  branches=NGRAM_BRANCHES if copy_trees else 1)
        self.copiers: tuple[Drafter, ...] = (self.ngram, *others)
        # the model's needs, and the target's top guesses as far as any of its drafters reads them
        self._needs = replace(draft.needs, target_topk=max(d.needs.target_topk for d in (self.draft, *self.copiers)))
        self.reset()

    @property
    def draft(self) -> DraftModelDrafter | EagleDrafter:
        return self.inner

    @property
    def proposer(self) -> str:
        return self.used.proposer if self.used is not None else "none"

    @property
    def drafting_s(self) -> float:  # its last draft's cost: the model's when the model drafted, else copying's ~0
        return self.draft.drafting_s if self.used is self.draft else 0.0

    @property
    def needs(self) -> Needs:  # read every step: made once
        return self._needs

    def hear(self, event: Event) -> None:
        if isinstance(event, TargetSaw):  # recycling learns from every step, whoever proposed
            for drafter in (self.draft, *self.copiers):
                if k := drafter.needs.target_topk:
                    drafter.hear(TargetSaw(event.tokens, event.top[:, :k],
                                           event.proposed if drafter is self.used else None))
        elif isinstance(event, Finished):
            for drafter in (self.draft, *self.copiers):
                drafter.hear(event)
        else:  # its model's forwards, and steps it sat out
            self.draft.hear(event)

    def memories(self) -> list:
        return [m for drafter in (self.draft, *self.copiers) for m in drafter.memories()]

    def fork(self) -> HybridDrafter:
        return HybridDrafter(self.draft.fork(), self.ngram.max_ngram, tuple(d.fork() for d in self.copiers[1:]),
                             self.copy_trees)

    def reset(self) -> None:
        self.draft.reset()
        for copier in self.copiers:
            copier.reset()
        share_index(self.copiers)
        self.used: Drafter | None = None
        self.copied: Draft | None = None  # the best copier's draft this step
        self.trust = {copier: copy_trust() for copier in self.copiers}
        self.record = Record()  # the model's running tokens and seconds per step in this request
        self.plan = FIXED
        self.nodes = 0  # nodes of its last draft
        self.not_taken: list[tuple[Drafter, Draft]] = []  # copiers' drafts not taken at the last look
        self.not_taken_at = 0  # the context's length then

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        return super().propose(ctx, max_tokens)

    def drafting(self, ctx: DraftContext, max_tokens: int) -> Generator[Part, torch.Tensor, Draft]:
        """`propose` as a generator of the model's forwards (none when a copier drafts, nor for a head, which
        runs its own)."""
        self.plan = ctx.plan
        self._learn_in_hindsight(ctx.tokens)
        copier, copied, value = None, None, 0.0
        proposals = []
        for candidate in self.copiers:  # each costs well under a millisecond: all look, the best one is valued
            draft = candidate.propose(ctx, max_tokens)
            if not len(draft):
                continue
            proposals.append((candidate, draft))
            trust = self.trust[candidate].value
            worth = ctx.plan.copy_value([min(1.0, s * trust) for s in draft.scores], max_tokens)
            if worth > value:
                copier, copied, value = candidate, draft, worth
        self.copied = copied
        if copier is not None and ctx.plan.copy_beats(value, self.record):
            self.used = copier
            self.draft.hear(SatOut(ctx))
            draft = copied
        else:
            self.used = self.draft
            if self.draft.needs.forward_model is None:  # a head drafts in its own forwards
                draft = self.draft.propose(ctx, max_tokens)
            else:
                draft = yield from self.draft.drafting(ctx, max_tokens)
        self.nodes = len(draft)
        self.not_taken = [(c, d) for c, d in proposals if c is not self.used]
        self.not_taken_at = len(ctx.tokens)
        return draft

    def _learn_in_hindsight(self, tokens: list[int]) -> None:
        """The copiers' drafts passed over at the last look, against the tokens that followed them since."""
        followed = tokens[self.not_taken_at :]
        if followed:
            for copier, draft in self.not_taken:
                accepted, verified = hindsight(draft, followed)
                if verified:
                    copier.hear(PassedOver(accepted, verified))
        self.not_taken = []

    def commit(self, accepted: list[int], verified: list[int] | None = None) -> None:
        if self.used is None:
            return
        self.used.commit(accepted, verified)
        if self.used is not self.draft:
            seen = range(len(self.copied)) if verified is None else verified
            self.trust[self.used].step(len(accepted), sum(self.copied.scores[i] for i in seen))
        elif self.plan.costs is not None:
            rows = 1 + (len(verified) if verified is not None else self.nodes)
            self.record.add(len(accepted) + 1.0, self.plan.step_seconds(self.draft.drafting_s, rows))


def copy_trust() -> RunningRate:
    """How far a copier's scores can be believed in this request: the tokens its verified drafts gave (hits) over
    the tokens their scores promised (tried), recent steps weighing more; 1 before it has drafted."""
    return RunningRate(1.0, COPY_TRUST_PRIOR, COPY_TRUST_DECAY)


def hindsight(draft: Draft, followed: list[int]) -> tuple[list[int], list[int]]:
    """What a draft would have given against the tokens that `followed` its root: (its accepted path, root to
    leaf; the nodes that can be judged, those no deeper than the tokens known), as `commit` takes them."""
    parents = draft.parent_list
    accepted: list[int] = []
    verified: list[int] = []
    for i, (token, parent, d) in enumerate(zip(draft.token_list, parents, draft.depth_list())):
        if d > len(followed):
            continue
        verified.append(i)
        if parent == (accepted[-1] if accepted else -1) and followed[d - 1] == token:  # extends the path
            accepted.append(i)
    return accepted, verified
