"""Predicted Outputs: the client sends the text it expects (a file it is editing), and the drafter copies it.

The prediction is a copy source aligned with the output. While the output follows it, the next tokens of the
prediction are the draft. When the output leaves it (the edit), the drafter keeps the place it left (the anchor)
and drafts a small tree of guesses at where the output comes back: the prediction from the anchor on (the edit
inserted tokens and is over), from just after it (the edit replaced one token), and from the next place of the
output's last token. A match of two tokens or more of the output's last tokens elsewhere in the prediction moves
the anchor there (the edit deleted or moved text). When the output is back, the edit it made (the tokens it
inserted and removed, after which prediction token) is remembered and guessed again beside the plain copy where
that token comes again: a renamed name is renamed at every use.

Each kind of guess is valued by its own running share of accepted tokens in this request, so a long insertion
soon stops paying for guesses that its end has come. On the prediction, its copy drafts while it beats plain
decoding; off it, the guesses are weighed against the request's own drafter (the method's: hybrid, a draft model,
n-gram...), which drafts while its record in this request (catching up on the copied tokens included) beats plain
decoding.

A copy is valued as hybrid values its n-gram drafts (planner.StepPlan.copy_pays): node i of a guess scores its
kind's rate times the copy rate to the power i. Which one proposes depends on the context and past steps only,
never on a draw of this step, so verification keeps the output exactly the target's.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from dataclasses import dataclass

import numpy as np
import torch

from specdecode.drafters.base import Draft, DraftContext, Drafter
from specdecode.drafters.draft import SatOut
from specdecode.drafters.wrapping import Wrapping
from specdecode.models.parts import Part
from specdecode.planner.estimates import RunningRate
from specdecode.planner.prices import FIXED, Record
from specdecode.planner.tuning import PREDICTION_RETRY_AFTER

MAX_MATCH = 8  # the longest output suffix looked up in the prediction when realigning
NEAR = 64  # a one-token match is a guess only this close after the anchor (one token is ambiguous)
# Each kind of guess starts from a prior (rate, weight: tokens tried), then its record in this request. A
# prediction is usually right while the output follows it; where the output has left it, an edit ends at a given
# step far less often.
PRIORS = {"copy": (0.8, 4.0), "resume": (0.4, 2.0), "replace": (0.25, 2.0), "near": (0.2, 2.0), "replay": (0.6, 2.0)}
MAX_EDIT = 16  # the longest edit (tokens inserted or removed) remembered to be made again


@dataclass(frozen=True)
class Guess:
    kind: str  # copy (on the prediction), resume / replace / near (where an edit may end), replay (an edit again)
    start: int  # the prediction's index of the first token copied after the prefix
    prefix: tuple[int, ...] = ()  # a replayed edit's inserted tokens, drafted first


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
        self.expected = 0  # index in the prediction of the next output token's counterpart (the first: 0)
        self.rates = {kind: RunningRate(rate, weight) for kind, (rate, weight) in PRIORS.items()}  # accepted / shown
        self.accepted = 0  # prediction tokens the target accepted in this request
        self.copied = False  # whether the last draft was copied from the prediction
        self.guesses: list[Guess] = []  # the last draft's guesses
        self.left: tuple[int, int] | None = None  # where the output left the prediction: anchor, output index
        # the edits made so far: (the prediction token before it, *the tokens it removed) -> the tokens it inserted
        self.edits: dict[tuple[int, ...], tuple[int, ...]] = {}
        self.node_at: list[int] = []  # the last copied draft's nodes: each one's index in the prediction
        self.node_guess: list[int] = []  # ... and the guess it belongs to (a node shared by two: the first)
        self.node_token: list[int] = []  # ... its token
        self.node_predicted: list[bool] = []  # ... and whether it is the prediction's (not a replayed edit's)
        self.context: list[int] = []  # the last draft's context (its first context_len tokens)
        self.context_len = 0
        self.record = Record()  # the request's own drafter: tokens and seconds per step, catching up included
        self.used_inner = False  # whether the request's own drafter drafted this step
        self.inner_s = 0.0  # what its last draft took
        self.skipped = 0  # steps decoded plainly since it last drafted
        self.plan = FIXED
        self.nodes = 0

    @property
    def proposer(self) -> str:
        return self.name if self.copied else self.inner.proposer

    def prediction_counts(self) -> tuple[int, int] | None:
        return self.prediction.size, self.accepted

    def rate(self, kind: str) -> float:
        return self.rates[kind].value

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        return super().propose(ctx, max_tokens)

    def drafting(self, ctx: DraftContext, max_tokens: int) -> Generator[Part, torch.Tensor, Draft]:
        self.plan = ctx.plan
        self.context, self.context_len = ctx.tokens, len(ctx.tokens)
        self.guesses = self.guess(ctx.tokens)
        depth = min(max_tokens, ctx.max_depth)
        draft = self.tree(depth, max_tokens) if depth > 0 else None
        # On the prediction, its copy is weighed against plain decoding alone: the own drafter's record may be that
        # of a copier reading the same text from the prompt, and a draft model would first catch up on every copied
        # token. Off it, the guesses are weighed against the own drafter's record.
        on = any(guess.kind == "copy" for guess in self.guesses)
        rival = plain_record(ctx.plan) if on else self.record
        if draft is not None and ctx.plan.copy_pays(draft.scores, max_tokens, rival):
            self.copied, self.nodes = True, len(draft)
            self.inner.hear(SatOut(ctx))
            return draft
        self.copied = False
        self.used_inner = self.inner_pays(ctx)
        if not self.used_inner:  # off the prediction, where the own drafter does not pay: plain decoding
            self.skipped += 1
            self.inner.hear(SatOut(ctx))
            self.nodes = 0
            return Draft.empty()
        began = time.perf_counter()
        draft = yield from self.inner.drafting(ctx, max_tokens)
        self.inner_s = time.perf_counter() - began  # its catching up on the copied tokens included
        self.nodes = len(draft)
        return draft

    def inner_pays(self, ctx: DraftContext) -> bool:
        """Off the prediction: is the request's own drafter worth more than plain decoding? A draft model first
        catches up on every token copied since it last drafted: after a long copied stretch that costs more than
        a target forward (a 0.5B draft model feeds ~100 tokens in about 8), which the few tokens of an edit never
        pay back, so it drafts only when that little behind. Its record here counts its catching up too; benched,
        it is tried again now and then."""
        plan, forward_s = ctx.plan, self.inner.forward_s
        if plan.costs is not None and forward_s > 0.0 and plan.catch_up_too_dear(forward_s,
                                                                                 self.inner.behind(ctx.tokens)):
            return False
        if self.skipped >= PREDICTION_RETRY_AFTER or plan.beats_plain(self.record):
            self.skipped = 0
            return True
        return False

    def guess(self, tokens: list[int]) -> list[Guess]:
        """Where in the prediction the next output token may be, likeliest kind first."""
        p, e = self.prediction, self.expected
        if e < p.size and tokens[-1] == p[e]:  # still on it: the draft goes on from the next token
            self.rejoined(tokens, e)
            self.expected = e + 1
            return [Guess("copy", e + 1), *self.replays(e)]
        moved = self.realign(tokens)
        if moved is not None:  # the output's last tokens are the prediction's somewhere else: a deletion, a move
            self.rejoined(tokens, moved - 1)
            self.expected = moved
            return [Guess("copy", moved), *self.replays(moved - 1)]
        if self.left is None:
            self.left = (e, len(tokens) - 1)
        guesses = [Guess("resume", e), Guess("replace", e + 1)]
        near = np.flatnonzero(p[e : e + NEAR] == tokens[-1])
        if near.size:
            guesses.append(Guess("near", e + int(near[0]) + 1))
        return [g for g in guesses if g.start < p.size]

    def rejoined(self, tokens: list[int], at: int) -> None:
        """The output's last token is the prediction's `at`: if it had left the prediction, remember the edit it
        made (what it removed and inserted, after which token), to guess it again where that token comes again
        (a renamed name, the same hint on a repeated parameter)."""
        if self.left is None:
            return
        anchor, began = self.left
        self.left = None
        out, pred = tokens[began:], self.prediction[anchor : at + 1].tolist()
        if anchor == 0 or at < anchor:  # nothing before it to key the edit on, or the output went back
            return
        common = 0
        while common < min(len(out), len(pred)) and out[-1 - common] == pred[-1 - common]:
            common += 1
        inserted, removed = out[: len(out) - common], pred[: len(pred) - common]
        if inserted and len(inserted) <= MAX_EDIT and len(removed) <= MAX_EDIT:
            self.edits[(int(self.prediction[anchor - 1]), *removed)] = tuple(inserted)

    def replays(self, at: int) -> list[Guess]:
        """The remembered edits that apply after the prediction's `at` (its token, then what they removed)."""
        p, found = self.prediction, []
        if not self.edits:
            return found
        for (before, *removed), inserted in self.edits.items():
            end = at + 1 + len(removed)
            if before == p[at] and end <= p.size and p[at + 1 : end].tolist() == removed:
                found.append(Guess("replay", end, inserted))
        return found

    def realign(self, tokens: list[int]) -> int | None:
        """After the longest (two tokens or more) match of the output's last tokens in the prediction, the first
        at or after the anchor if any: the index the output goes on from there, or None."""
        p = self.prediction
        tail = np.asarray(tokens[-MAX_MATCH:], dtype=np.int64)
        for n in range(min(MAX_MATCH, tail.size, p.size), 1, -1):
            windows = np.lib.stride_tricks.sliding_window_view(p, n)
            starts = np.flatnonzero((windows == tail[-n:]).all(axis=1))
            if starts.size == 0:
                continue
            ahead = starts[starts + n >= self.expected]
            return int(ahead[0] if ahead.size else starts[-1]) + n
        return None

    def tree(self, depth: int, max_tokens: int) -> Draft | None:
        """The guesses' runs of the prediction (after a replayed edit's tokens), `depth` tokens each, merged where
        they agree, as one draft of at most `max_tokens` nodes scored best first; None when there is no guess."""
        p, copy = self.prediction, self.rate("copy")
        tokens, parents, scores, at, owner, predicted = [], [], [], [], [], []
        children: dict[tuple[int, int], int] = {}
        # An edit made again and the prediction as it stands exclude each other: where one is remembered, the copy
        # is right only where the edit is not made again.
        replayed = any(guess.kind == "replay" for guess in self.guesses)
        firsts = {kind: self.rate(kind) for kind in self.rates}
        if replayed:
            firsts["copy"] *= 1.0 - firsts["replay"]
        self.guesses.sort(key=lambda guess: -firsts[guess.kind])  # a node two guesses share scores as the likelier
        for g, guess in enumerate(self.guesses):
            first, parent = firsts[guess.kind], -1
            # a replayed edit's tokens first (not the prediction's: the prediction waits), then the prediction's
            run = [(t, guess.start - 1, False) for t in guess.prefix]
            run += [(int(p[i]), i, True) for i in range(guess.start, min(guess.start + depth, p.size))]
            for i, (token, index, copied) in enumerate(run[:depth]):
                node = children.get((parent, token))
                if node is None:
                    node = children[(parent, token)] = len(tokens)
                    tokens.append(token), parents.append(parent), at.append(index), owner.append(g)
                    scores.append(first * copy**i), predicted.append(copied)
                parent = node
        if not tokens:
            return None
        draft = Draft(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long), None, scores)
        draft = draft.best(max_tokens)
        kept = draft.origin or range(len(tokens))
        self.node_at, self.node_guess = [at[i] for i in kept], [owner[i] for i in kept]
        self.node_token = [tokens[i] for i in kept]
        self.node_predicted = [predicted[i] for i in kept]
        draft.origin = None  # numbered as proposed
        return draft

    def commit(self, accepted: list[int], verified: list[int] | None = None) -> None:
        if self.copied:
            seen = set(range(len(self.node_at)) if verified is None else verified)
            for g, guess in enumerate(self.guesses):  # each guess: its nodes seen, its nodes accepted
                shown = sum(1 for node in seen if self.node_guess[node] == g)
                if shown:
                    hits = sum(1 for node in accepted if self.node_guess[node] == g)
                    self.rates[guess.kind].add(hits, min(hits + 1, shown))
            if accepted:  # the step's last token (the target's own) is expected to follow the last one accepted
                if self.left is not None and self.node_at[accepted[-1]] >= self.left[0]:  # back on the prediction
                    taken = [self.node_token[node] for node in accepted]
                    self.rejoined(self.context[: self.context_len] + taken, self.node_at[accepted[-1]])
                self.expected = self.node_at[accepted[-1]] + 1
            self.accepted += sum(self.node_predicted[node] for node in accepted)
            return
        if any(guess.kind == "copy" for guess in self.guesses):
            self.expected += len(accepted)  # the own drafter's tokens, expected to follow the prediction
        if not self.used_inner:
            return
        self.inner.commit(accepted, verified)
        if self.plan.costs is not None:
            rows = 1 + (len(verified) if verified is not None else self.nodes)
            self.record.add(len(accepted) + 1.0, self.plan.step_seconds(self.inner_s, rows))


def plain_record(plan) -> Record:
    """Plain decoding's record under `plan`: one token per one-row forward (empty without a cost curve)."""
    return Record(1.0, plan.costs.cost(1)) if plan.costs is not None else Record()
