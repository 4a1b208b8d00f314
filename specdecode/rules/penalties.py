"""Penalties, biases and min_tokens: what a request's settings do to the target's logits at one forward's rows.

A row's logits are those after the root and one path of draft nodes, so the counts a penalty reads are the
output's so far plus the draft tokens on that row's path: exactly what plain decoding would have counted had it
emitted those tokens. That keeps speculation lossless for the penalised distribution (verify.py).

Meanings (OpenAI's and vLLM's): presence and frequency penalties count the output only; the repetition penalty
(Keskar et al. 2019) marks a token seen in the prompt or the output, dividing a positive logit by it and
multiplying a negative one; logit_bias is added first; EOS is impossible while fewer than min_tokens are out.
"""

from __future__ import annotations

from collections import Counter

import torch

from specdecode.config import SamplingParams


class Penalties:
    def __init__(self, params: SamplingParams, prompt_ids: list[int], eos_ids: tuple[int, ...]) -> None:
        self.presence = params.presence_penalty
        self.frequency = params.frequency_penalty
        self.repetition = params.repetition_penalty
        self.min_tokens = params.min_tokens
        self.eos = sorted(set(eos_ids))
        self.bias_ids = torch.tensor(sorted(params.logit_bias), dtype=torch.long)
        self.bias = torch.tensor([params.logit_bias[t] for t in sorted(params.logit_bias)], dtype=torch.float32)
        self.counts_output = bool(self.presence or self.frequency or self.repetition != 1)
        self.prompt = set(prompt_ids) if self.repetition != 1 else set()
        self.output: Counter[int] = Counter()  # emitted tokens so far (the root of the next forward included)
        self.emitted = 0

    def saw(self, tokens: list[int]) -> None:
        """These tokens were emitted."""
        self.emitted += len(tokens)
        if self.counts_output:
            self.output.update(tokens)

    def apply(self, logits: torch.Tensor, draft_tokens: list[int], on_path: torch.Tensor,
              depth: torch.Tensor) -> None:
        """In place on logits [rows, vocab]: row r follows the draft nodes on_path[r] marks ([rows, n] bool), at
        depth[r] ([rows]) draft tokens past the output."""
        if self.bias_ids.numel():
            logits[:, self.bias_ids.to(logits.device)] += self.bias.to(logits.device)
        if self.min_tokens and self.eos:
            early = (self.emitted + depth.to(logits.device)) < self.min_tokens  # [rows]
            if bool(early.any()):
                logits[early[:, None] & _columns(logits, self.eos)] = float("-inf")
        if self.counts_output:
            self._penalise(logits, draft_tokens, on_path)

    def _penalise(self, logits: torch.Tensor, draft_tokens: list[int], on_path: torch.Tensor) -> None:
        ids = sorted(self.output.keys() | self.prompt | set(draft_tokens))
        if not ids:
            return
        where = {t: i for i, t in enumerate(ids)}
        device = logits.device
        counts = torch.tensor([float(self.output[t]) for t in ids], device=device)[None]  # [1, U]
        if draft_tokens:  # each row adds the draft tokens on its path
            hot = torch.zeros(len(draft_tokens), len(ids), device=device)
            hot[torch.arange(len(draft_tokens)), torch.tensor([where[t] for t in draft_tokens])] = 1.0
            counts = counts + on_path.to(device).float() @ hot  # [rows, U]
        index = torch.tensor(ids, device=device)
        chosen = logits[:, index]  # [rows, U]
        if self.repetition != 1:
            seen = (counts > 0) | torch.tensor([t in self.prompt for t in ids], device=device)
            scaled = torch.where(chosen > 0, chosen / self.repetition, chosen * self.repetition)
            chosen = torch.where(seen, scaled, chosen)
        chosen = chosen - self.frequency * counts - self.presence * (counts > 0).float()
        logits[:, index] = chosen


def _columns(logits: torch.Tensor, ids: list[int]) -> torch.Tensor:
    """[1, vocab] True at `ids`."""
    mask = torch.zeros(1, logits.shape[-1], dtype=torch.bool, device=logits.device)
    mask[0, torch.tensor([i for i in ids if i < logits.shape[-1]], dtype=torch.long)] = True
    return mask
