"""The engine's forward contract around any transformers `AutoModelForCausalLM`.

For architectures `model.py` does not implement. Slower (transformers' own cache and kernels) but still lossless:
the cache is a transformers `DynamicCache` with the model's own layer kinds, cut back to the engine's absolute
length before a forward, so rollback works the same way. Sliding-window layers keep every state since their last
cut (transformers' past recording), so a cut back to any length since then is exact; a cut further back (only a
draft's re-tokenized context asks for one) empties the cache, and the drafter feeds the context again. Only chain
masks are supported (no tree drafts through this adapter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specdecode.errors import SpecdecodeError
from specdecode.models.model import forward_each
from specdecode.models.parts import Part


@dataclass
class HFConfig:
    eos_token_ids: tuple[int, ...]
    vocab_size: int


class HFCache:
    def __init__(self, max_len: int, config=None) -> None:
        from transformers import DynamicCache

        self.dynamic = DynamicCache(config=config)
        for layer in self.dynamic.layers:
            if hasattr(layer, "activate_past_recording"):  # sliding-window layers: keep what a rollback needs
                layer.activate_past_recording()
        self.windowed = any(hasattr(layer, "sliding_window") for layer in self.dynamic.layers)
        self.max_len = max_len
        self.length = 0
        self.floor = 0  # shortest length a cut can reach exactly (the length at the last cut, in a windowed cache)

    def truncate(self, length: int) -> None:
        if length < self.floor:
            self.reset()
            return
        self.length = length

    def grow(self, max_len: int) -> None:
        self.max_len = max_len

    def reset(self) -> None:
        self.dynamic.reset()
        self.length = self.floor = 0

    def cut(self) -> None:
        """Drop the states past `length` before a forward."""
        held = self.dynamic.get_seq_length()
        if held > self.length:
            self.dynamic.crop(self.length - held)  # transformers takes the count to remove, negated
            if self.windowed:
                self.floor = self.length


class HFModel(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model.eval()
        hf = model.config
        eos = hf.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        self.config = HFConfig(eos_ids, hf.vocab_size)
        self.max_context = getattr(hf, "max_position_embeddings", 4096)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def new_cache(self, batch: int, max_len: int) -> HFCache:
        return HFCache(max_len, self.model.config)

    def forward(
        self,
        tokens: torch.Tensor,  # [B, T]
        positions: torch.Tensor,  # [B, T]
        cache: HFCache,
        attn_mask: torch.Tensor,  # [B or 1, 1, T, S]; must be causal over a contiguous prefix
        logits_from: int = 0,
        decode: bool = False,  # accepted for the shared contract; transformers' kernels are not batch-invariant
        feature_layers: tuple[int, ...] = (),  # as Transformer.forward
    ) -> tuple[torch.Tensor, torch.Tensor]:
        start, count = cache.length, tokens.shape[1]
        block = attn_mask[..., start:]  # a chain sees every earlier new row: a full lower triangle, nothing else
        if attn_mask.shape[-1] != start + count or not bool(block.eq(block.new_ones(count, count).tril()).all()):
            raise SpecdecodeError("tree drafts need the native model; this architecture runs through transformers")
        cache.cut()
        out = self.model(
            input_ids=tokens,
            position_ids=positions,
            past_key_values=cache.dynamic,
            use_cache=True,
            output_hidden_states=True,
            logits_to_keep=count - logits_from,
        )
        features = [out.hidden_states[i] for i in feature_layers]  # [i] is the input of layer i
        return out.logits.float(), torch.cat((out.hidden_states[-1], *features), dim=-1)

    def forward_parts(self, parts: list[Part], feature_layers: tuple[int, ...] = ()
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return forward_each(self, parts, feature_layers)
