"""The mixture-of-experts MLP (Qwen3-MoE, gpt-oss): a router picks each row's top-k experts, whose SwiGLU outputs are
weighted and summed.

gpt-oss differs by config flags: biases on the router and every expert matrix, the softmax taken over the k chosen
logits (not top k of a softmax over all), and a clamped SwiGLU, (up + 1) * gate * sigmoid(alpha * gate) with gate
clamped above and up on both sides at `swiglu_limit`.

Only the experts some row routes to are computed, each over the rows that chose it. A row's result depends on its
own input alone: its experts are added in ascending expert order, starting from zero, whatever other rows are in the
forward (with the linear layers on the CPU kernels, bit for bit; on plain nn.Linear, up to float rounding). So a
verify forward's rows are the one-token forwards' rows, as every method's exactness needs.

Qwen3-Next adds a shared expert (`shared_expert_intermediate_size`): an expert every row runs, its output scaled by
sigmoid(x W_shared_gate) and added to the routed sum.

Each expert is its own module with its own three matrices (Hugging Face's on-disk names, `experts.{e}.gate_proj`,
...), so a checkpoint loads as is, each expert's matrices go on the kernels apart, and a GGUF's 3-D expert tensors
are kept as one block matrix per expert, read only when routed. transformers' in-memory state dict fuses them
(Qwen3-MoE: `experts.gate_up_proj` [E, 2I, d], `experts.down_proj` [E, d, I]; gpt-oss, also on disk: [E, d, 2I]
with gate and up columns alternating, `experts.down_proj` [E, I, d], biases beside them, the router named `router`);
a load hook splits those.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.config import ModelConfig
from specdecode.models.gated import silu_mul
from specdecode.models.linear_groups import kernel_ops, kernel_rows, together

# values a row's shared-expert gate is repeated to for its sigmoid: whole steps of torch's vector loop (two vectors
# of 16 floats on AVX-512, of 8 on AVX2) for any number of rows, so no row reaches the loop's scalar tail
SIGMOID_SPAN = 64


class Expert(nn.Module):
    """One expert: silu(x W_gate) * (x W_up) -> W_down; with `limit` (gpt-oss), the clamped variant."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, limit: float | None = None,
                 alpha: float = 1.0) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.limit, self.alpha = limit, alpha

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(*self.gate_up(x)))

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x W_gate and x W_up: on the CPU kernels in one parallel region (each output the bits of its own call)."""
        gate, up = together(x, (self.gate_proj, self.up_proj))
        return gate, up

    def activation(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """What the down projection reads: elementwise, so rows of several experts stacked give each its bits."""
        if self.limit is None:
            return silu_mul(gate, up)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(-self.limit, self.limit)
        # gate * sigmoid(alpha gate) = silu(alpha gate) / alpha, on silu_mul's kernel: torch's sigmoid rounds an
        # element differently in its vector loop and its scalar tail, so a row's bits would depend on the others
        return silu_mul(gate * self.alpha, (up + 1) * (1 / self.alpha))


class Router(nn.Linear):
    """The router's logits, one per expert. Kept in float when the other layers are written in blocks (--quantize),
    as llama.cpp keeps it: a rounded router changes which experts a token reads, not only how precisely."""

    keep_float = True


class SparseMoE(nn.Module):
    """Router logits -> softmax -> top-k experts (renormalised where the config says) -> their weighted sum; or
    (`softmax_after_topk`, gpt-oss) the top-k logits -> their softmax."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.softmax_after_topk = config.softmax_after_topk
        self.gate_up_interleaved = config.gate_up_interleaved  # which fused layout the load hook reads
        self.gate = Router(config.hidden_size, config.num_experts, bias=config.expert_bias)
        self.experts = nn.ModuleList(Expert(config.hidden_size, config.moe_intermediate_size, config.expert_bias,
                                            config.swiglu_limit, config.swiglu_alpha)
                                     for _ in range(config.num_experts))
        shared = config.shared_expert_intermediate_size
        if shared:  # transformers' names: shared_expert.{gate,up,down}_proj, shared_expert_gate
            self.shared_expert = Expert(config.hidden_size, shared)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        self.shared = bool(shared)
        self.register_load_state_dict_pre_hook(split_fused_experts)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, d] -> (each row's expert weights [N, k] in x's dtype, its experts [N, k])."""
        if self.softmax_after_topk:
            logits, chosen = torch.topk(self.gate(x).float(), self.top_k, dim=-1)
            return F.softmax(logits, dim=-1).to(x.dtype), chosen
        probs = F.softmax(self.gate(x).float(), dim=-1)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), chosen

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if flat.shape[0] == 1 and (out := self.one_row(flat)) is not None:
            return out.view(shape)
        out = self.routed(flat)
        if self.shared:
            out = out + self.shared_part(flat)
        return out.view(shape)

    def one_row(self, flat: torch.Tensor) -> torch.Tensor | None:
        """A one-token step's row [1, d]: every chosen expert's (and the shared expert's) gate and up projections
        in one call of the kernels, their SwiGLU in one, then each down projection, summed as `routed` and
        `shared_part` sum them: the same operations on the same values, the same bits, in half the calls (a kernel
        call costs ~10 us beside its reads, and a layer of 10 experts made ~60). None where the kernels do not run
        it."""
        kernels = kernel_rows(flat)
        if kernels is None:
            return None
        weights, chosen = self.route(flat)
        picks = sorted(zip(chosen[0].tolist(), range(self.top_k)))  # (expert, its slot), ascending experts
        layers = [m for e, _ in picks for m in (self.experts[e].gate_proj, self.experts[e].up_proj)]
        if self.shared:
            layers += [self.shared_expert.gate_proj, self.shared_expert.up_proj, self.shared_expert_gate]
        if (ops := kernel_ops(layers)) is None:
            return None
        outs = kernels.run_linears(flat, ops)
        k = len(picks)
        act = self.experts[0].activation(torch.cat(outs[0 : 2 * k : 2]), torch.cat(outs[1 : 2 * k : 2]))  # [k, I]
        out = torch.zeros_like(flat)
        for j, (e, slot) in enumerate(picks):
            out += self.experts[e].down_proj(act[j : j + 1]) * weights[:, slot : slot + 1]
        if self.shared:
            gate = torch.sigmoid(outs[-1].repeat(1, SIGMOID_SPAN))[:, :1]  # as shared_part
            out = out + self.shared_expert.down_proj(silu_mul(outs[-3], outs[-2])) * gate
        return out

    def shared_part(self, flat: torch.Tensor) -> torch.Tensor:
        """The shared expert's output [N, d], scaled by its gate's sigmoid. The sigmoid runs over each row's gate
        repeated to SIGMOID_SPAN values: a lone [N, 1] column (or one row of 16) would put some rows in torch's
        scalar tail, which rounds differently from its vector loop (two vectors a step), and a row's bits would
        depend on how many rows share the forward."""
        gate = torch.sigmoid(self.shared_expert_gate(flat).repeat(1, SIGMOID_SPAN))[:, :1]
        return self.shared_expert(flat) * gate

    def routed(self, flat: torch.Tensor) -> torch.Tensor:
        """The routed experts' weighted sum over rows flat [N, d] -> [N, d]."""
        weights, chosen = self.route(flat)
        if flat.is_cuda and torch.cuda.is_current_stream_capturing():  # a CUDA graph (models/cuda_graphs.py)
            return self.every_expert(flat, weights, chosen)
        out = torch.zeros_like(flat)
        for expert, rows, slots in expert_groups(chosen.tolist()):
            picked = weights[rows, slots][:, None]  # [rows, 1]: each row's weight for this expert
            if len(rows) == flat.shape[0]:  # every row chose it (a one-token step): no gather, no scatter
                out += self.experts[expert](flat) * picked
            else:
                at = torch.tensor(rows, device=flat.device)
                out.index_add_(0, at, self.experts[expert](flat.index_select(0, at)) * picked)
        return out

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
    """transformers' fused expert tensors (its in-memory state dict) -> one expert's matrices each, in place.
    `module` None: Qwen3-MoE's layout (a GGUF reader's name list)."""
    if getattr(module, "gate_up_interleaved", False):
        split_interleaved_experts(state_dict, prefix)
        return
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


def split_interleaved_experts(state_dict: dict, prefix: str) -> None:
    """gpt-oss's fused experts -> one expert's matrices each, in place: gate_up [E, d, 2I] holds gate and up
    columns alternately (x @ W, so each is transposed into nn.Linear's [I, d]), down [E, I, d], biases [E, 2I] and
    [E, d]; the router (`router.weight`, `router.bias`) is this module's `gate`."""
    for kind in ("weight", "bias"):
        if (router := state_dict.pop(f"{prefix}router.{kind}", None)) is not None:
            state_dict[f"{prefix}gate.{kind}"] = router
    experts = f"{prefix}experts."
    if (gate_up := state_dict.pop(experts + "gate_up_proj", None)) is not None:
        for e in range(gate_up.shape[0]):
            state_dict[f"{experts}{e}.gate_proj.weight"] = gate_up[e, :, 0::2].t().contiguous()
            state_dict[f"{experts}{e}.up_proj.weight"] = gate_up[e, :, 1::2].t().contiguous()
    if (bias := state_dict.pop(experts + "gate_up_proj_bias", None)) is not None:
        for e in range(bias.shape[0]):
            state_dict[f"{experts}{e}.gate_proj.bias"] = bias[e, 0::2].contiguous()
            state_dict[f"{experts}{e}.up_proj.bias"] = bias[e, 1::2].contiguous()
    if (down := state_dict.pop(experts + "down_proj", None)) is not None:
        for e in range(down.shape[0]):
            state_dict[f"{experts}{e}.down_proj.weight"] = down[e].t().contiguous()
    if (bias := state_dict.pop(experts + "down_proj_bias", None)) is not None:
        for e in range(bias.shape[0]):
            state_dict[f"{experts}{e}.down_proj.bias"] = bias[e]
