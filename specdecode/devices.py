"""Which torch devices this machine can run on, checked before anything is downloaded or converted: a device torch
cannot use otherwise fails only at the first tensor moved there, after gigabytes of converted weights were written."""

from __future__ import annotations

import torch

from specdecode.errors import SpecdecodeError


def available_devices() -> list[str]:
    """The device names that run here: cpu always, cuda (and cuda:N per GPU) and mps where torch has them."""
    names = ["cpu"]
    if torch.cuda.is_available():
        count = torch.cuda.device_count()
        names += ["cuda"] + ([f"cuda:{i}" for i in range(count)] if count > 1 else [])
    if _mps_available():
        names.append("mps")
    return names


def check_device(name: str) -> None:
    """Raise one clear SpecdecodeError unless torch can run on `name` here (naming what it can run on)."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError, ValueError):
        raise SpecdecodeError(f"--device {name}: not a device name; {_offer()}") from None
    if device.type == "cpu":
        return
    if device.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch is a CPU-only build" if torch.version.cuda is None
                   else "torch sees no CUDA GPU here (no GPU, no driver, or CUDA_VISIBLE_DEVICES hides them)")
            raise SpecdecodeError(f"--device {name}: {why}; {_offer()}")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise SpecdecodeError(f"--device {name}: this machine has {torch.cuda.device_count()} CUDA GPU(s); "
                                  f"{_offer()}")
        return
    if device.type == "mps" and _mps_available() and device.index in (None, 0):
        return
    raise SpecdecodeError(f"--device {name}: not available here; {_offer()}")


def _offer() -> str:
    names = available_devices()
    return "this machine runs on cpu only: --device cpu" if names == ["cpu"] else f"use one of {', '.join(names)}"


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return mps is not None and mps.is_available()
