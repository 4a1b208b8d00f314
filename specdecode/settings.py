"""The process's settings from the environment: the one module that reads it. The CLI and the server build a
`Settings` here and pass its values down; library code asks `current()` only where a value has no caller to come
from (the cache folder, the native kernels' build).

    SPECDECODE_CACHE        where models, converted weights, built kernels and cost curves go (~/.cache/specdecode)
    SPECDECODE_CUDA_GRAPHS  0: a lone request's forwards on a GPU run eagerly, not replayed as CUDA graphs
    SPECDECODE_GRAPH_ROWS   1: attention one row at a time inside the graphs (bit-stable verify rows, slower)
    SPECDECODE_PREFETCH     nta, t0, t1 or t2: the kernels' prefetch hint instead of the CPU maker's default
    SPECDECODE_CPU_ARCH     the kernels' -march (e.g. x86-64-v3, to run the AVX2 paths on a larger CPU)
    SPECDECODE_API_KEY      the server's API key when --api-key is not given
    CXX                     the compiler torch builds the kernels with (c++ if unset; another one builds its own copy)
    SPECDECODE_AMX, SPECDECODE_GUIDED_UNITS, SPECDECODE_TEAM, SPECDECODE_HUGE_PAGES
                            0: that kernel path off (the same bits either way: to compare speed; docs/bench.md)
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from specdecode.errors import SpecdecodeError

PREFETCH_HINTS = ("nta", "t0", "t1", "t2")


@dataclass(frozen=True)
class KernelSwitches:
    """The native kernels' A/B switches, applied when they load; each has a setter there to flip it later."""

    amx: bool = True  # AMX tile products where the CPU has them (attention over a bfloat16 cache: other bits)
    guided_units: bool = True  # a linear layer's units shared out as threads free up (False: fixed shares)
    team: bool = True  # a decode forward's layers in one parallel region
    huge_pages: bool = True  # repacked weights in 2 MB pages
    # attention over a bfloat16 cache in AVX-512 BF16 dot products where AMX does not run (off: the float path's bits)
    bf16_dots: bool = True


@dataclass(frozen=True)
class Settings:
    cache_dir: Path
    cuda_graphs: bool = True
    graph_rows: bool = False
    prefetch: str | None = None  # None: the CPU maker's default (kernels.PREFETCH_HINTS)
    cpu_arch: str = "native"
    api_key: str | None = None
    compiler: str = "c++"  # as torch.utils.cpp_extension reads CXX: the build key names it
    kernel_switches: KernelSwitches = KernelSwitches()

    def prefetch_hint(self, default: str) -> str:
        """The kernels' prefetch hint: the one set, checked, else `default` (asked where the kernels are built)."""
        if self.prefetch is None:
            return default
        if self.prefetch not in PREFETCH_HINTS:
            raise SpecdecodeError(f"SPECDECODE_PREFETCH={self.prefetch!r}: use one of {', '.join(PREFETCH_HINTS)} "
                                  "(or leave it unset)")
        return self.prefetch


def from_env(environ: Mapping[str, str] | None = None) -> Settings:
    env = os.environ if environ is None else environ
    return Settings(
        cache_dir=Path(env.get("SPECDECODE_CACHE") or Path.home() / ".cache" / "specdecode"),
        cuda_graphs=env.get("SPECDECODE_CUDA_GRAPHS", "1") != "0",
        graph_rows=env.get("SPECDECODE_GRAPH_ROWS", "0") == "1",
        prefetch=env.get("SPECDECODE_PREFETCH") or None,
        cpu_arch=env.get("SPECDECODE_CPU_ARCH") or "native",
        api_key=env.get("SPECDECODE_API_KEY") or None,
        compiler=env.get("CXX", "c++"),
        kernel_switches=KernelSwitches(*(env.get(f"SPECDECODE_{name}", "1") != "0"
                                         for name in ("AMX", "GUIDED_UNITS", "TEAM", "HUGE_PAGES", "BF16_DOTS"))),
    )


_chosen: Settings | None = None


def current() -> Settings:
    """The settings `use` chose, else the environment's as it is now."""
    return _chosen if _chosen is not None else from_env()


def use(settings: Settings | None) -> None:
    """Run with these settings from now on (None: the environment's again)."""
    global _chosen
    _chosen = settings


def cache_dir() -> Path:
    """Root of everything specdecode downloads or converts."""
    return current().cache_dir


def prepend_path(folder: str) -> None:
    """Put `folder` first on PATH for the programs this process starts (the pip-installed ninja)."""
    os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")
