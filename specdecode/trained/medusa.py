"""Medusa heads (Cai et al. 2024): K small heads on the target's last hidden state, head k guessing the token
k + 2 positions ahead (the target's own head guesses k + 1). Each head is a residual block, h + SiLU(W h + b),
starting as the identity (W = 0); all share one LM head over a reduced draft vocabulary (`head_tokens`), the
target's own rows for those tokens."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(slots=True)
class MedusaConfig:
    hidden_size: int
    num_heads: int
    draft_vocab: int

    def to_dict(self) -> dict:
        return asdict(self)


class MedusaHeads(nn.Module):
    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        d = config.hidden_size
        self.blocks = nn.ModuleList(nn.Linear(d, d) for _ in range(config.num_heads))
        self.lm_head = nn.Linear(d, config.draft_vocab, bias=False)
        self.register_buffer("head_tokens", torch.zeros(config.draft_vocab, dtype=torch.long))

    @property
    def device(self) -> torch.device:
        return self.head_tokens.device

    def forward(self, hidden: torch.Tensor, head: int) -> torch.Tensor:
        """[T, d] final hidden states -> head `head`'s logits [T, draft_vocab] over `head_tokens`."""
        hidden = hidden.float()
        return self.lm_head(hidden + F.silu(self.blocks[head](hidden))).float()
