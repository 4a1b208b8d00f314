"""Linear layers that read one input, run in one call of the CPU kernels (kernels.run_linears: one parallel region
over all their outputs, the input quantized once per format, each output the bits of its layer's own call): a
mixture of experts' gate and up projections, a DeltaNet layer's two input projections. A call of a kernel costs
~10 us beside its reads; a one-token step of an 80B mixture of experts makes ~60 of them a layer."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from specdecode.kernels import cpu_kernels


def kernel_rows(x: torch.Tensor):
    """The CPU kernels, where x is rows they take as they are ([N, d] contiguous float32, no gradient)."""
    if x.dim() != 2 or x.dtype != torch.float32 or not x.is_cpu or not x.is_contiguous() or torch.is_grad_enabled():
        return None
    return cpu_kernels()


def kernel_ops(layers: Sequence[nn.Module]) -> list | None:
    """The kernel ops of linear layers on the CPU kernels (quantize.py's `op`, whose output is the layer's
    forward's), None unless every one has one."""
    ops = [getattr(layer, "op", None) for layer in layers]
    return ops if all(op is not None for op in ops) else None


def together(x: torch.Tensor, layers: Sequence[nn.Module]) -> list[torch.Tensor]:
    """Each layer's output on x [..., d]: in one kernel call where they all run on the kernels, else one by one."""
    rows = x.reshape(-1, x.shape[-1])
    if (kernels := kernel_rows(rows)) is not None and (ops := kernel_ops(layers)) is not None:
        return [y.view(*x.shape[:-1], -1) for y in kernels.run_linears(rows, ops)]
    return [layer(x) for layer in layers]
