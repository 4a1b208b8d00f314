"""A LoRA adapter on the draft model (`specdecode train draft`), applied to the draft as it runs (any weight
form, GGUF blocks included): y = W x + (alpha / r) B A x on the adapted linear layers. The adapter names the
draft it was trained on (a fingerprint, as trained heads name their target) and the target it was distilled
toward."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from specdecode.errors import SpecdecodeError
from specdecode.weights.store import load

KIND = "draft"


class LoraLinear(nn.Module):
    """A linear layer (float, or on the block kernels) plus its low-rank update."""

    def __init__(self, base: nn.Module, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        super().__init__()
        self.base = base
        self.register_buffer("a", a)  # [r, in]
        self.register_buffer("b", b)  # [out, r]
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        low = (x.to(self.a.dtype) @ self.a.T) @ self.b.T
        return self.base(x) + (self.scale * low).to(x.dtype)


def apply_adapter(model: nn.Module, folder: str | Path, draft_name: str) -> None:
    """Wrap `model`'s adapted layers, in place, after checking the adapter was trained on this draft."""
    meta, tensors = load(folder, KIND, model)
    scale = meta["config"]["alpha"] / meta["config"]["rank"]
    modules = dict(model.named_modules())
    for key in [k for k in tensors if k.endswith(".lora_a")]:
        name = key.removesuffix(".lora_a")
        if name not in modules:
            raise SpecdecodeError(f"{folder}: the adapter names layer '{name}', which draft '{draft_name}' lacks")
        a, b = (tensors[f"{name}.lora_{x}"].float().to(model.device) for x in "ab")
        parent_name, _, child = name.rpartition(".")
        setattr(modules[parent_name], child, LoraLinear(modules[name], a, b, scale))
