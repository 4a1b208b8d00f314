"""Logits -> the distribution actually sampled, and sampling from it without a host sync.

The target distribution of a request is defined *after* temperature, top-k and top-p. Speculative sampling is
lossless with respect to that distribution only if the draft distribution goes through the very same transform,
so both sides call `to_probs` with the same `SamplingParams`.
"""

from __future__ import annotations

import torch

from specdecode.config import SamplingParams


def to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[..., vocab] logits -> [..., vocab] float32 probabilities (greedy: one-hot at the argmax)."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = logits.topk(params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already reach top_p; the top token always stays.
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row of [..., vocab] probabilities -> [...] int64.

    Exponential race: argmax(p / E) with E ~ Exp(1) picks index i with probability p_i, needs no cumsum and no
    host sync, and is driven by an explicit per-request generator.
    """
    race = torch.empty_like(probs).exponential_(generator=generator)
    race.clamp_min_(torch.finfo(race.dtype).tiny)  # a zero draw would turn p=0 into 0/0
    return (probs / race).argmax(-1)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen
