"""The running estimates every cost decision reads, in two kinds:

- `RunningRate`: successes over trials (accepted tokens over promised ones, hits over guesses), from running sums
  in which each step's evidence weighs `decay` less after every later step, beside a prior worth `weight` trials.
  The prior either sits in the sums from the start and fades with them, or is `kept` beside them, so a rate no
  longer fed drifts back to it (and what it governs is tried again).
- `RunningMean`: a value that follows its newest samples (seconds per forward, nodes per step), each new sample
  weighing `weight`; the first sample stands alone unless a starting value is given.
"""

from __future__ import annotations


class RunningRate:
    __slots__ = ("hits", "tried", "decay", "prior_hits", "prior_tried")

    def __init__(self, rate: float, weight: float, decay: float = 1.0, kept: bool = False) -> None:
        """`rate` before any evidence, worth `weight` trials; `decay`: the past's weight at each `fade`."""
        self.decay = decay
        if kept:
            self.hits = self.tried = 0.0
            self.prior_hits, self.prior_tried = rate * weight, weight
        else:
            self.hits, self.tried = rate * weight, weight
            self.prior_hits = self.prior_tried = 0.0

    def fade(self) -> None:
        """One step on: the evidence so far weighs `decay` less."""
        self.hits *= self.decay
        self.tried *= self.decay

    def add(self, hits: float, tried: float) -> None:
        self.hits += hits
        self.tried += tried

    def step(self, hits: float, tried: float) -> None:
        """One step's evidence after the older evidence fades."""
        self.hits = self.decay * self.hits + hits
        self.tried = self.decay * self.tried + tried

    @property
    def value(self) -> float:
        return (self.hits + self.prior_hits) / max(self.tried + self.prior_tried, 1e-9)

    def __repr__(self) -> str:
        return f"RunningRate({self.value:.3f}: {self.hits:.2f}/{self.tried:.2f})"


class RunningMean:
    __slots__ = ("value", "weight")

    def __init__(self, weight: float, value: float | None = None) -> None:
        self.weight = weight
        self.value = value  # None: no sample yet

    def add(self, sample: float) -> float:
        self.value = sample if self.value is None else (1 - self.weight) * self.value + self.weight * sample
        return self.value

    def __repr__(self) -> str:
        return f"RunningMean({self.value})"
