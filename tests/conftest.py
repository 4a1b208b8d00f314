import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests import the toy and tiny model helpers directly
torch.set_num_threads(1)  # tiny models: threads only add wake-up latency


@pytest.fixture
def switch_both_ways():
    """-> run(switch, compute) -> (its result with the kernels' switch off, then on), on two threads: the suite runs
    on one (above), where the kernels have nothing to share. Switches: "guided_units" (kernels.h, run_units),
    "team" (team_cpu.h)."""
    from specdecode.kernels import cpu_kernels

    kernels = cpu_kernels()

    def run(switch, compute):
        threads, turn = torch.get_num_threads(), getattr(kernels, f"set_{switch}")
        try:
            torch.set_num_threads(2)
            turn(False)
            off = compute()
            turn(True)
            return off, compute()
        finally:
            turn(True)
            torch.set_num_threads(threads)

    return run


@pytest.fixture
def costs_as_given(monkeypatch):
    """Toy forwards take microseconds: the curve a test gives is the cost model under test, not lowered to them."""
    from specdecode.planner.planner import Planner

    monkeypatch.setattr(Planner, "observe", lambda self, rows, seconds, *more: None)


@pytest.fixture
def fixed_prefill(monkeypatch):
    """-> chunks(busy=None, idle=None): engines feed prompts in these fixed chunks (rows a step while others decode,
    and while nobody does), not in the planner's timed sizes (planner/prefill.py)."""
    from specdecode.planner import prefill

    def chunks(busy: int | None = None, idle: int | None = None) -> None:
        busy = prefill.PREFILL_ROWS_BUSY if busy is None else busy
        idle = prefill.PREFILL_ROWS_IDLE if idle is None else idle
        monkeypatch.setattr(prefill.PrefillSizer, "rows", lambda self, costs, decode_rows: busy if decode_rows else idle)

    return chunks
