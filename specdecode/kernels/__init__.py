"""Native CPU kernels, compiled on first use for the machine they run on and cached.

`cpu_linear()` returns the compiled module (`linear_bf16`, `linear_int8`, `linear_int4`; see linear_cpu.cpp) or
None where it cannot run: no AVX2/FMA, no C++ compiler, or a build error. Callers then fall back to PyTorch's own
kernels, which are correct but neither flat in the number of tokens nor batch-invariant on such CPUs.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import shutil
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("linear_cpu.cpp")


def cpu_has_avx2_fma() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


@functools.cache
def cpu_linear() -> ModuleType | None:
    if not cpu_has_avx2_fma() or shutil.which("c++") is None and shutil.which("g++") is None:
        return None
    from torch.utils import cpp_extension

    from specdecode.hub import cache_dir

    # One build per source version and torch version; the first build takes about a minute.
    flags = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]  # OpenMP: at::parallel_for is inline OpenMP code
    key = hashlib.sha256(SOURCE.read_bytes() + torch.__version__.encode() + str(flags).encode()).hexdigest()[:12]
    build = cache_dir() / "kernels" / key
    build.mkdir(parents=True, exist_ok=True)
    try:
        return cpp_extension.load(
            name=f"specdecode_linear_cpu_{key}", sources=[str(SOURCE)], build_directory=str(build),
            extra_cflags=flags, extra_ldflags=["-fopenmp"], verbose=False,
        )  # fmt: skip
    except Exception as error:  # a missing compiler or headers must not stop generation: fall back, loudly
        log.warning("specdecode: native CPU kernel unavailable (%s); using PyTorch's kernels", error)
        return None
