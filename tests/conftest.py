import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests import the toy and tiny model helpers directly
torch.set_num_threads(1)  # tiny models: threads only add wake-up latency


@pytest.fixture
def both_thread_shares():
    """-> run(compute) -> (its result with fixed thread shares, with guided ones), on two threads: the suite runs
    on one (above), where the kernels have nothing to share (kernels.h, run_units)."""
    from specdecode.kernels import cpu_kernels

    kernels = cpu_kernels()

    def run(compute):
        threads = torch.get_num_threads()
        try:
            torch.set_num_threads(2)
            kernels.set_guided_units(False)
            fixed = compute()
            kernels.set_guided_units(True)
            return fixed, compute()
        finally:
            kernels.set_guided_units(True)
            torch.set_num_threads(threads)

    return run


@pytest.fixture
def costs_as_given(monkeypatch):
    """Toy forwards take microseconds: the curve a test gives is the cost model under test, not lowered to them."""
    from specdecode.planner import Planner

    monkeypatch.setattr(Planner, "observe", lambda self, rows, seconds: None)
