"""A trained drafter's folder: `config.json` (what it is, which target it belongs to) + `model.safetensors`.

The target is identified by a fingerprint of its shape and of weights every form of it keeps in float (the norms):
the same model as a GGUF file, an HF folder or a hub id has one fingerprint, another model another. A head loaded
against a different target is refused with a clear error: it would only guess badly, but silently.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from specdecode.atomic_files import recover_folder, replace_folder, staging_folder
from specdecode.errors import SpecdecodeError
from specdecode.weights.quantize import quantize_

CONFIG, WEIGHTS = "config.json", "model.safetensors"


def target_fingerprint(target: torch.nn.Module) -> str:
    """sha256 (16 hex digits) of the target's shape and its norm weights."""
    config = target.config
    h = hashlib.sha256()
    shape = {k: getattr(config, k, None) for k in ("vocab_size", "hidden_size", "intermediate_size", "num_layers",
                                                     "num_heads", "num_kv_heads", "head_dim")}
    h.update(json.dumps(shape, sort_keys=True).encode())
    for name, p in target.named_parameters():
        if "norm" in name:
            h.update(name.encode())
            # Rounded to bfloat16 first: a float32 copy and a bfloat16 load of the same model agree.
            h.update(p.detach().to(torch.bfloat16).float().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def save(out: Path, kind: str, config: dict[str, Any], tensors: dict[str, torch.Tensor], target: torch.nn.Module,
         target_name: str, extra: dict[str, Any] | None = None) -> None:
    """Write the folder whole under a name of this process's own, then put it in place (atomic_files.py): a run
    killed at any point leaves the old folder or the new one, never weights and a config that do not match."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    recover_folder(out)
    staging = staging_folder(out)
    staging.mkdir()
    meta = {"kind": kind, "target": target_name, "target_fingerprint": target_fingerprint(target),
            "config": config, **(extra or {})}
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(staging / WEIGHTS))
    (staging / CONFIG).write_text(json.dumps(meta, indent=2) + "\n")
    replace_folder(staging, out)


def read_meta(folder: str | Path, kind: str | None = None) -> dict[str, Any]:
    """The folder's config.json, checked to be a `kind` drafter's (None: any kind)."""
    folder = Path(folder)
    recover_folder(folder)
    path = folder / CONFIG
    if not path.is_file():
        raise SpecdecodeError(f"{folder}: no {CONFIG} here; pass the folder `specdecode train {kind or 'KIND'}` "
                              "wrote")
    try:
        meta = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise SpecdecodeError(f"{path}: not valid JSON ({e.msg})") from None
    if not isinstance(meta, dict):
        raise SpecdecodeError(f"{path}: not a drafter's config (a JSON object)")
    if kind is not None and meta.get("kind") != kind:
        raise SpecdecodeError(f"{folder} holds a '{meta.get('kind')}' drafter, not '{kind}': use "
                              f"--method {meta.get('kind')}")
    return meta


def load(folder: str | Path, kind: str, target: torch.nn.Module) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """-> (its config.json, its tensors), after checking it was trained for `target`."""
    folder = Path(folder)
    meta = read_meta(folder, kind)
    check_target(meta, target, folder)
    if not (folder / WEIGHTS).is_file():
        raise SpecdecodeError(f"{folder}: {WEIGHTS} is missing")
    return meta, load_file(str(folder / WEIGHTS))


def load_head(folder: str | Path, kind: str, target: torch.nn.Module,
              build: Callable[[dict[str, Any]], torch.nn.Module]) -> tuple[dict[str, Any], torch.nn.Module]:
    """-> (config.json, the trained module `build(config)` filled with its weights, on the target's device). On a
    CPU its linear layers go to 8-bit blocks: a quarter of the bytes a draft step reads, and the output stays the
    target's (a drafter's precision changes only its guesses)."""
    meta, tensors = load(folder, kind, target)
    module = build(meta["config"])
    module.load_state_dict(tensors)
    module = module.to(target.device).eval()
    if target.device.type == "cpu":
        quantize_(module, "q8_0")
    return meta, module


def check_target(meta: dict[str, Any], target: torch.nn.Module, folder: Path) -> None:
    if meta.get("target_fingerprint") != target_fingerprint(target):
        raise SpecdecodeError(f"{folder} was trained for target '{meta.get('target')}' (fingerprint "
                              f"{meta.get('target_fingerprint')}), not for this one ({target_fingerprint(target)}): "
                              "train one for this target with `specdecode train`")
