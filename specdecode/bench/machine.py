"""What a benchmark ran on, recorded with its results so numbers from different runs can be compared fairly."""

from __future__ import annotations

import datetime
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from specdecode.kernels import cpu_model, prefetch_hint, simd_flags


def machine_info(device: str, argv: list[str]) -> dict[str, Any]:
    import transformers

    import specdecode

    info = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(argv),
        "cpu": cpu_model(),
        "cpu_flags": simd_flags(),
        "kernel_prefetch": prefetch_hint(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "specdecode": specdecode.__version__,
        "git_commit": git_commit(),
        "gpu": None,
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
        info["cuda"] = torch.version.cuda
    return info


def git_commit() -> str | None:
    """HEAD of the checkout specdecode is imported from, '+dirty' when it has uncommitted changes; None outside git."""
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def command_line() -> list[str]:
    """The process's exact command line, interpreter included (`settings` holds every parsed option too)."""
    return list(getattr(sys, "orig_argv", sys.argv))
