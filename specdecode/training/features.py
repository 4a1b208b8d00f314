"""What the target computes on the training text, once, cached on disk in shards: every drafter trains from it.

Per token: the token id, its loss flag, the target's features (final hidden state, then the inputs of the layers
an EAGLE head reads) in bfloat16, and the target's top-k next-token distribution (ids, log-probabilities) as the
teacher. The target runs as it will at generation time (same weights form and dtype), in prefill mode.

Layout of `DIR/`: `manifest.json` (the settings that made it, the examples done, the shards) and
`shard-NNNN.safetensors`. A shard is written whole, then the manifest: an interrupted run resumes after the last
complete shard and loses at most one shard's work. A cache made with other settings lives in another folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specdecode.errors import SpecdecodeError
from specdecode.models.masks import chain_mask
from specdecode.training.data import Example

TOP_K = 16  # teacher probabilities kept per position: past the 16th the mass left is negligible for a drafter
SHARD_TOKENS = 16384


def feature_layers(num_layers: int) -> tuple[int, ...]:
    """Inputs of a low, a middle and a high layer: what EAGLE-3 fuses (low layers know the tokens, high ones
    the next token)."""
    picks = (min(2, num_layers - 1), num_layers // 2, max(num_layers - 3, 0))
    return tuple(sorted(set(picks)))


@dataclass(slots=True)
class Features:
    """A cache read into memory: N token rows in `seq_starts`-delimited sequences."""

    tokens: torch.Tensor  # [N] int64
    loss: torch.Tensor  # [N] bool: the token is the target's to write
    hidden: torch.Tensor  # [N, d * (1 + len(layers))] bfloat16: final hidden, then the layer inputs
    top_ids: torch.Tensor  # [N, K] int64: the target's K likeliest next tokens after this position
    top_logprobs: torch.Tensor  # [N, K] float32
    seq_starts: list[int]  # sequence i is rows [seq_starts[i], seq_starts[i + 1]); last entry = N
    held: int  # the first `held` sequences are the held-back split
    hidden_size: int

    def sequences(self, held: bool) -> list[tuple[int, int]]:
        spans = list(zip(self.seq_starts[:-1], self.seq_starts[1:]))
        return spans[: self.held] if held else spans[self.held :]


def settings_key(settings: dict) -> str:
    """A short name for a set of settings: equal settings, equal names."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def cache_dir(root: Path, settings: dict) -> Path:
    """A folder per settings (data, budget, target form...), so a cache is only resumed by the same run."""
    return root / f"features-{settings_key(settings)}"


def estimate_bytes(tokens: int, hidden_size: int, num_features: int) -> int:
    """RAM a cache of `tokens` rows takes once read: bfloat16 features + teacher ids/log-probs + token ids."""
    return tokens * (hidden_size * num_features * 2 + TOP_K * 12 + 9)


def check_memory(needed: int, what: str) -> None:
    """Refuse, before the work starts, a run that would not fit in this machine's free memory."""
    available = _available_bytes()
    if available is not None and needed > 0.8 * available:
        raise SpecdecodeError(f"{what} needs ~{needed / 2**30:.1f} GiB of memory and ~{available / 2**30:.1f} GiB "
                              "is free: lower --max-tokens")


def _available_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def build(target: torch.nn.Module, train: list[Example], held: list[Example], folder: Path,
          settings: dict) -> Features:
    """Compute (or resume) the cache for held + train examples in `folder` and read it."""
    folder.mkdir(parents=True, exist_ok=True)
    manifest_path = folder / "manifest.json"
    examples = held + train
    manifest = {"settings": settings, "held": len(held), "examples": len(examples), "done": 0, "shards": []}
    if manifest_path.is_file():
        manifest = json.loads(manifest_path.read_text())
    done = manifest["done"]
    left = examples[done:]
    if left:
        total = sum(len(e.ids) for e in left)
        if done:
            print(f"resuming the target's features after {done} of {len(examples)} examples ({folder})")
        layers = tuple(settings["feature_layers"])
        rows: list[dict[str, torch.Tensor]] = []
        in_shard = 0
        started = time.perf_counter()
        with tqdm(total=total, unit="tok", desc="target features", dynamic_ncols=True) as bar:
            for i, example in enumerate(left, done + 1):
                rows.append(_example_rows(target, example, layers))
                in_shard += len(example.ids)
                bar.update(len(example.ids))
                if in_shard >= SHARD_TOKENS or i == len(examples):
                    name = f"shard-{len(manifest['shards']):04d}.safetensors"
                    _write_shard(folder / name, rows)
                    manifest["shards"].append(name)
                    manifest["done"] = i
                    _write_json(manifest_path, manifest)
                    rows, in_shard = [], 0
        manifest["seconds"] = manifest.get("seconds", 0.0) + time.perf_counter() - started
        _write_json(manifest_path, manifest)
    return read(folder, target.config.hidden_size)


def read(folder: Path, hidden_size: int) -> Features:
    manifest = json.loads((folder / "manifest.json").read_text())
    shards = [load_file(str(folder / name)) for name in manifest["shards"]]
    cat = lambda key: torch.cat([s[key] for s in shards])  # noqa: E731
    lengths = cat("lengths").tolist()
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    return Features(cat("tokens").long(), cat("loss").bool(), cat("hidden"), cat("top_ids").long(),
                    cat("top_logprobs").float(), starts, manifest["held"], hidden_size)


@torch.inference_mode()
def _example_rows(target: torch.nn.Module, example: Example, layers: tuple[int, ...]) -> dict[str, torch.Tensor]:
    ids = torch.tensor(example.ids, device=target.device)
    n = ids.numel()
    cache = target.new_cache(1, n)
    positions = torch.arange(n, device=ids.device)
    _, hidden = target(ids[None], positions[None], cache, chain_mask(0, n, ids.device), logits_from=n - 1,
                       feature_layers=layers)
    hidden = hidden[0]  # [n, d * (1 + layers)]
    d = target.config.hidden_size
    top_ids, top_lp = [], []
    for start in range(0, n, 128):  # the LM head in slices: [128, vocab] float logits at a time
        logits = target.lm_head(hidden[start : start + 128, :d][None])[0].float()
        logits = logits[:, : target.config.vocab_size]
        lp, idx = logits.log_softmax(-1).topk(TOP_K, dim=-1)
        top_ids.append(idx.int())
        top_lp.append(lp.half())
    return {"tokens": ids.int().cpu(), "loss": torch.tensor(example.loss, dtype=torch.uint8),
            "hidden": hidden.to(torch.bfloat16).cpu(), "top_ids": torch.cat(top_ids).cpu(),
            "top_logprobs": torch.cat(top_lp).cpu(), "lengths": torch.tensor([n], dtype=torch.int64)}


def _write_shard(path: Path, rows: list[dict[str, torch.Tensor]]) -> None:
    tensors = {key: torch.cat([r[key] for r in rows]).contiguous() for key in rows[0]}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # a name no other run writes to
    save_file(tensors, str(tmp))
    os.replace(tmp, path)


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, indent=1) + "\n")
    os.replace(tmp, path)
