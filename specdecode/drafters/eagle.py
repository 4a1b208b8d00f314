"""An EAGLE head (EAGLE-3, Li et al. 2025) and the drafter that grows a dynamic tree with it, from the target's own
features (`specdecode train eagle` trains one).

The head is one decoder layer. Row i pairs what the target knew at position i (its features) with the token at
position i + 1, and predicts the token at i + 2. The features are the target's final hidden state and the inputs
of a low, a middle and a high layer, each RMS-normalised and fused by one linear layer to the hidden size. The
layer attends (rotary, grouped-query) over [norm(token embedding); norm(hidden)], adds to the hidden state as a
residual, then an MLP; a final norm and an LM head over a reduced draft vocabulary (`head_tokens`, target ids) give
the logits. The token embedding is the target's own (never copied into the head).

Drafting deeper than one token, the head has no target features for its own guesses: it feeds its own output
hidden state instead. Training unrolls that ("training-time test"): step k of row i reads the hidden state step
k - 1 produced and attends to the step-0 rows up to i (true features) plus its own earlier steps, exactly what a
depth-k draft node attends to at generation time (the prefix, its ancestors, itself).

The drafter keeps the head's own one-layer KV cache over the committed context: row i holds the target's features
at position i with the token at i + 1. Each step it first catches up on the rows the target computed since (the
engine hands over every new position's features: `Needs.every_position`), whose last row, the root's, predicts
the first draft token. The tree grows best nodes first, as a draft model's does (tree_growth.py), the planner
deciding how far. Nodes live in cache slots after the context; `commit` drops them all: the accepted tokens come
back next step with the target's true features. A step it sits out (another drafter proposed, as in
`hybrid-eagle`) hands it that step's features (`SatOut`), read at the next catching up.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.drafters.base import Draft, DraftContext
from specdecode.drafters.draft import Event, ForwardTook, Needs, SatOut
from specdecode.drafters.tree_growth import DepthTrust, ForwardTime, GrowsTrees, Node
from specdecode.models.kv_cache import KVCache
from specdecode.models.parts import ids_and_positions, rows_mask
from specdecode.planner.tuning import HEAD_MIN_CONFIDENCE
from specdecode.weights.store import load_head


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


TREE_WIDTH = 4  # children per expanded node: a head's second and third guesses are often right
TREE_EXPAND = 2  # nodes of a depth fed on: a head forward is cheap next to the target's


class EagleDrafter(GrowsTrees):
    name = "eagle"

    def __init__(self, head: EagleHead, target: torch.nn.Module, feature_layers: tuple[int, ...],
                 width: int = TREE_WIDTH, expand: int = TREE_EXPAND, max_depth: int = 8,
                 min_confidence: float = HEAD_MIN_CONFIDENCE, clock: ForwardTime | None = None) -> None:
        self.model = head
        self.device = head.device
        self.target = target
        c = head.config  # every position's target features, the inputs of `feature_layers` too (sequence.py)
        self.needs = Needs(hidden=True, every_position=True, feature_layers=tuple(feature_layers),
                           cache_bytes_per_token=2 * c.num_kv_heads * c.head_dim * 4)  # one float32 layer
        self.width, self.expand, self.max_depth = width, expand, max_depth
        self.min_confidence = min_confidence
        self.vocab_size = target.config.vocab_size
        self.cache = None
        self.base_length = 0
        self.root_hidden: torch.Tensor | None = None  # [1, d] the head's output at the root's row
        self.nodes: list[Node] = []
        self.kept: list[int] = []
        self.hidden_of: dict[int, torch.Tensor] = {}  # fed node -> its output hidden state [d]
        self.pending: torch.Tensor | None = None  # target features of steps it sat out, not yet read
        self.clock = clock or ForwardTime()
        self.trust = DepthTrust()
        self.drafting_s = 0.0  # what its last draft took, catching up included (it catches up every step)

    @classmethod
    def load(cls, folder: str | Path, target: torch.nn.Module, **kwargs) -> EagleDrafter:
        meta, head = load_head(folder, "eagle", target, lambda config: EagleHead(EagleConfig(**config)))
        return cls(head, target, tuple(meta["feature_layers"]), **kwargs)

    @property
    def trained_weights(self) -> torch.nn.Module:
        return self.model

    @property
    def head_tokens(self) -> torch.Tensor:
        return self.model.head_tokens  # the head's own buffer, wherever the head was moved

    def fork(self) -> EagleDrafter:
        return EagleDrafter(self.model, self.target, self.needs.feature_layers, self.width, self.expand, self.max_depth,
                            self.min_confidence, self.clock)

    def reset(self) -> None:
        if self.cache is not None:
            self.cache.reset()
        self.nodes, self.kept, self.base_length, self.root_hidden, self.pending = [], [], 0, None, None
        self.trust = DepthTrust()

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        if max_tokens <= 0:
            self.nodes, self.kept = [], []  # nothing for commit to learn from
            return Draft.empty(self.model.device)
        started = time.perf_counter()
        self._catch_up(ctx)
        logits = self.model.logits(self.root_hidden)  # [1, draft vocab]
        self.hidden_of = {}
        growth = self._grow_tree(logits, ctx, max_tokens, started, lambda expand, nodes: (expand, nodes))
        try:
            expand, nodes = next(growth)
            while True:  # the head's own forwards, one depth each
                began = time.perf_counter()
                logits = self._feed(expand, nodes)
                self.hear(ForwardTook(time.perf_counter() - began))
                expand, nodes = growth.send(logits)
        except StopIteration as done:
            self.drafting_s = time.perf_counter() - started
            return done.value

    def hear(self, event: Event) -> None:
        if isinstance(event, SatOut):  # keep the features handed over, for the next catching up
            hidden = event.ctx.hidden
            if hidden is not None:
                self.pending = hidden if self.pending is None else torch.cat((self.pending, hidden))
        else:
            super().hear(event)

    def commit(self, accepted: list[int], verified: list[int] | None = None) -> None:
        # Draft nodes were fed with the head's own hidden states; the accepted ones come back next step with
        # the target's features, so every node's row goes.
        self.learn_trust(accepted, verified)
        if self.cache is not None:
            self.cache.truncate(self.base_length)

    def _catch_up(self, ctx: DraftContext) -> None:
        """Feed the context rows the head lacks: positions [cache.length, len(tokens) - 1)."""
        head, target = self.model, self.target
        needed = len(ctx.tokens) + self.max_depth * self.expand + 1
        if self.cache is None or self.cache.max_len < needed:
            self._grow(needed)
        start, end = self.cache.length, len(ctx.tokens) - 1
        if end <= start:  # nothing new since the last draft (cannot happen in the engine: the root is new)
            return
        d = target.config.hidden_size
        rows = ctx.hidden  # [rows, d * num_features]: final hidden state, then the feature layers' inputs
        if self.pending is not None:
            rows = self.pending if rows is None else torch.cat((self.pending, rows))
            self.pending = None
        if rows is None or rows.shape[0] != end - start:  # features missing (should not happen): zeros stand in
            fill = torch.zeros(end - start, head.config.num_features * d, device=head.device)
            if rows is not None:
                take = min(rows.shape[0], end - start)
                fill[end - start - take :] = rows[rows.shape[0] - take :]
            rows = fill
        ids = torch.tensor(ctx.tokens[start + 1 : end + 1], device=head.device)
        embeds = target_embeddings(target)(ids[None])[0]
        positions = torch.arange(start, end, device=head.device)
        mask = torch.ones(end - start, end, dtype=torch.bool, device=head.device).tril(start)
        out = head.step(embeds, head.fuse(rows), positions, self.cache, mask)
        self.cache.truncate(end)
        self.base_length = end
        self.root_hidden = out[-1:]

    def _feed(self, expand: list[int], nodes: list[Node]) -> torch.Tensor:
        """One head forward over the nodes `expand` (one depth), each seeing the context and its ancestors;
        -> their logits [len(expand), draft vocab]."""
        head = self.model
        start = self.cache.length
        ids, positions, rows = self._place(expand, nodes, start, self.base_length)
        ids, positions = ids_and_positions(ids, positions, head.device)
        mask = rows_mask(rows, head.device)[0, 0]  # [len(expand), start + len(expand)]
        parents = [self.root_hidden[0] if nodes[i].parent < 0 else self.hidden_of[nodes[i].parent] for i in expand]
        embeds = target_embeddings(self.target)(ids[None])[0]
        out = head.step(embeds, torch.stack(parents), positions, self.cache, mask)
        self.cache.truncate(start + len(expand))
        for row, i in enumerate(expand):
            self.hidden_of[i] = out[row]
        return head.logits(out)

    def _grow(self, needed: int) -> None:
        if self.cache is None:
            self.cache = self.model.new_cache(max(needed, 256), self.model.device)
        else:
            self.cache.grow(max(needed, 2 * self.cache.max_len))
