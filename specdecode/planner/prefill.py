"""How many prompt rows a step feeds while other requests decode: a waiting prompt's time to first token traded
against the decoding requests' inter-token latency, explicitly.

On a CPU a forward over m rows costs about a + b m once m passes a few dozen (a: reading the weights, b: a row's
arithmetic). Feeding a prompt of P rows in chunks of n costs the decoders the same P b seconds whatever n is (they
wait for the prompt's arithmetic either way); what n changes is how often the weights are read for the prompt
((P / n) a, which the prompt's own time to first token pays, and every request queued behind it) and how long one
gap in the decoders' streams lasts. So a step that feeds a prompt may last up to a cap: PREFILL_STEP_S, or
PREFILL_WAIT_SHARE of the time the oldest waiting prompt has waited so far (the longer it has waited, the longer a
gap it may cause), never fewer rows than PREFILL_ROWS_BUSY and never more than PREFILL_ROWS_IDLE. With nobody
decoding the step is the prompt's alone: PREFILL_ROWS_IDLE.

The price of a prompt row is learned from this engine's own steps (a row attends to every cached token before it,
so rows deep in a long prompt cost more than the measured curve's, which is taken after a short prefix), starting
from the cost curve's slope over its batch sizes.
"""

from __future__ import annotations

from specdecode.planner.budget import CostCurve
from specdecode.planner.estimates import RunningMean
from specdecode.planner.tuning import (
    PREFILL_ROW_WEIGHT,
    PREFILL_ROWS_BUSY,
    PREFILL_ROWS_IDLE,
    PREFILL_STEP_S,
    PREFILL_WAIT_SHARE,
)


class PrefillSizer:
    """The prompt rows of each step (`rows`), and what a prompt row and the decoders' rows cost as steps are timed
    (`observe`)."""

    def __init__(self, busy: int | None = None, idle: int | None = None, step_s: float | None = None,
                 wait_share: float | None = None) -> None:
        """None: tuning.py's value (read here, at construction, so a test can set the module's)."""
        self.busy = PREFILL_ROWS_BUSY if busy is None else busy
        self.idle = PREFILL_ROWS_IDLE if idle is None else idle
        self.step_s = PREFILL_STEP_S if step_s is None else step_s
        self.wait_share = PREFILL_WAIT_SHARE if wait_share is None else wait_share
        if not 1 <= self.busy <= self.idle:
            raise ValueError(f"need 1 <= busy rows <= idle rows, got {self.busy}, {self.idle}")
        self.row_s = RunningMean(PREFILL_ROW_WEIGHT)  # seconds a prompt row adds to a forward, as timed
        self.plain_s = RunningMean(PREFILL_ROW_WEIGHT)  # a forward of the decoders' rows alone, as timed

    def row_seconds(self, costs: CostCurve | None) -> float | None:
        """What one prompt row adds to a forward: as timed here, else the curve's slope past its batch sizes."""
        if self.row_s.value is not None:
            return self.row_s.value
        if costs is None:
            return None
        big = max(self.busy, 2 * len(costs.seconds))
        return max((costs.cost(2 * big) - costs.cost(big)) / big, 1e-6)

    def rows(self, costs: CostCurve | None, decode_rows: int, waited_s: float) -> int:
        """Prompt rows for a step whose decoding requests put about `decode_rows` rows in it (0: nobody decodes),
        the oldest prompt still prefilling having waited `waited_s` seconds since it arrived."""
        if decode_rows == 0:
            return self.idle
        row_s = self.row_seconds(costs)
        if row_s is None:  # nothing timed and no curve: the fixed chunk until a step is timed
            return self.busy
        plain = self.plain_s.value
        if plain is None:
            plain = costs.cost(decode_rows) if costs is not None else 0.0
        cap = max(self.step_s, self.wait_share * waited_s)
        return int(min(self.idle, max(self.busy, (cap - plain) / row_s)))

    def observe(self, prompt_rows: int, forward_s: float) -> None:
        """A forward with `prompt_rows` prompt rows beside the decoders' (0: theirs alone) took `forward_s`."""
        if prompt_rows == 0:
            self.plain_s.add(forward_s)
        elif prompt_rows >= self.busy and self.plain_s.value is not None:
            # a prompt's last few rows say little about a row's price; priced beside what the decoders' rows cost
            self.row_s.add(max(forward_s - self.plain_s.value, 0.0) / prompt_rows)
