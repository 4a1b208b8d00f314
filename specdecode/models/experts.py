"""The mixture-of-experts MLP (Qwen3-MoE): a router picks each row's top-k experts, whose SwiGLU outputs are weighted
and summed.

Only the experts some row routes to are computed, each over the rows that chose it. A row's result depends on its
own input alone: its experts are added in ascending expert order, starting from zero, whatever other rows are in the
forward (with the linear layers on the CPU kernels, bit for bit; on plain nn.Linear, up to float rounding). So a
verify forward's rows are the one-token forwards' rows, as every method's exactness needs.

Each expert is its own module with its own three matrices (Hugging Face's on-disk names, `experts.{e}.gate_proj`,
...), so a checkpoint loads as is, each expert's matrices go on the kernels apart, and a GGUF's 3-D expert tensors
are kept as one block matrix per expert, read only when routed. transformers' in-memory state dict fuses them
(`experts.gate_up_proj` [E, 2I, d], `experts.down_proj` [E, d, I]); a load hook splits those.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.config import ModelConfig
from specdecode.models.gated import silu_mul


class Expert(nn.Module):
    """One expert: silu(x W_gate) * (x W_up) -> W_down."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


class Router(nn.Linear):
    """The router's logits, one per expert. Kept in float when the other layers are written in blocks (--quantize),
    as llama.cpp keeps it: a rounded router changes which experts a token reads, not only how precisely."""

    keep_float = True


class SparseMoE(nn.Module):
    """Router logits -> softmax -> top-k experts (renormalised where the config says) -> their weighted sum."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.gate = Router(config.hidden_size, config.num_experts, bias=False)
        self.experts = nn.ModuleList(Expert(config.hidden_size, config.moe_intermediate_size)
                                     for _ in range(config.num_experts))
        self.register_load_state_dict_pre_hook(split_fused_experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d] -> (each row's expert weights [N, k] in x's dtype, its experts [N, k])."""
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, chosen = self.route(flat)
        if flat.is_cuda and torch.cuda.is_current_stream_capturing():  # a CUDA graph (models/cuda_graphs.py)
            return self.every_expert(flat, weights, chosen).view(shape)
        out = torch.zeros_like(flat)
        for expert, rows, slots in expert_groups(chosen.tolist()):
            picked = weights[rows, slots][:, None]  # [rows, 1]: each row's weight for this expert
            if len(rows) == flat.shape[0]:  # every row chose it (a one-token step): no gather, no scatter
                out += self.experts[expert](flat) * picked
            else:
                at = torch.tensor(rows, device=x.device)
                out.index_add_(0, at, self.experts[expert](flat.index_select(0, at)) * picked)
        return out.view(shape)

    def every_expert(self, flat: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The same sum with no host read of the routes (what a CUDA graph can capture): every expert over every
        row, an unchosen one weighted 0 (adding 0 leaves a sum as it was), in the same ascending order. It reads
        every expert's weights: the price of a graph."""
        dense = torch.zeros(flat.shape[0], len(self.experts), dtype=weights.dtype, device=flat.device)
        dense.scatter_(1, chosen, weights)  # [N, experts]
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            out += expert(flat) * dense[:, e : e + 1]
        return out


def expert_groups(chosen: list[list[int]]) -> list[tuple[int, list[int], list[int]]]:
    """Each row's chosen experts [N][k] -> (expert, the rows that chose it, the slot of its weight in each row's
    top k) for every expert some row chose, in ascending expert order (each row's sum then adds its experts in
    the same order whatever rows it is batched with)."""
    groups: dict[int, tuple[list[int], list[int]]] = {}
    for row, experts in enumerate(chosen):
        for slot, expert in enumerate(experts):
            rows, slots = groups.setdefault(expert, ([], []))
            rows.append(row)
            slots.append(slot)
    return [(expert, *groups[expert]) for expert in sorted(groups)]


def split_fused_experts(module: nn.Module, state_dict: dict, prefix: str, *args) -> None:
    """transformers' fused expert tensors (its in-memory state dict) -> one expert's matrices each, in place."""
    fused_gate_up, fused_down = f"{prefix}experts.gate_up_proj", f"{prefix}experts.down_proj"
    if fused_gate_up in state_dict:
        gate_up = state_dict.pop(fused_gate_up)  # [E, 2I, d]: gate rows first, then up rows
        half = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            state_dict[f"{prefix}experts.{e}.gate_proj.weight"] = gate_up[e, :half]
            state_dict[f"{prefix}experts.{e}.up_proj.weight"] = gate_up[e, half:]
    if fused_down in state_dict:
        down = state_dict.pop(fused_down)  # [E, d, I]
        for e in range(down.shape[0]):
            state_dict[f"{prefix}experts.{e}.down_proj.weight"] = down[e]
