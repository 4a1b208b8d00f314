"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, Qwen3-MoE, SmolLM2, Gemma 3, gpt-oss, Qwen3-Next) in
one file.

Differences between the families are config flags (`qkv_bias`, `qk_norm`, tied embeddings, rope scaling; Gemma 3's
embedding scale, (1 + w) norms, four norms a layer, GELU, attention scale and sliding-window layers with their own
rope, models/windows.py; Qwen3-MoE's expert MLPs, models/experts.py; gpt-oss's attention sinks, models/sinks.py,
output bias, biased experts and YaRN rope; Qwen3-Next's gated DeltaNet layers, models/deltanet.py, with their
states in models/state_cache.py, gated attention with partial rotary, and a shared expert), never forked copies.
Parameter names are Hugging Face's, so a HF state dict loads as is.

Forward contract, shared with `hf_model.HFModel`:
    forward(tokens [B, T], positions [B, T], cache, attn_mask [B, 1, T, S] bool, logits_from, decode,
            feature_layers) -> (logits, hidden)
Keys and values of the T new tokens are written into cache slots [cache.length, cache.length + T); `positions`
are their rotary positions (equal to the slots for a chain, the depth for tree nodes); attention reads slots
[0, S) under `attn_mask` (True = may attend). The caller owns `cache.length` and advances it after the call.
Explicit positions and masks are what let one forward verify a chain or a tree of draft tokens.
`hidden` is the final hidden state [B, T, d]; given `feature_layers` it is followed by the inputs of those layers
(what an EAGLE-style head drafts from), [B, T, d * (1 + len(feature_layers))]; the logits always use the first d.
What a drafter needs is an argument of the call, never state set on the model.
`decode=True` (the engine's decode and verify steps) computes every row exactly as a one-token forward of that
token would: attention one row at a time, and, with the linear layers on the CPU kernel (quantize.py), a verify
forward's logits equal one-token forwards bit for bit.

`forward_parts(parts, feature_layers)` is the same forward over several sequences at once (continuous batching):
each `Part` has its own tokens, positions, cache and mask; their rows are concatenated (ragged, no padding), so the
weights are read once for everyone, and attention runs per part against that part's cache. In decode mode every row is still
computed as its own one-token forward would be: a request's output does not depend on what it was batched with.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specdecode.config import ModelConfig
from specdecode.kernels import cpu_kernels
from specdecode.models.deltanet import GatedDeltaNet, plan_rows
from specdecode.models.experts import SparseMoE
from specdecode.models.gated import silu_mul
from specdecode.models.kv_cache import NATIVE_KV_DTYPES, KVCache
from specdecode.models.linear_groups import together
from specdecode.models.parts import Part, Segment, row_slots
from specdecode.models.rope import (
    RotaryTable,
    partial_rotary,
    rope_attention_factor,
    rope_inv_freq,
    rotary_angles,
    rotate_half,
    scaled_trig,
)
from specdecode.models.sinks import sink_attention, sink_decode_attention
from specdecode.models.state_cache import StateCache
from specdecode.models.windows import windowed_decode_attention, windowed_segments


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, unit_offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if unit_offset else torch.ones(dim))
        self.eps = eps
        self.unit_offset = unit_offset  # Gemma's: the weight applied as (1 + w), the product taken in float32
        self._scale: tuple[tuple, torch.Tensor] | None = None  # (the weight's identity, 1 + w in float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.unit_offset:
            return self._offset_forward(x)
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32 and x.is_contiguous() and x.is_cpu:
            kernels = cpu_kernels() if x.shape[-1] % 8 == 0 else None
            if kernels is not None:  # one call instead of seven: a one-token step is mostly small operations
                return kernels.rms_norm(x, self.weight, self.eps)
        # Normalise in float32 like the reference implementations, so float32 parity is exact.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def _offset_forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.offset_scale()
        if x.dtype == torch.float32 and x.is_contiguous() and x.is_cpu and x.shape[-1] % 8 == 0:
            if (kernels := cpu_kernels()) is not None:
                return kernels.rms_norm(x, scale, self.eps)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * scale).to(x.dtype)  # rounded after the product, as Gemma's reference rounds

    def offset_scale(self) -> torch.Tensor:
        """1 + w in float32, made once per weight (six norms a layer: a small tensor operation each costs)."""
        w = self.weight
        try:
            key = (w.data_ptr(), w.device, w._version)
        except RuntimeError:  # an inference tensor keeps no version
            key = (w.data_ptr(), w.device, None)
        if self._scale is None or self._scale[0] != key:
            self._scale = (key, 1.0 + w.detach().float())
        return self._scale[1]


def glue_kernels(q: torch.Tensor, k_cache: torch.Tensor):
    """The native kernels where they can do an attention layer's glue: float32 activations on CPU, a float32 or
    bfloat16 cache, head dim a multiple of 8."""
    if q.dtype != torch.float32 or k_cache.dtype not in NATIVE_KV_DTYPES or not q.is_cpu or q.shape[-1] % 8:
        return None
    return cpu_kernels()


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        d, hd = config.hidden_size, config.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, hd
        # Qwen3-Next: each head's query is followed by a gate of its width, the output multiplied by its sigmoid
        self.output_gate = config.attention_output_gate
        self.q_proj = nn.Linear(d, config.num_heads * hd * (2 if self.output_gate else 1), bias=config.qkv_bias)
        self.rotary_dim = config.rotary_dim if config.rotary_dim and config.rotary_dim < hd else None
        self.k_proj = nn.Linear(d, config.num_kv_heads * hd, bias=config.qkv_bias)
        self.v_proj = nn.Linear(d, config.num_kv_heads * hd, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.num_heads * hd, d, bias=config.o_bias)
        # gpt-oss: a logit per head in every softmax's denominator (models/sinks.py); those layers attend in torch
        self.sinks = nn.Parameter(torch.zeros(config.num_heads)) if config.attention_sinks else None
        if config.qk_norm:
            self.q_norm = RMSNorm(hd, config.rms_norm_eps, config.norm_unit_offset)
            self.k_norm = RMSNorm(hd, config.rms_norm_eps, config.norm_unit_offset)
        self.qk_norm = config.qk_norm
        # query_pre_attn_scalar**-0.5 where a config sets it: q scaled after its rotation, every attention path
        # (and the kernel) then applying head_dim**-0.5 as usual
        scalar = config.query_pre_attn_scalar
        self.q_scale = 1.0 if scalar is None or scalar == hd else (hd / scalar) ** 0.5

    def forward(
        self,
        x: torch.Tensor,  # [B, T, d]
        cos: torch.Tensor,  # [B, 1, T, hd]
        sin: torch.Tensor,  # [B, 1, T, hd]
        layer: int,
        segments: list[Segment],  # one per sequence whose rows are in x (a plain forward: one covering all rows)
    ) -> torch.Tensor:
        B, T, _ = x.shape
        gate = None
        q, k, v = together(x, (self.q_proj, self.k_proj, self.v_proj))  # one kernel call where they run there
        if self.output_gate:
            q, gate = q.view(B, T, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
            q, gate = q.contiguous(), gate.reshape(B, T, -1)
        else:
            q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.rotary_dim is not None:  # turned here; every attention path below then turns by the identity
            q, k, cos, sin = partial_rotary(q, k, cos, sin, self.head_dim)
        if len(segments) == 1:  # the common case slices nothing
            seg = segments[0]
            out = self._attend(q, k, v, cos, sin, seg.cache.k[layer], seg.cache.v[layer], seg)
        else:  # batch 1, rows ragged: slices along the rows stay contiguous
            out = torch.cat([
                self._attend(q[:, s.begin : s.end], k[:, s.begin : s.end], v[:, s.begin : s.end],
                             cos[:, :, s.begin : s.end], sin[:, :, s.begin : s.end], s.cache.k[layer],
                             s.cache.v[layer], s)
                for s in segments
            ], dim=2)  # fmt: skip
        out = out.transpose(1, 2).reshape(B, T, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        return self.o_proj(out)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, seg: Segment) -> torch.Tensor:
        """One sequence's rows: q [B, T, H, hd], k, v [B, T, Hkv, hd] -> attention output [B, H, T, hd]."""
        B, T = q.shape[:2]
        rows, attn_mask, write_pos = seg.rows, seg.attn_mask, seg.write_pos
        if (kernels := glue_kernels(q, k_cache)) is not None:  # rotary and cache writes in one call
            q = kernels.rope_store(q, k, v, cos.reshape(B, T, -1), sin.reshape(B, T, -1), k_cache, v_cache,
                                   write_pos)
        else:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, hd]
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            k_cache.index_copy_(2, write_pos, k.to(k_cache.dtype))  # a cache in another dtype rounds them
            v_cache.index_copy_(2, write_pos, v.to(v_cache.dtype))
        if self.q_scale != 1.0:
            q = q * self.q_scale
        native = (cpu_kernels() if rows is not None and q.is_cpu and self.head_dim % 8 == 0
                  and k_cache.dtype in NATIVE_KV_DTYPES and self.sinks is None else None)
        if native is None and k_cache.dtype != q.dtype:
            # torch's attention takes one dtype: the cache's keys and values widened, as far as they are read (the
            # native kernel reads them as they are)
            used = (attn_mask.shape[-1] if rows is None
                    else max([*rows.spans, *(max(e) + 1 for e in rows.extras if e)]))
            k_cache, v_cache = k_cache[:, :, :used].to(q.dtype), v_cache[:, :, :used].to(q.dtype)
        if self.sinks is not None:
            return self._attend_sinks(q, k_cache, v_cache, seg)
        if rows is None:
            keys, values = k_cache[:, :, : attn_mask.shape[-1]], v_cache[:, :, : attn_mask.shape[-1]]
            if seg.mask_rows:  # per row, as a one-row forward with the same mask width computes it
                return torch.cat([
                    F.scaled_dot_product_attention(q[:, :, j : j + 1], keys, values,
                                                   attn_mask=attn_mask[:, :, j : j + 1], enable_gqa=True)
                    for j in range(q.shape[2])
                ], dim=2)  # fmt: skip
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=attn_mask, enable_gqa=True)  # [B,H,T,hd]
        if native is not None and rows.starts is not None:  # a sliding window cut some row's first slots
            return windowed_decode_attention(native, q.float().contiguous(), k_cache, v_cache, rows).to(q.dtype)
        if native is not None:
            # Each row by one fixed sequence of operations whatever T is: rows agree bit for bit with T = 1.
            out = native.decode_attention(q.float().contiguous(), k_cache, v_cache, rows.spans, rows.extras)
            return out.to(q.dtype)
        if not rows.extras:  # one query per call, exactly the call a one-token forward makes: rows agree bit for bit
            return torch.cat([
                F.scaled_dot_product_attention(q[:, :, j : j + 1], k_cache[:, :, rows.first(j) : span],
                                               v_cache[:, :, rows.first(j) : span], enable_gqa=True)
                for j, span in enumerate(rows.spans)
            ], dim=2)  # fmt: skip
        # Tree rows gather their slots: the same values as a one-token forward, maybe not the same last bits.
        parts = []
        for j in range(q.shape[2]):
            slots = rows.slots(j, q.device)
            parts.append(F.scaled_dot_product_attention(q[:, :, j : j + 1], k_cache[:, :, slots],
                                                        v_cache[:, :, slots], enable_gqa=True))
        return torch.cat(parts, dim=2)

    def _attend_sinks(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      seg: Segment) -> torch.Tensor:
        """_attend's last step with attention sinks: decode rows one query a call over their own slots, a masked
        forward in one call (or one per row, `mask_rows`). The caches are in q's dtype here."""
        if seg.rows is not None:
            return sink_decode_attention(q, k_cache, v_cache, self.sinks, seg.rows)
        width = seg.attn_mask.shape[-1]
        keys, values = k_cache[:, :, :width], v_cache[:, :, :width]
        if seg.mask_rows:
            return torch.cat([
                sink_attention(q[:, :, j : j + 1], keys, values, self.sinks, seg.attn_mask[:, :, j : j + 1])
                for j in range(q.shape[2])
            ], dim=2)  # fmt: skip
        return sink_attention(q, keys, values, self.sinks, seg.attn_mask)


class MLP(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gelu = config.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gelu:
            return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))
        return self.down_proj(silu_mul(self.gate_proj(x), self.up_proj(x)))


class Block(nn.Module):
    def __init__(self, config: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        d, eps, offset = config.hidden_size, config.rms_norm_eps, config.norm_unit_offset
        self.input_layernorm = RMSNorm(d, eps, offset)
        self.linear = layer in config.linear_layers  # Qwen3-Next: a gated DeltaNet layer instead of attention
        if self.linear:
            self.linear_attn = GatedDeltaNet(config)
        else:
            self.self_attn = Attention(config)
        # llama: the MLP's input norm; with sandwich norms (Gemma), the attention output's, and two around the MLP
        self.post_attention_layernorm = RMSNorm(d, eps, offset)
        self.mlp = SparseMoE(config) if layer in config.moe_layers else MLP(config)
        if config.sandwich_norms:
            self.pre_feedforward_layernorm = RMSNorm(d, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(d, eps, offset)
        self.sandwich = config.sandwich_norms


class Decoder(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        shape = (config.vocab_size, config.hidden_size)
        # Built on the meta device (a checkpoint's weights replace it at once): no random init, whose nn.init call
        # would import torch's compiler, ~1 s of a start.
        on_meta = torch.empty(0).is_meta
        self.embed_tokens = nn.Embedding(*shape, _weight=torch.empty(shape)) if on_meta else nn.Embedding(*shape)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_unit_offset)


class Transformer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # beside the weights; kept on the CPU while they are built on the meta device (their loader replaces them)
        inv_freq, where = rope_inv_freq(config), self.lm_head.weight.device
        self.register_buffer("inv_freq", inv_freq if where.type == "meta" else inv_freq.to(where), persistent=False)
        self._rotary_table: RotaryTable | None = None  # _rotary's, on the CPU
        self.rope_scale = rope_attention_factor(config)  # of the global layers' rope (YaRN's temperature)
        self.local_layers = frozenset(config.local_layers)  # sliding-window layers (models/windows.py)
        # their own rope theta (Gemma's), or the global layers' rope (gpt-oss's: no theta of their own)
        self.local_rope = bool(self.local_layers) and config.rope_local_theta is not None
        if self.local_rope:
            local = rope_inv_freq(config, local=True)
            self.register_buffer("inv_freq_local", local if where.type == "meta" else local.to(where),
                                 persistent=False)
        self._local_table: RotaryTable | None = None
        # each layer's place in the cache: among the attention layers, or (gated DeltaNet) among the recurrent ones
        kinds = (config.attention_layers, config.linear_layers)
        self.cache_layer = [kinds[i in config.linear_layers].index(i) for i in range(config.num_layers)]
        self._embed_scales: dict[torch.dtype, torch.Tensor] = {}  # sqrt(hidden_size) per activation dtype
        # Applied from outside, never by the network itself: the native decode stack once its linear layers are on
        # the CPU kernels (models/native.py, applied by weights/quantize.py), and a lone sequence's forwards as
        # CUDA graphs (models/cuda_graphs.py, use_graphs). None: the plain PyTorch layers below.
        self.native = None
        self.graphs = None
        # The KV cache's dtype where it is not the activations' (None: theirs): bfloat16 keys and values halve what
        # attention reads over a long context (weights/loading.py sets it from --kv-dtype).
        self.kv_dtype: torch.dtype | None = None

    @property
    def dtype(self) -> torch.dtype:  # of activations (the embedding may be in blocks)
        return self.model.norm.weight.dtype

    @property
    def cache_dtype(self) -> torch.dtype:  # of its keys and values
        return self.kv_dtype or self.dtype

    @property
    def device(self) -> torch.device:
        return self.model.norm.weight.device

    def new_cache(self, batch: int, max_len: int, lend: bool = True) -> KVCache:
        """A cache for `batch` rows of `max_len` slots; with graphs on, a lone sequence's is one of the caches
        the graphs know (larger than asked: it never grows)."""
        if lend and self.graphs is not None and batch == 1 and (cache := self.graphs.new_cache(max_len)) is not None:
            return cache
        c = self.config
        if c.linear_layers:  # keys and values of the attention layers, states of the recurrent ones
            return StateCache(len(c.attention_layers), batch, c.num_kv_heads, max_len, c.head_dim, self.cache_dtype,
                              self.device, len(c.linear_layers))
        return KVCache(c.num_layers, batch, c.num_kv_heads, max_len, c.head_dim, self.cache_dtype, self.device)

    @property
    def max_context(self) -> int:
        return self.config.max_position_embeddings

    def forward(
        self,
        tokens: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T] rotary positions
        cache: KVCache,
        attn_mask: torch.Tensor,  # [B or 1, 1, T, S] bool
        logits_from: int = 0,  # logits only for positions [logits_from, T): prefill needs the last one only
        decode: bool = False,  # compute every row exactly as a one-token forward would (decode and verify steps)
        feature_layers: tuple[int, ...] = (),  # layers whose inputs follow the final hidden state in `hidden`
    ) -> tuple[torch.Tensor, torch.Tensor]:
        write_pos = torch.arange(cache.length, cache.length + tokens.shape[1], device=tokens.device)  # [T]
        seg = Segment(0, tokens.shape[1], cache, write_pos, attn_mask, row_slots(attn_mask) if decode else None)
        hidden = self._layers(tokens, positions, [seg], feature_layers)  # [B, T, d (+ features)]
        logits = self.lm_head(hidden[:, logits_from:, : self.config.hidden_size]).float()  # [B, T - from, vocab]
        return self._capped(logits), hidden

    def forward_parts(self, parts: list[Part], feature_layers: tuple[int, ...] = ()
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One forward over several sequences' new tokens -> per part (logits [t - logits_from, vocab],
        hidden [t, d (+ features)]). Keys and values go into each part's own cache; the callers advance the
        lengths. Each part attends in its own mode (`Part.decode`)."""
        if self.graphs is not None and len(parts) == 1 and (out := self.graphs.run(parts[0], feature_layers)):
            return [out]
        segments, begin = [], 0
        for part in parts:  # the slots each writes: computed where the Python layers need them (an ATen call)
            part.row_argmax = None  # found anew by this forward's head, or not at all
            t = part.count
            rows = (part.rows or row_slots(part.attn_mask)) if part.decode else None
            segments.append(Segment(begin, begin + t, part.cache, None, None if rows else part.mask(), rows))
            begin += t
        # Each tensor operation between two forwards costs ~10 us on the caches the last one flushed: a lone
        # request's step takes views, not copies, and none where the whole tensor is the answer.
        one = len(parts) == 1
        native = self.native.stack(segments) if self.native is not None else None
        if native is not None and all(p.id_list is not None for p in parts):  # lists to the native call: no tensors
            ids = parts[0].id_list if one else [t for p in parts for t in p.id_list]
            at = parts[0].position_list if one else [t for p in parts for t in p.position_list]
            hidden = self.native.forward(native, ids, at, segments, feature_layers)  # [N, d (+ features)]
        else:
            tokens = parts[0].tokens if one else torch.cat([p.tokens for p in parts])  # [N]
            positions = parts[0].positions if one else torch.cat([p.positions for p in parts])
            if native is not None:
                hidden = self.native.forward(native, tokens, positions, segments, feature_layers)
            else:
                for s in segments:
                    s.write_pos = torch.arange(s.cache.length, s.cache.length + s.end - s.begin, device=tokens.device)
                hidden = self._layers(tokens[None], positions[None], segments, feature_layers)[0]
        size = self.config.hidden_size
        # The rows whose logits are wanted: slices where they are (every row, or one part's tail), else gathered
        if one and parts[0].logits_from == 0 and hidden.shape[1] == size:
            final = hidden
        elif one and hidden.shape[1] == size:  # a draft's chain: its last rows, one call (a 2-D index is ~15 us)
            final = hidden.narrow(0, parts[0].logits_from, hidden.shape[0] - parts[0].logits_from)
        elif one:
            final = hidden[parts[0].logits_from :, :size]
        elif all(p.logits_from == 0 for p in parts):
            final = hidden[:, :size]
        else:
            final = torch.cat([hidden[s.begin + p.logits_from : s.end, :size] for s, p in zip(segments, parts)])
        logits, argmax = self._head(final, parts)  # [sum of wanted, vocab], [sum of wanted] or None
        if one:  # the part's rows are every row: no slices
            if argmax is not None and parts[0].wants_argmax:
                parts[0].row_argmax = argmax
            return [(logits, hidden)]
        out, at = [], 0
        for seg, part in zip(segments, parts):
            count = seg.end - seg.begin - part.logits_from
            out.append((logits[at : at + count], hidden[seg.begin : seg.end]))
            if argmax is not None and part.wants_argmax:
                part.row_argmax = argmax[at : at + count]
            at += count
        return out

    def _head(self, final: torch.Tensor, parts: list[Part]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The LM head over `final` [N, d] -> (logits [N, vocab], each row's argmax or None). The argmax where a
        part wants it and the head finds it as it writes the logits (quantize.QuantLinear): read afterwards, a
        verify forward's logits come back from memory, the head having streamed its weights through the caches."""
        head = self.lm_head
        # float32 only: bfloat16 logits are rounded before their argmax is taken; none under a softcap (capped
        # logits can tie where the raw ones did not)
        plain = final.dtype == torch.float32 and self.config.final_logit_softcapping is None
        with_argmax = getattr(head, "forward_argmax", None) if plain else None
        if with_argmax is not None and any(p.wants_argmax for p in parts):
            logits, argmax = with_argmax(final)
            return logits, argmax if argmax.numel() else None  # empty: a row holds a NaN, torch's argmax decides
        logits = head.forward(final)  # [N, vocab]; no module call around it (no hooks here: ~10 us a forward)
        return self._capped(logits if logits.dtype == torch.float32 else logits.float()), None

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        """Final logit softcapping (cap * tanh(logits / cap)) where the config sets it."""
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def static_forward(self, tokens: torch.Tensor, positions: torch.Tensor, write_pos: torch.Tensor,
                       mask: torch.Tensor, cache: KVCache, last: torch.Tensor | None,
                       feature_layers: tuple[int, ...], mask_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's forward in fixed shapes, with no host sync (what a CUDA graph captures): tokens,
        positions, write_pos [R] (write_pos on the device, not read from cache.length), mask [R, S] over cache
        slots [0, S), one attention call (`mask_rows`: one per row) -> (logits [R, vocab], or [1, vocab] of row
        `last` [1]; hidden [R, ...])."""
        seg = Segment(0, tokens.numel(), cache, write_pos, mask[None, None], None, mask_rows)
        hidden = self._layers(tokens[None], positions[None], [seg], feature_layers)[0]
        final = hidden if last is None else hidden.index_select(0, last)
        return self._capped(self.lm_head(final[None, :, : self.config.hidden_size])[0].float()), hidden

    def _layers(self, tokens: torch.Tensor, positions: torch.Tensor, segments: list[Segment],
                feature_layers: tuple[int, ...]) -> torch.Tensor:
        """Embedding, every decoder layer and the final norm -> hidden states [B, T, d], then the inputs of
        `feature_layers` (what an EAGLE-style head drafts from), [B, T, d * (1 + len(feature_layers))]."""
        if tokens.shape[0] == 1 and self.native is not None and (native := self.native.stack(segments)) is not None:
            return self.native.forward(native, tokens[0], positions[0], segments, feature_layers)[None]
        x = self.model.embed_tokens(tokens)  # [B, T, d]
        if self.config.embed_scale:
            x = x * self.embed_scale(x.dtype)
        cos, sin = self._rotary(positions, x.dtype)  # [B, 1, T, hd] each
        local = self.local_layers
        if local:  # each row's window, found once for every local layer
            local_cos, local_sin = self._rotary(positions, x.dtype, local=True) if self.local_rope else (cos, sin)
            local_segments = windowed_segments(segments, positions, self.config.sliding_window)
        captured = []
        plans = plan_rows(segments) if self.config.linear_layers else None  # each row's parent state, once
        for i, block in enumerate(self.model.layers):
            if i in feature_layers:
                captured.append(x)
            at = self.cache_layer[i]  # its keys' (or its recurrent state's) place in the cache
            if block.linear:
                h = block.linear_attn(block.input_layernorm(x), at, plans)
            elif i in local:
                h = block.self_attn(block.input_layernorm(x), local_cos, local_sin, at, local_segments)
            else:
                h = block.self_attn(block.input_layernorm(x), cos, sin, at, segments)
            if block.sandwich:
                x = x + block.post_attention_layernorm(h)
                x = x + block.post_feedforward_layernorm(block.mlp(block.pre_feedforward_layernorm(x)))
            else:
                x = x + h
                x = x + block.mlp(block.post_attention_layernorm(x))
        x = self.model.norm(x)
        return torch.cat((x, *captured), dim=-1) if captured else x

    def embed_scale(self, dtype: torch.dtype) -> torch.Tensor:
        """sqrt(hidden_size) as the activations' dtype holds it (Gemma: 55.4256 is 55.5 in bfloat16)."""
        if dtype not in self._embed_scales:
            self._embed_scales[dtype] = torch.tensor(self.config.hidden_size**0.5).to(dtype)
        return self._embed_scales[dtype]

    def _rotary(self, positions: torch.Tensor, dtype: torch.dtype,
                local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [B, 1, T, head_dim] of the rotary angles at `positions` [B, T]. On the CPU, rows of tables
        computed once for positions up to a power of two (six tensor operations a forward were ~0.1 ms, a
        percent of a small draft model's forward); every forward reads the same table, so a position's values
        never depend on the forward it is in."""
        if positions.device.type != "cpu":  # no table: its length would need the largest position (a sync)
            angles = rotary_angles(positions, self.inv_freq_local if local else self.inv_freq)[:, None]
            scale = 1.0 if local else self.rope_scale
            return scaled_trig(angles.cos(), scale).to(dtype), scaled_trig(angles.sin(), scale).to(dtype)
        bound = int(positions.max()) + 1 if positions.numel() else 1
        cos, sin = self.rotary_rows(positions.reshape(-1), dtype, bound, local)
        shape = (positions.shape[0], 1, positions.shape[1], -1)
        return cos.view(shape), sin.view(shape)

    def rotary_rows(self, positions: torch.Tensor, dtype: torch.dtype,
                     bound: int, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [N, head_dim] at `positions` [N] (CPU), every one below `bound`: rows of the table."""
        cos, sin = self.rotary_tables(dtype, bound, local)
        return cos.index_select(0, positions), sin.index_select(0, positions)

    def rotary_tables(self, dtype: torch.dtype, bound: int, local: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole cos and sin tables [P, head_dim] (CPU), P >= `bound`; `local`: the sliding-window layers'."""
        inv_freq = self.inv_freq_local if local else self.inv_freq
        table = self._local_table if local else self._rotary_table
        if table is None or table.inv_freq is not inv_freq or table.dtype != dtype:
            table = RotaryTable(inv_freq, dtype, 1.0 if local else self.rope_scale)
            if local:
                self._local_table = table
            else:
                self._rotary_table = table
        return table.upto(bound)


def rows_exact(model: nn.Module) -> bool:
    """Whether each row of a decode-mode forward is bit for bit what a one-token forward gives, in forwards of any
    size: on the CPU with every linear layer on a kernel (a plain nn.Linear rounds a one-row product differently
    from a many-row one). Rows computed in one request can then stand for another's (prompt_cache.py). Never with
    recurrent layers: a prefix is their state too, which copied keys and values do not carry."""
    return prompt_as_decode_rows(model) and not any(isinstance(m, (nn.Linear, GatedDeltaNet)) for m in model.modules())


def prompt_as_decode_rows(model: nn.Module) -> bool:
    """Whether a prompt goes in as decode rows (`decode=True`), as the engine feeds it on the CPU: there every
    position of the target and of a draft model that reads its prompt is computed alike (the server and the CLI
    give the same tokens), and on the native layers that is no slower than one attention call over the prompt
    (faster: 200 vs 185 tokens/s for the 1.5B target over 1,000 tokens). On a GPU one attention call it is."""
    return model.device.type == "cpu"


def forward_each(model: nn.Module, parts: list[Part], feature_layers: tuple[int, ...] = ()
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`forward_parts` for a model without a ragged forward (transformers' models): one forward per part, which is
    correct but reads the weights once per part."""
    out = []
    for p in parts:
        logits, hidden = model(p.tokens[None], p.positions[None], p.cache, p.mask(), p.logits_from, p.decode,
                               feature_layers)
        out.append((logits[0], hidden[0]))
    return out
