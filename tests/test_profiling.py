"""The native layer's profiling hooks (scripts/profile_step.py): stage timers that add up, and the probes."""

import pytest
import torch
from tiny import tiny_native

from specdecode.kernels import cpu_kernels
from specdecode.models.masks import chain_mask
from specdecode.weights.quantize import quantize_

kernels = cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="the native CPU kernel needs AVX2, FMA and a C++ compiler")


def test_layer_stages_are_timed_only_while_profiling():
    model = quantize_(tiny_native("qwen2", seed=1), "q8_0")
    cache = model.new_cache(1, 16)

    def decode_step():
        with torch.inference_mode():
            cache.truncate(4)
            model(torch.tensor([[5]]), torch.tensor([[4]]), cache, chain_mask(4, 1), decode=True)

    with torch.inference_mode():
        model(torch.tensor([[1, 2, 3, 4]]), torch.arange(4)[None], cache, chain_mask(0, 4), decode=True)
    kernels.set_layer_profiling(True)
    decode_step()
    decode_step()
    stages = dict(kernels.layer_profile())
    kernels.set_layer_profiling(False)
    assert stages.pop("calls") == 2 * model.config.num_layers
    assert {"q k v", "attention", "gate up", "down"} <= set(stages) and all(s >= 0 for s in stages.values())
    assert sum(stages.values()) > 0
    decode_step()  # off: nothing more is counted
    assert dict(kernels.layer_profile())["calls"] == 0


def test_probes_measure_something():
    assert 0 < kernels.parallel_region_seconds(10) < 0.01
    assert kernels.read_seconds(torch.ones(1 << 16)) > 0
    assert kernels.int8_dot_peak_ops(10000) > 0  # the integer kernels' peak a prompt's forward is measured against
    with pytest.raises(RuntimeError, match="multiple of 64"):
        kernels.read_seconds(torch.ones(100))
