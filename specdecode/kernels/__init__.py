"""Native CPU kernels, compiled on first use for the machine they run on and cached.

`cpu_kernels()` returns the compiled module (`linear_fp32`, `linear_bf16` from linear_cpu.cpp; `linear_quant` from
quant_cpu.cpp; `linear_c16`, `repack_c16` from quant_c16_cpu.cpp
(and `_legacy` from quant_c16_legacy_cpu.cpp); `rms_norm` from norm_cpu.cpp; `decode_attention` from attention_cpu.cpp; `argmax_rows`, `top1_probs`, `topk_probs`, `mask_disallowed` from argmax_cpu.cpp; `nucleus_probs`, `draw_rows` from sample_cpu.cpp; `embedding_rows` from embedding_cpu.cpp; `move_slots` from cache_cpu.cpp;
`DecoderStack`, `DecoderLayer`, `LinearOp`, `DecodeRows`, `TokenEmbedding` from layer_cpu.cpp: a decode forward's
embedding lookup and layers in one call) or
None where it cannot run: no AVX2/FMA, no C++ compiler, or a build error. Callers then fall back to PyTorch's own
kernels, which are correct but neither flat in the number of tokens nor batch-invariant on such CPUs.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import platform
import shutil
import sysconfig
from pathlib import Path
from types import ModuleType

import torch

from specdecode import settings
from specdecode.kernels.build import load_or_build

log = logging.getLogger(__name__)
SOURCES = [Path(__file__).with_name(name) for name in ("linear_cpu.cpp", "linear_bf16_tiles_cpu.cpp", "quant_cpu.cpp", "quant_c16_cpu.cpp", "quant_c16_legacy_cpu.cpp", "norm_cpu.cpp", "attention_cpu.cpp", "activation_cpu.cpp", "argmax_cpu.cpp", "sample_cpu.cpp", "embedding_cpu.cpp", "cache_cpu.cpp", "layer_cpu.cpp", "bindings.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("simd.h", "kernels.h", "layer_cpu.h", "team_cpu.h", "aten_lite.h",
                                                            "amx_tiles.h", "huge_pages.h", "attention_bf16_dots.h")]


def cpuinfo_field(name: str) -> str:
    """The first value of `name` in /proc/cpuinfo ('' where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_model() -> str:
    return cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_flags() -> list[str]:
    return cpuinfo_field("flags").split()


# The flags that decide which kernel paths run: what a speed figure names beside the CPU.
SIMD_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile")


def simd_flags() -> list[str]:
    here = set(cpu_flags())
    return [flag for flag in SIMD_FLAGS if flag in here]


# How the integer kernels ask for the weights ahead of use (_mm_prefetch hints), by the CPU's maker. Measured,
# the 1.5B target's one-token forward, 2 threads: on a Zen 3 EPYC non-temporal was the fastest (BENCHMARKS.md,
# "A step at the speed of memory"); on an Emerald Rapids Xeon it took 77 ms where into L2 (T1) took 42-44 ms
# ("The AMX Xeon is memory-bound after all"). SPECDECODE_PREFETCH (nta, t0, t1, t2) overrides it, to compare.
PREFETCH_HINTS = {"GenuineIntel": "t1"}


def prefetch_hint() -> str:
    return settings.current().prefetch_hint(PREFETCH_HINTS.get(cpuinfo_field("vendor_id"), "nta"))


@functools.cache
def build_key() -> tuple[str, list[str]]:
    """-> (a key naming this build of the kernels, the compiler flags). One build per source version and torch
    version; built for this CPU (-march=native), so keyed by its flags too; and by the compiler (CXX) and the
    Python ABI it is built for. Not by paths (where the sources or the venv are, as this process spells them): a
    finished build is loaded as it is (build.py), wherever it is imported from. Timings cached elsewhere (the
    verify cost curve) use the key too: new kernels are measured again."""
    # at::parallel_for needs OpenMP. No FMA contraction of scalar code: every instantiation of a kernel must round
    # the same way. SPECDECODE_CPU_ARCH (e.g. x86-64-v3, AVX2 only) builds for a lesser CPU: to test the other paths
    # on this one.
    chosen = settings.current()
    flags = [f"-march={chosen.cpu_arch}", "-O3", "-mavx2", "-mfma", "-mf16c", "-funroll-loops", "-ffp-contract=off",
             "-fopenmp", f"-DSPECDECODE_PREFETCH_HINT=_MM_HINT_{prefetch_hint().upper()}"]
    built_for = f"{torch.__version__} {flags} {cpu_flags()} {chosen.compiler} {sysconfig.get_config_var('SOABI')}"
    text = b"".join(path.read_bytes() for path in SOURCES + HEADERS) + built_for.encode()
    return hashlib.sha256(text).hexdigest()[:12], flags


def build_arguments(name: str, build: Path, flags: list[str]) -> dict:
    """torch.utils.cpp_extension.load's arguments for the kernels. The sources' resolved paths: what ninja would
    compare with its last command does not change with how this process reached them (a symlink, PYTHONPATH)."""
    return {"name": name, "sources": [str(path.resolve()) for path in SOURCES], "build_directory": str(build),
            "extra_cflags": flags, "extra_ldflags": ["-fopenmp"], "verbose": False}


@functools.cache
def cpu_kernels() -> ModuleType | None:
    flags_here = cpu_flags()
    if not {"avx2", "fma"} <= set(flags_here) or shutil.which("c++") is None and shutil.which("g++") is None:
        return None
    if shutil.which("ninja") is None:  # the pip-installed ninja lives in the environment, maybe not on PATH
        with contextlib.suppress(ImportError):
            import ninja

            settings.prepend_path(ninja.BIN_DIR)

    key, flags = build_key()
    build = settings.cache_dir() / "kernels" / key
    name = f"specdecode_cpu_kernels_{key}"
    try:
        kernels = load_or_build(build, name, "torch.utils.cpp_extension:load", build_arguments(name, build, flags),
                                "the native CPU kernels for this machine")
    except Exception as error:  # a missing compiler or headers must not stop generation: fall back, loudly
        log.warning("specdecode: native CPU kernel unavailable (%s); using PyTorch's kernels", error)
        return None
    # A/B switches of the same bits (settings.py); AMX's too, but for attention over a bfloat16 cache (its tiles
    # round queries and weights to bfloat16: another output, as on a CPU without AMX)
    switches = settings.current().kernel_switches
    kernels.set_amx(switches.amx)
    kernels.set_bf16_dots(switches.bf16_dots)
    kernels.set_guided_units(switches.guided_units)
    kernels.set_team(switches.team)
    kernels.set_huge_pages(switches.huge_pages)
    return kernels
