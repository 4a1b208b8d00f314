"""Whether a request decoding alone drafts this step: while its drafted steps make at least as many tokens per
second as its plain steps do. The planner's gate weighs requests against each other in a batch; alone, a
drafter's own decisions (grow one more depth, the cut) price each forward, but only once it has drafted: the
draft's first forward and the verify forward's cost at this context are paid whatever it guesses. On long prompts
that cost grows (attention over the cache, for every verified row), and a drafter whose guesses stopped paying
kept drafting, slower than plain decoding.

The record is what the steps took, measured (drafting plus the target forward, on the CPU where forwards are
timed), not what the cost curve predicts. A request whose drafting falls behind its plain rate decodes plainly
for a few steps (timing plain steps at this context), then tries again; each failed retry doubles the wait.
"""

from __future__ import annotations

from specdecode.planner.estimates import RunningRate
from specdecode.planner.tuning import ALONE_BENCH_MAX, ALONE_BENCH_STEPS, ALONE_DECAY, ALONE_MARGIN, ALONE_MIN_STEPS


class AloneRecord:
    """One request's drafted and plain steps while it decodes alone, and whether it drafts next."""

    __slots__ = ("drafted", "plain", "drafted_steps", "bench_left", "wait")

    def __init__(self) -> None:
        self.drafted = RunningRate(0.0, 0.0, ALONE_DECAY)  # tokens over seconds of its drafted steps
        self.plain = RunningRate(0.0, 0.0, ALONE_DECAY)  # tokens over seconds of its plain steps
        self.drafted_steps = 0  # drafted steps since it last started drafting
        self.bench_left = 0  # plain steps left before it tries drafting again
        self.wait = ALONE_BENCH_STEPS  # plain steps after the next loss

    def drafts(self, plain_s: float) -> bool:
        """Draft this step? `plain_s`: a plain step's seconds as the cost curve has it, until steps are timed."""
        if self.bench_left > 0:
            self.bench_left -= 1
            return False
        if self.drafted_steps < ALONE_MIN_STEPS:
            return True
        plain_rate = self.plain.value if self.plain.tried > 0 else 1.0 / plain_s
        if self.drafted.value >= ALONE_MARGIN * plain_rate:
            if self.drafted_steps == ALONE_MIN_STEPS:  # a retry that pays: the next loss waits the least again
                self.wait = ALONE_BENCH_STEPS
            return True
        self.bench_left, self.wait = self.wait - 1, min(2 * self.wait, ALONE_BENCH_MAX)
        self.drafted, self.drafted_steps = RunningRate(0.0, 0.0, ALONE_DECAY), 0  # a retry is judged on its own
        return False

    def add(self, drafted: bool, tokens: int, seconds: float) -> None:
        """A step it took alone: `tokens` emitted in `seconds` (drafting and the target forward)."""
        if drafted:
            self.drafted.step(tokens, seconds)
            self.drafted_steps += 1
        else:
            self.plain.step(tokens, seconds)
