"""The gated MLP's product silu(g) * u, shared by the dense MLP (model.py) and each expert (experts.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdecode.kernels import cpu_kernels


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u. On the CPU in float32 (not training) the native kernel the native layers apply, so a forward
    through this loop gives their bits."""
    if (g.dtype == torch.float32 and g.is_cpu and g.shape == u.shape and g.shape[-1] % 8 == 0
            and not (torch.is_grad_enabled() and (g.requires_grad or u.requires_grad))):
        kernels = cpu_kernels()
        if kernels is not None:
            return kernels.silu_mul_(g.contiguous(), u.contiguous())
    return F.silu(g) * u
