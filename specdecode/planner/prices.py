"""What one request's draft may cost this step: the questions a drafter asks while it proposes (grow one more
depth? is a copy worth more than the model?), answered from the verify cost curve (budget.py) by `StepPlan`, which
the planner hands each drafting request. The unit is tokens per second: keeping the best n nodes of a draft is
expected to emit 1 + (sum of their scores) tokens for what drafting took plus C(rows + n), a verify forward's cost.
"""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.planner.budget import CostCurve
from specdecode.planner.estimates import RunningMean
from specdecode.planner.tuning import COPY_MIN_SCORE, FOLLOW, PREDICTION_CATCH_UP_MAX, PRIOR_SPEEDUP, RECORD_WEIGHT


def catch_up_forward_s(costs: CostCurve, behind: int, one_row_s: float) -> float:
    """One draft forward over `behind` missed tokens: the target's curve scaled to the draft's one-row time."""
    return one_row_s * costs.cost(behind) / costs.cost(1)


def best_count(costs: CostCurve, scores: list[float], draft_seconds: float = 0.0, tokens: float = 1.0,
               rows: int = 1, sunk_rows: int = 0) -> int:
    """How many of the nodes (scores sorted best first) to verify: argmax (1 + sum) / (D + C(n + 1)).
    In a batch the forward also carries `rows` other rows that yield `tokens` tokens without any draft (a
    request's root each), and `sunk_rows` of prompt chunks, paid for whatever is drafted: the nodes then
    cost what they add at that size, C(all + n) - C(all), on top of C(rows)."""
    every = rows + sunk_rows
    plain = draft_seconds + costs.cost(rows)
    best, best_rate, expected = 0, tokens / plain, tokens
    before = costs.cost(every)
    # the prices of every size at once: the loop runs ~900 times a step's worth of nodes, once per draft forward
    for n, (score, price) in enumerate(zip(scores, costs.span(every + 1, len(scores))), start=1):
        expected += score
        rate = expected / (plain + price - before)
        if rate > best_rate:
            best, best_rate = n, rate
    return best


class Record:
    """A drafter's running tokens and seconds per step (hybrid's record of its model)."""

    __slots__ = ("_tokens", "_seconds")

    def __init__(self, tokens: float | None = None, seconds: float | None = None) -> None:
        """A record with no step yet, or one that starts at `tokens` in `seconds`."""
        self._tokens, self._seconds = RunningMean(RECORD_WEIGHT, tokens), RunningMean(RECORD_WEIGHT, seconds)

    @property
    def tokens(self) -> float:
        return self._tokens.value or 0.0

    @property
    def seconds(self) -> float:  # 0: no step yet
        return self._seconds.value or 0.0

    def add(self, tokens: float, seconds: float) -> None:
        self._tokens.add(tokens)
        self._seconds.add(seconds)


@dataclass(frozen=True)
class StepPlan:
    """What one request's draft may cost this step, for the questions its drafter asks while proposing."""

    costs: CostCurve | None = None  # None: a fixed draft size
    others_tokens: float = 0.0  # tokens the other requests' rows yield in the same forward
    others_rows: int = 0  # rows they (and prompt chunks) put in it

    def grow(self, scores: list[float], best_score: float, best_prob: float, spent: float, forward_s: float,
             min_confidence: float, max_tokens: int, follow: float = FOLLOW) -> bool:
        """One more draft forward for a tree whose nodes score `scores`, best new node scoring `best_score` with
        the drafter's confidence `best_prob`, after `spent` seconds of drafting, a forward costing `forward_s`?
        `follow`: P(its best child is accepted | it is)."""
        if self.costs is None:  # fixed size: grow while the drafter is sure of its newest best guess
            return best_prob >= min_confidence
        # One more draft forward adds about best_score * follow expected tokens: its best child, accepted when the
        # node it is fed from is, `follow` of the time (a child never scores above its parent).
        costs = self.costs
        ranked = sorted(scores, reverse=True)[:max_tokens]
        tokens, rows = 1.0 + self.others_tokens, 1 + self.others_rows
        n = best_count(costs, ranked, spent, tokens, rows)
        expected, now = tokens + sum(ranked[:n]), spent + costs.cost(rows + n)
        grown = spent + forward_s + costs.cost(rows + n + 1)
        return (expected + follow * best_score) / grown > expected / now

    def copy_value(self, copy_scores: list[float], max_tokens: int) -> float:
        """What a copied draft (node scores) is worth: tokens per second of verifying its best nodes (0: none
        pay). With a fixed size (no curve): its first node's score."""
        costs = self.costs
        if costs is None:
            return copy_scores[0] if copy_scores else 0.0
        ranked = sorted(copy_scores, reverse=True)[:max_tokens]
        n = best_count(costs, ranked)
        return (1.0 + sum(ranked[:n])) / costs.cost(n + 1) if n else 0.0

    def copy_pays(self, copy_scores: list[float], max_tokens: int, model: Record) -> bool:
        """hybrid: is a copied draft (node scores) worth at least the model's record in this request?"""
        return self.copy_beats(self.copy_value(copy_scores, max_tokens), model)

    def copy_beats(self, copy_value: float, model: Record) -> bool:
        """Is a copied draft worth `copy_value` (as copy_value measures) at least the model's record in this request?"""
        if self.costs is None:
            return copy_value >= COPY_MIN_SCORE
        if copy_value == 0.0:
            return False
        model_rate = PRIOR_SPEEDUP / self.costs.cost(1) if model.seconds == 0.0 else model.tokens / model.seconds
        return copy_value >= model_rate

    def beats_plain(self, record: Record) -> bool:
        """Does a drafter with this record in the request make more tokens per second than plain decoding (yes
        before its first step, or without a cost curve)?"""
        if self.costs is None or record.seconds == 0.0:
            return True
        return record.tokens / record.seconds >= 1.0 / self.costs.cost(1)

    def catch_up_too_dear(self, forward_s: float, behind: int) -> bool:
        """Would a draft model `behind` tokens, at `forward_s` a one-row forward, spend more catching up (one
        forward over those rows, priced as the target's curve scaled to its one-row time) than
        PREDICTION_CATCH_UP_MAX one-row target forwards? Never without a curve."""
        if self.costs is None:
            return False
        return catch_up_forward_s(self.costs, behind, forward_s) > PREDICTION_CATCH_UP_MAX * self.costs.cost(1)

    def step_seconds(self, drafting_s: float, rows: int) -> float:
        """What a drafted step cost: its drafting plus a verify forward over `rows` (0 without a curve)."""
        return drafting_s + self.costs.cost(rows) if self.costs is not None else 0.0


FIXED = StepPlan()
