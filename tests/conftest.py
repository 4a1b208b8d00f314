import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests import the toy and tiny model helpers directly
torch.set_num_threads(1)  # tiny models: threads only add wake-up latency
