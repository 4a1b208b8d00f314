"""Gated DeltaNet, Qwen3-Next's linear-attention layer: per head a matrix state S [dk, dv] instead of a KV cache.

Per token: q, k, v come through a causal depthwise convolution (width `linear_conv_kernel`, SiLU) over the
projected inputs; q and k are L2-normalised (q also scaled by dk**-0.5); the state decays by exp(g), g =
-exp(A_log) * softplus(a + dt_bias), and takes the delta rule's correction, S += k (beta (v - k S)), beta =
sigmoid(b); the output q S is RMS-normalised and gated by silu(z), then projected. Key heads serve
value_heads / key_heads consecutive value heads each.

Speculation needs the state after every row a forward verifies (state_cache.py files them by slot), and a tree's
node continues from its parent's state, not from the row before it. So the rows go one at a time, each from its
parent's state: a chain's parent is the row before; a tree node's is the nearest slot it attends to besides its
own (its parent's: the tree mask shows a node its ancestors), read off the same row slots attention reads. Every
row is computed by the same operations on its own values whatever else is in the forward, so a verify forward's
rows are its one-token forwards' (only the projections run over all rows, and on the CPU kernels a row's product
is its own).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.config import ModelConfig
from specdecode.kernels import cpu_kernels
from specdecode.models.linear_groups import together
from specdecode.models.parts import RowSlots, Segment, row_slots
from specdecode.models.state_cache import LayerState, StateCache


@dataclass
class RowPlan:
    """One sequence's rows [begin, end) of a forward, in the order they are computed: each row's parent slot (-1:
    the zero state, before any token), the first row that files its state, and when each row's state is last read
    as a parent (a chain frees each as soon as the next row has it)."""

    begin: int
    end: int
    cache: StateCache
    base: int  # the cache slot of the first row
    parents: list[int]
    first_filed: int
    last_read: dict[int, int]  # a slot of this forward -> the last row (of this forward) whose parent it is


def plan_rows(segments: list[Segment]) -> list[RowPlan]:
    """Each segment's rows as the recurrent layers compute them, made once per forward (the cache told which
    states the forward replaces)."""
    plans = []
    for s in segments:
        cache = s.cache
        if not isinstance(cache, StateCache):
            raise ValueError("a model with recurrent layers needs its own cache (model.new_cache)")
        base, count = cache.length, s.end - s.begin
        parents = row_parents(s.rows if s.rows is not None else row_slots(s.attn_mask), base)
        last_read = {p: r for r, p in enumerate(parents) if p >= base}
        plans.append(RowPlan(s.begin, s.end, cache, base, parents, cache.start_rows(base, count), last_read))
    return plans


def row_parents(rows: RowSlots, base: int) -> list[int]:
    """Each row's parent slot, from the slots it attends to (RowSlots; row t sits at slot base + t): the nearest
    one besides its own. A row must see its own slot last, and its parent before it."""
    parents = []
    for t, span in enumerate(rows.spans):
        extra = rows.extras[t] if rows.extras else []
        seen = extra if extra else [span - 1]
        own = seen[-1]
        parent = extra[-2] if len(extra) > 1 else span - 1 if extra else span - 2
        if own != base + t or rows.first(t) != 0 or parent >= own:
            raise ValueError(f"row {t} of a recurrent layer's forward must attend to its prefix and its own slot")
        parents.append(parent)
    return parents


class CausalConv(nn.Module):
    """The depthwise convolution's weight [channels, 1, kernel] (transformers' nn.Conv1d, by its name), applied one
    token at a time over a window of the token's last `kernel` inputs along its path."""

    def __init__(self, channels: int, kernel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))


class GatedRMSNorm(nn.Module):
    """RMS norm (weight applied as is, not 1 + w) of the output, then times silu(gate), in float32."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if (x.dtype == torch.float32 and x.is_cpu and x.shape[-1] % 8 == 0 and not torch.is_grad_enabled()
                and (kernels := cpu_kernels()) is not None):  # two native calls instead of a dozen operations
            normed = kernels.rms_norm(x.contiguous(), self.weight.float().contiguous(), self.eps)
            return kernels.silu_mul_(gate.float().clone(), normed)  # in place: on a copy of the gate
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32.to(x.dtype) * F.silu(gate.float())).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d = config.hidden_size
        self.key_heads, self.value_heads = config.linear_key_heads, config.linear_value_heads
        self.key_dim, self.value_dim = config.linear_key_dim, config.linear_value_dim
        self.group = self.value_heads // self.key_heads  # value heads per key head
        keys, values = self.key_heads * self.key_dim, self.value_heads * self.value_dim
        self.channels = 2 * keys + values  # what the convolution runs over: q, k and v
        self.kernel = config.linear_conv_kernel
        # transformers' names: q, k, v and z interleaved per key head, then b and a the same way
        self.in_proj_qkvz = nn.Linear(d, 2 * keys + 2 * values, bias=False)
        self.in_proj_ba = nn.Linear(d, 2 * self.value_heads, bias=False)
        self.conv1d = CausalConv(self.channels, self.kernel)
        self.dt_bias = nn.Parameter(torch.ones(self.value_heads))
        self.A_log = nn.Parameter(torch.zeros(self.value_heads))
        self.norm = GatedRMSNorm(self.value_dim, config.rms_norm_eps)
        self.out_proj = nn.Linear(values, d, bias=False)

    def forward(self, x: torch.Tensor, layer: int, plans: list[RowPlan]) -> torch.Tensor:
        """x [B, T, d] -> [B, T, d]; `layer`: this layer's place among the recurrent layers (its cache states)."""
        qkvz, ba = together(x, (self.in_proj_qkvz, self.in_proj_ba))  # one kernel call
        decay = -self.A_log.float().exp()  # [Hv]
        out = []
        for plan in plans:
            held: dict[int, LayerState] = {}  # states of this forward's rows that a later row continues from
            for r in range(plan.end - plan.begin):
                t, slot, parent = plan.begin + r, plan.base + r, plan.parents[r]
                before = held[parent] if parent >= plan.base else plan.cache.state(parent + 1, layer)
                y, state = self._row(qkvz[:, t : t + 1], ba[:, t : t + 1], before, decay)
                out.append(y)
                if slot in plan.last_read:
                    held[slot] = state
                if parent in held and plan.last_read[parent] == r:
                    del held[parent]
                if r >= plan.first_filed:
                    plan.cache.file(slot, layer, state)
        return self.out_proj(torch.cat(out, dim=1))

    def _row(self, qkvz: torch.Tensor, ba: torch.Tensor, before: LayerState | None,
             decay: torch.Tensor) -> tuple[torch.Tensor, LayerState]:
        """One token: qkvz [B, 1, *], ba [B, 1, 2 Hv] and the state after its parent -> (output [B, 1, Hv * dv]
        before the out projection, the state after it)."""
        B = qkvz.shape[0]
        dk, dv, g = self.key_dim, self.value_dim, self.group
        per_head = qkvz.view(B, self.key_heads, 2 * dk + 2 * g * dv)
        q, k, v, z = per_head.split([dk, dk, g * dv, g * dv], dim=-1)
        b, a = ba.view(B, self.key_heads, 2 * g).split([g, g], dim=-1)
        mixed = torch.cat((q.reshape(B, -1), k.reshape(B, -1), v.reshape(B, -1)), dim=-1)  # [B, C]
        window = (mixed.new_zeros(B, self.channels, self.kernel - 1) if before is None else before[0])
        inputs = torch.cat((window, mixed[:, :, None].to(window.dtype)), dim=-1)  # [B, C, kernel]
        weight = self.conv1d.weight
        # the depthwise convolution at one position: each channel's window times its taps (F.conv1d took ~10x
        # as long over 8k channels)
        mixed = F.silu((inputs.to(weight.dtype) * weight[:, 0]).sum(-1)).to(qkvz.dtype)  # [B, C]
        q, k, v = mixed.split([self.key_heads * dk, self.key_heads * dk, self.value_heads * dv], dim=-1)
        q, k = q.reshape(B, self.key_heads, dk).float(), k.reshape(B, self.key_heads, dk).float()
        # normalised per key head, then shared by its value heads (the same values as normalising each copy)
        q = (q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) / dk**0.5).repeat_interleave(g, dim=1)
        k = (k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)).repeat_interleave(g, dim=1)  # [B, Hv, dk]
        v = v.reshape(B, self.value_heads, dv).float()
        beta = b.reshape(B, self.value_heads).float().sigmoid()
        rate = decay * F.softplus(a.reshape(B, self.value_heads).float() + self.dt_bias)  # [B, Hv], <= 0
        # The state is the layer's largest read (Hv dk dv floats, 2 MB for Qwen3-Next-80B): decayed into a new
        # tensor (the one before is kept for a rollback), then corrected in place; four passes over it a token.
        S = (q.new_zeros(B, self.value_heads, dk, dv) if before is None else before[1]) * rate.exp()[..., None, None]
        recalled = torch.matmul(k[:, :, None], S)[:, :, 0]  # [B, Hv, dv]: what the state holds for k
        delta = (v - recalled) * beta[..., None]
        flat = S.view(-1, dk, dv)
        flat.baddbmm_(k.reshape(-1, dk, 1), delta.reshape(-1, 1, dv))  # S += k (beta (v - k S))
        o = torch.matmul(q[:, :, None], S)[:, :, 0].to(qkvz.dtype)  # [B, Hv, dv]
        y = self.norm(o, z.reshape(B, self.value_heads, dv))
        return y.reshape(B, 1, -1), (inputs[:, :, 1:], S)
