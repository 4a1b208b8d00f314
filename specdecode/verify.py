"""Verification of draft tokens against the target: pure functions, lossless by construction.

Glossary (vLLM's):
- *draft* tokens: proposed by a drafter; `draft_probs` is the distribution they were drawn from (None = a point
  mass: the drafter was deterministic, as n-gram lookup or greedy drafting is).
- *target*: the model whose output distribution we must reproduce exactly; `target_probs` is its distribution
  after temperature / top-k / top-p.
- *accepted*: the draft prefix kept. *recovered*: the token sampled after a rejection. *bonus*: the token
  sampled from the target's last position when every draft token is accepted.
- *emitted* = accepted + one recovered or bonus token, so every verify step emits at least one token.

Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): accept draft token x with probability
min(1, target_probs(x) / draft_probs(x)); on the first rejection sample from norm(max(0, target_probs -
draft_probs)). The emitted token is then distributed exactly as target_probs. Greedy is the same rule with
one-hot distributions, done here directly as an argmax comparison: exact, and it consumes no random numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.config import SamplingParams
from specdecode.sampling import sample, to_probs


@dataclass(slots=True)
class Verdict:
    emitted: torch.Tensor  # [num_accepted + 1] int64: accepted draft tokens, then the recovered or bonus token
    num_accepted: int


def verify_chain(
    target_logits: torch.Tensor,  # [n + 1, vocab]: the target's logits after the last token and each draft token
    draft_tokens: torch.Tensor,  # [n] int64
    draft_probs: torch.Tensor | None,  # [n, vocab] after the same transform as the target, or None (point mass)
    params: SamplingParams,
    generator: torch.Generator | None,
) -> Verdict:
    n = draft_tokens.numel()
    if params.greedy:
        choice = target_logits.argmax(-1)  # [n + 1]
        num_accepted = int((draft_tokens == choice[:n]).cumprod(0).sum())  # the step's one host sync
        return Verdict(choice[: num_accepted + 1], num_accepted)

    target_probs = to_probs(target_logits, params)  # [n + 1, vocab]
    accept_probs = acceptance_probs(target_probs[:n], draft_tokens, draft_probs)  # [n]
    draws = torch.rand(n, generator=generator, device=target_probs.device)
    num_accepted = int((draws < accept_probs).cumprod(0).sum())
    if num_accepted < n:
        row_draft = None if draft_probs is None else draft_probs[num_accepted]
        weights = residual(target_probs[num_accepted], draft_tokens[num_accepted], row_draft)
    else:
        weights = target_probs[n]
    last = sample(weights, generator)
    return Verdict(torch.cat((draft_tokens[:num_accepted], last[None])), num_accepted)


def acceptance_probs(
    target_probs: torch.Tensor,  # [n, vocab]
    draft_tokens: torch.Tensor,  # [n]
    draft_probs: torch.Tensor | None,  # [n, vocab] or None
) -> torch.Tensor:
    """min(1, target_probs(x) / draft_probs(x)) for each draft token x -> [n]."""
    target_at = target_probs.gather(-1, draft_tokens[:, None]).squeeze(-1)
    if draft_probs is None:
        return target_at
    draft_at = draft_probs.gather(-1, draft_tokens[:, None]).squeeze(-1)
    # draft_at > 0 for a token the drafter actually sampled; the guard keeps a bad drafter from dividing by 0.
    return (target_at / draft_at.clamp_min(torch.finfo(draft_at.dtype).tiny)).clamp(max=1.0)


def residual(
    target_row: torch.Tensor,  # [vocab]
    draft_token: torch.Tensor,  # [] the rejected token
    draft_row: torch.Tensor | None,  # [vocab], or None for a point mass at draft_token
) -> torch.Tensor:
    """Unnormalised max(0, target - draft): what to sample from after a rejection -> [vocab].

    For a point mass this is the target with the rejected token zeroed. If rounding leaves nothing (target ==
    draft up to float error, where rejection is all but impossible), the target row itself is returned."""
    if draft_row is None:
        out = target_row.clone()
        out[draft_token] = 0.0
    else:
        out = (target_row - draft_row).clamp_min(0.0)
    return torch.where(out.sum() > 0, out, target_row)
