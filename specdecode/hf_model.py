"""The engine's forward contract around any transformers `AutoModelForCausalLM`.

For architectures `model.py` does not implement. Slower (transformers' own cache and kernels) but still lossless:
the cache is a transformers `DynamicCache` cropped to the engine's absolute length before every forward, so
rollback works the same way. Only chain masks are supported (no tree drafts through this adapter).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specdecode.errors import SpecdecodeError
from specdecode.model import Part, forward_each


@dataclass
class HFConfig:
    eos_token_ids: tuple[int, ...]
    vocab_size: int


class HFCache:
    def __init__(self, max_len: int) -> None:
        from transformers import DynamicCache

        self.dynamic = DynamicCache()
        self.max_len = max_len
        self.length = 0

    def truncate(self, length: int) -> None:
        self.length = length

    def grow(self, max_len: int) -> None:
        self.max_len = max_len

    def reset(self) -> None:
        self.dynamic.crop(0)
        self.length = 0


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
        return HFCache(max_len)

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
        cache.dynamic.crop(start)
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
