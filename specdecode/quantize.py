"""Weight-only int8 / int4 quantization, applied from outside the model (`quantize_(model, "int4")`).

Decoding is memory-bound: every token reads every weight, so fewer bytes per weight is more tokens per second.
int8: symmetric per output channel. int4: asymmetric in groups of 32 along the input dimension. Activations stay
bfloat16; PyTorch's CPU kernels (`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) do the matmul.
Speculation stays lossless relative to the quantized target: the target that is verified against is this one.
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.errors import SpecdecodeError

MODES = ("none", "int8", "int4")


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # [out, in]
        scales = w.abs().amax(dim=1).clamp_min(1e-8) / 127  # [out]
        self.register_buffer("weight_q", (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(torch.bfloat16))
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.aten._weight_int8pack_mm(x.reshape(-1, shape[-1]), self.weight_q, self.scales)
        out = out.view(*shape[:-1], -1)
        return out + self.bias if self.bias is not None else out


class Int4Linear(nn.Module):
    def __init__(self, linear: nn.Linear, group_size: int = 32) -> None:
        super().__init__()
        out_features, in_features = linear.weight.shape
        w = linear.weight.detach().float().view(out_features, in_features // group_size, group_size)
        low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
        scale = (high - low).clamp_min(1e-8) / 15  # [out, groups, 1]
        q = ((w - low) / scale).round().clamp(0, 15).view(out_features, in_features).to(torch.int32)
        # The kernel computes (q - 8) * scale + zero, so zero is the group's value at q = 8.
        zero = low + 8 * scale
        scales_zeros = torch.stack((scale.squeeze(-1).t(), zero.squeeze(-1).t()), dim=-1)  # [groups, out, 2]
        self.register_buffer("weight_q", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        self.register_buffer("scales_zeros", scales_zeros.to(torch.bfloat16).contiguous())
        self.group_size = group_size
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, shape[-1]), self.weight_q, self.group_size, self.scales_zeros)
        out = out.view(*shape[:-1], -1)
        return out + self.bias if self.bias is not None else out


def quantize_(model: nn.Module, mode: str) -> nn.Module:
    """Replace every nn.Linear of `model` in place (CPU, bfloat16 activations); the embedding stays."""
    if mode not in MODES:
        raise SpecdecodeError(f"unknown quantization '{mode}': choose one of {', '.join(MODES)}")
    if mode == "none":
        return model
    if next(model.parameters()).device.type != "cpu":
        raise SpecdecodeError("--quantize uses PyTorch's CPU kernels: run it with --device cpu")
    make = Int8Linear if mode == "int8" else Int4Linear
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and supported(child, mode):
                setattr(parent, name, make(child))
    return model


def supported(linear: nn.Linear, mode: str) -> bool:
    """The int4 kernel packs 16 output rows and 32-wide groups; odd shapes (tiny test models, some vocab sizes)
    keep their bfloat16 weights rather than failing."""
    out_features, in_features = linear.weight.shape
    return mode == "int8" or (out_features % 16 == 0 and in_features % 32 == 0)
