"""How many prompt rows a step feeds while other requests decode: a waiting prompt's time to first token traded
against the decoding requests' inter-token latency, explicitly.

On a CPU a forward over m rows costs about a + b m once m passes a few dozen (a: reading the weights, b: a row's
arithmetic). A step that feeds n prompt rows beside the decoders' rows costs plain + n b, where plain is what their
rows alone cost: the prompt advances at n b / (plain + n b) of the rate it would have alone, and the decoders'
tokens come 1 + n b / plain times slower. So the chunk is the smallest that feeds the prompt at (1 -
PREFILL_OVERHEAD) of its rate alone: n = plain (1 - PREFILL_OVERHEAD) / (PREFILL_OVERHEAD b), at least
PREFILL_ROWS_MIN and at most PREFILL_ROWS_IDLE rows (a GPU's flat curve gives the most). Larger chunks gain the
prompt little and stall the decoders' streams: served 4k-token prompts with steps stretched to a tenth of the
oldest prompt's wait finished later at the median than with 64 rows a step (docs/benchmarks, "Long prompts under
load"). With nobody decoding the step is the prompt's alone: PREFILL_ROWS_IDLE.

The price of a prompt row and of the decoders' rows are learned from this engine's own steps (a row attends to
every cached token before it, so rows deep in a long prompt cost more than the measured curve's, which is taken
after a short prefix), starting from the cost curve.
"""

from __future__ import annotations

from specdecode.planner.budget import CostCurve
from specdecode.planner.estimates import RunningMean
from specdecode.planner.tuning import (
    PREFILL_OVERHEAD,
    PREFILL_ROW_WEIGHT,
    PREFILL_ROWS_BUSY,
    PREFILL_ROWS_IDLE,
    PREFILL_ROWS_MIN,
)


class PrefillSizer:
    """The prompt rows of each step (`rows`), and what a prompt row and the decoders' rows cost as steps are timed
    (`observe`)."""

    def __init__(self, busy: int | None = None, idle: int | None = None, overhead: float | None = None,
                 least: int | None = None) -> None:
        """`busy`: the rows a busy step feeds before anything is timed or known; `idle`: with nobody decoding (and
        the most ever); `overhead`: the share of a busy step the prompt does not get; `least`: the fewest rows of a
        busy step. None: tuning.py's value (read here, at construction, so a test can set the module's)."""
        self.busy = PREFILL_ROWS_BUSY if busy is None else busy
        self.idle = PREFILL_ROWS_IDLE if idle is None else idle
        self.overhead = PREFILL_OVERHEAD if overhead is None else overhead
        self.least = min(PREFILL_ROWS_MIN if least is None else least, self.busy)
        if not 1 <= self.busy <= self.idle:
            raise ValueError(f"need 1 <= busy rows <= idle rows, got {self.busy}, {self.idle}")
        if not 0 < self.overhead < 1:
            raise ValueError(f"the prompt's share of a busy step must be between 0 and 1, got {1 - self.overhead}")
        self.row_s = RunningMean(PREFILL_ROW_WEIGHT)  # seconds a prompt row adds to a forward, as timed
        self.plain_s = RunningMean(PREFILL_ROW_WEIGHT)  # a forward of the decoders' rows alone, as timed

    def row_seconds(self, costs: CostCurve | None) -> float | None:
        """What one prompt row adds to a forward: as timed here, else the curve's slope past its batch sizes."""
        if self.row_s.value is not None:  # a row timed as free (a forward no slower than the decoders' alone)
            return max(self.row_s.value, 1e-9)
        if costs is None:
            return None
        big = max(self.busy, 2 * len(costs.seconds))
        return max((costs.cost(2 * big) - costs.cost(big)) / big, 1e-9)

    def rows(self, costs: CostCurve | None, decode_rows: int) -> int:
        """Prompt rows for a step whose decoding requests put about `decode_rows` rows in it (0: nobody decodes)."""
        if decode_rows == 0:
            return self.idle
        row_s = self.row_seconds(costs)
        plain = self.plain_s.value
        if plain is None and costs is not None:
            plain = costs.cost(decode_rows)
        if row_s is None or plain is None:  # nothing timed and no curve: the fixed chunk until steps are timed
            return self.busy
        rows = plain * (1 - self.overhead) / (self.overhead * row_s)
        return int(min(self.idle, max(self.least, rows)))

    def observe(self, prompt_rows: int, forward_s: float) -> None:
        """A forward with `prompt_rows` prompt rows beside the decoders' (0: theirs alone) took `forward_s`."""
        if prompt_rows == 0:
            self.plain_s.add(forward_s)
        elif prompt_rows >= self.least and self.plain_s.value is not None:
            # a prompt's last few rows say little about a row's price; priced beside what the decoders' rows cost
            self.row_s.add(max(forward_s - self.plain_s.value, 0.0) / prompt_rows)
