"""An EAGLE-style draft head: one decoder layer over the target's own features (EAGLE-3, Li et al. 2025).

Row i of the head pairs what the target knew at position i (its features) with the token at position i + 1, and
predicts the token at i + 2. The features are the target's final hidden state and the inputs of a low, a middle
and a high layer, each RMS-normalised and fused by one linear layer to the hidden size. The layer attends (rotary, grouped-query) over
[norm(token embedding); norm(hidden)], adds to the hidden state as a residual, then an MLP; a final norm and an LM
head over a reduced draft vocabulary (`head_tokens`, target ids) give the logits. The token embedding is the
target's own (never copied into the head).

Drafting deeper than one token, the head has no target features for its own guesses: it feeds its own output
hidden state instead. Training unrolls that ("training-time test"): step k of row i reads the hidden state step
k - 1 produced and attends to the step-0 rows up to i (true features) plus its own earlier steps, exactly what a
depth-k draft node attends to at generation time (the prefix, its ancestors, itself).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.kv_cache import KVCache


@dataclass(slots=True)
class EagleConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    num_features: int  # hidden-size groups fused: the final hidden state + the feature layers' inputs
    draft_vocab: int
    rope_theta: float
    rms_norm_eps: float

    def to_dict(self) -> dict:
        return asdict(self)


def target_embeddings(target: nn.Module) -> nn.Module:
    """The target's token embedding module (native model or a transformers one)."""
    inner = target.model
    return inner.embed_tokens if hasattr(inner, "embed_tokens") else inner.get_input_embeddings()


def rms(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


class EagleHead(nn.Module):
    def __init__(self, config: EagleConfig) -> None:
        super().__init__()
        self.config = c = config
        d, hd = c.hidden_size, c.head_dim
        self.fc = nn.Linear(c.num_features * d, d, bias=False)
        self.embed_norm = nn.Parameter(torch.ones(d))
        self.hidden_norm = nn.Parameter(torch.ones(d))
        self.q_proj = nn.Linear(2 * d, c.num_heads * hd, bias=True)
        self.k_proj = nn.Linear(2 * d, c.num_kv_heads * hd, bias=True)
        self.v_proj = nn.Linear(2 * d, c.num_kv_heads * hd, bias=True)
        self.o_proj = nn.Linear(c.num_heads * hd, d, bias=False)
        self.post_norm = nn.Parameter(torch.ones(d))
        self.gate_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(d, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, d, bias=False)
        self.norm = nn.Parameter(torch.ones(d))
        self.lm_head = nn.Linear(d, c.draft_vocab, bias=False)
        self.register_buffer("head_tokens", torch.zeros(c.draft_vocab, dtype=torch.long))
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, hd, 2).float() / hd))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    @property
    def device(self) -> torch.device:
        return self.head_tokens.device

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """[T, num_features * d] (final hidden state, layer inputs) -> [T, d]; each part normalised first (the
        residual stream grows layer by layer: unnormalised, the last layer would drown the first)."""
        parts = features.view(*features.shape[:-1], self.config.num_features, self.config.hidden_size)
        return self.fc(rms(parts.float(), None, self.config.rms_norm_eps).flatten(-2))

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq  # [T, hd/2]
        angles = torch.cat((freqs, freqs), dim=-1)[None]  # [1, T, hd]
        return angles.cos(), angles.sin()

    def qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """-> q [heads, T, hd], k and v [kv_heads, T, hd], rotary applied."""
        c, eps = self.config, self.config.rms_norm_eps
        x = torch.cat((rms(embeds.float(), self.embed_norm, eps), rms(hidden, self.hidden_norm, eps)), dim=-1)
        T = x.shape[0]
        q = self.q_proj(x).view(T, c.num_heads, c.head_dim).transpose(0, 1)
        k = self.k_proj(x).view(T, c.num_kv_heads, c.head_dim).transpose(0, 1)
        v = self.v_proj(x).view(T, c.num_kv_heads, c.head_dim).transpose(0, 1)
        cos, sin = self.rotary(positions)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def finish(self, hidden: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Residual attention output [heads, T, hd] and MLP -> the layer's output hidden state [T, d]."""
        h = hidden + self.o_proj(attended.transpose(0, 1).flatten(1))
        x = rms(h, self.post_norm, self.config.rms_norm_eps)
        return h + self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, d] -> [T, draft_vocab] over `head_tokens`."""
        return self.lm_head(rms(hidden, self.norm, self.config.rms_norm_eps)).float()

    def new_cache(self, max_len: int, device: torch.device | str = "cpu") -> KVCache:
        c = self.config
        return KVCache(1, 1, c.num_kv_heads, max_len, c.head_dim, torch.float32, device)

    def step(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: KVCache,
             mask: torch.Tensor) -> torch.Tensor:
        """Generation: T rows into `cache` at slots [cache.length, +T) (the caller advances the length),
        attending under `mask` [T, S] -> output hidden states [T, d]."""
        q, k, v = self.qkv(embeds, hidden, positions)
        start, T = cache.length, q.shape[1]
        cache.k[0, 0, :, start : start + T] = k
        cache.v[0, 0, :, start : start + T] = v
        span = mask.shape[-1]
        out = F.scaled_dot_product_attention(q[None], cache.k[0, :, :, :span], cache.v[0, :, :, :span],
                                             attn_mask=mask[None, None], enable_gqa=True)[0]
        return self.finish(hidden, out)

    def unrolled(self, features: torch.Tensor, embeds: torch.Tensor, positions: torch.Tensor,
                 same_doc: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training: rows [T] of packed sequences (features [T, F*d]; embeds [T + steps, d], row i + k being the
        token step k of row i reads; same_doc [T, T] True where row j is row i's sequence, j <= i) -> the output
        hidden state of each of `steps` unrolled steps, [T, d] each."""
        hidden = self.fuse(features)
        T = hidden.shape[0]
        scale = 1.0 / math.sqrt(self.config.head_dim)
        group = self.config.num_heads // self.config.num_kv_heads
        keys, values, outs = [], [], []
        for k in range(steps):
            q, key, value = self.qkv(embeds[k : k + T], hidden, positions + k)
            key, value = key.repeat_interleave(group, 0), value.repeat_interleave(group, 0)
            keys.append(key)
            values.append(value)
            prefix = (q @ keys[0].transpose(1, 2)) * scale  # [heads, T, T]
            prefix = prefix.masked_fill(~same_doc, float("-inf"))
            own = [(q * kk).sum(-1, keepdim=True) * scale for kk in keys[1:]]  # its own earlier steps [heads, T, 1]
            weights = torch.cat((prefix, *own), dim=-1).softmax(-1)
            attended = weights[..., :T] @ values[0]
            for s, vv in enumerate(values[1:]):
                attended = attended + weights[..., T + s : T + s + 1] * vv
            hidden = self.finish(hidden, attended)
            outs.append(hidden)
        return outs
