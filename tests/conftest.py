import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests import the toy and tiny model helpers directly
torch.set_num_threads(1)  # tiny models: threads only add wake-up latency


@pytest.fixture
def costs_as_given(monkeypatch):
    """Toy forwards take microseconds: the curve a test gives is the cost model under test, not lowered to them."""
    from specdecode.planner import Planner

    monkeypatch.setattr(Planner, "observe", lambda self, rows, seconds: None)
