"""Weight formats for CPU linear layers, applied from outside the model (`quantize_(model, "int4")`).

Decoding is memory-bound: every token reads every weight, so fewer bytes per weight is more tokens per second.
On CPU every linear layer runs through the native kernel (`kernels/linear_cpu.cpp`) with its weights stored as
  none: the model's own dtype (float32 or bfloat16, no copy)
  int8: symmetric, one scale per output row
  int4: asymmetric groups of 32 along the input (scale and min per group, the form of GGUF's Q4_K blocks)
The kernel keeps a verify forward over k + 1 tokens nearly as cheap as a one-token forward and computes every row
exactly as a one-token forward would, so speculation is lossless relative to the target as quantized here.
Without the kernel (CUDA, CPUs without AVX2) `none` keeps PyTorch's nn.Linear and int8/int4 are refused.
"""

from __future__ import annotations

import torch
from torch import nn

from specdecode.errors import SpecdecodeError
from specdecode.kernels import cpu_kernels

MODES = ("none", "int8", "int4")
GROUP = 32  # int4 group size along the input dimension


class KernelLinear(nn.Module):
    """nn.Linear on the native CPU kernel; activations of any float dtype, float32 accumulation."""

    def __init__(self, linear: nn.Linear, mode: str, kernels) -> None:
        super().__init__()
        self.bias = linear.bias
        weight = linear.weight.detach()  # [out, in]
        if mode == "none":
            self.format = "fp32" if weight.dtype == torch.float32 else "bf16"
            self.weight = linear.weight  # the same Parameter: tied embeddings stay tied, nothing is copied
            self.tensor_names = ("weight",)
        elif mode == "int8":
            self.format = "int8"
            w = weight.float()
            scales = w.abs().amax(dim=1).clamp_min(1e-8) / 127  # [out]
            self.register_buffer("weight_q", (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8))
            self.register_buffer("scales", scales)
            self.tensor_names = ("weight_q", "scales")
        else:
            self.format = "int4"
            packed, scales, mins = pack_int4(weight.float())
            self.register_buffer("weight_q", packed)
            self.register_buffer("scales", scales)
            self.register_buffer("mins", mins)
            self.tensor_names = ("weight_q", "scales", "mins")
        self.linear = getattr(kernels, f"linear_{self.format}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        weights = [getattr(self, name) for name in self.tensor_names]
        out = self.linear(x.reshape(-1, shape[-1]).float().contiguous(), *weights)  # [M, out] float32
        out = out.view(*shape[:-1], -1).to(x.dtype)
        return out + self.bias if self.bias is not None else out


def pack_int4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[out, in] float32 -> (packed uint8 [out, in / 2], scales [out, in / 32], mins [out, in / 32]) with
    w ~= q * scale + min, q in 0..15. In each group byte j holds q[j] (low nibble) and q[j + 16] (high)."""
    out_features, in_features = w.shape
    groups = w.view(out_features, in_features // GROUP, GROUP)
    low, high = groups.amin(-1), groups.amax(-1)  # [out, groups]
    scale = (high - low).clamp_min(1e-8) / 15
    q = ((groups - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.uint8)
    packed = q[..., : GROUP // 2] | (q[..., GROUP // 2 :] << 4)  # [out, groups, 16]
    return packed.reshape(out_features, in_features // 2).contiguous(), scale.contiguous(), low.contiguous()


def quantize_(model: nn.Module, mode: str) -> nn.Module:
    """Put every nn.Linear of a CPU `model` on the native kernel, in `mode`'s weight format, in place."""
    if mode not in MODES:
        raise SpecdecodeError(f"unknown quantization '{mode}': choose one of {', '.join(MODES)}")
    on_cpu = next(model.parameters()).device.type == "cpu"
    kernels = cpu_kernels() if on_cpu else None
    if kernels is None:
        if mode == "none":
            return model
        where = "this CPU (it needs AVX2, FMA and a C++ compiler)" if on_cpu else "CUDA"
        raise SpecdecodeError(f"--quantize {mode} uses specdecode's CPU kernel, which is not available on {where}")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and supported(child, mode):
                setattr(parent, name, KernelLinear(child, mode, kernels))
    return model


def supported(linear: nn.Linear, mode: str) -> bool:
    """The kernel reads the input dimension 8 floats (int4: a 32-wide group) at a time and stores float32 or
    bfloat16 as they are; other shapes and dtypes keep nn.Linear."""
    if mode == "none" and linear.weight.dtype not in (torch.float32, torch.bfloat16):
        return False
    return linear.weight.shape[1] % (GROUP if mode == "int4" else 8) == 0
