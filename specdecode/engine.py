"""The speculative decoding loop for one request: prefill, then propose -> verify -> commit until a stop.

Each decode step feeds the target the last committed token (the root) followed by the draft, all in one forward;
the verifier keeps a path of the draft and adds one token of the target's own (sequence.py holds the request's
state and those steps; batch.py drives many requests through one forward). When the draft size is automatic, the
budget chooser (budget.py) first keeps the draft's best nodes for this machine's verify costs.
The engine knows token ids only; text, stop strings and chat templates live one layer up (api.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import torch

from specdecode.budget import CostCurve
from specdecode.config import SamplingParams
from specdecode.drafters.base import Drafter
from specdecode.errors import SpecdecodeError
from specdecode.model import prompt_as_decode_rows
from specdecode.sequence import MAX_AUTO_NODES, Sequence, Step
from specdecode.stats import GenerationStats

__all__ = ["MAX_AUTO_NODES", "Engine", "Step", "check_prompt"]


class Engine:
    def __init__(self, target: torch.nn.Module, drafter: Drafter, num_draft_tokens: int | None = 4,
                 max_len: int = 8192, costs: CostCurve | None = None) -> None:
        """`num_draft_tokens` None = automatic: up to MAX_AUTO_NODES, cut by the chooser from `costs`."""
        self.target = target
        self.drafter = drafter
        self.num_draft_tokens = num_draft_tokens
        self.costs = costs
        self.max_len = min(max_len, target.max_context)
        self.cache = None  # allocated on first use, reused across requests
        self.sequence: Sequence | None = None  # the request in progress, or the last one

    @property
    def stats(self) -> GenerationStats:
        """Statistics of the request in progress, or the last one."""
        return self.sequence.stats if self.sequence is not None else GenerationStats()

    @property
    def tokens(self) -> list[int]:
        """Prompt + emitted tokens of that request."""
        return self.sequence.tokens if self.sequence is not None else []

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 num_draft_tokens: int | None = None) -> Iterator[Step]:
        """Yield one Step per target forward; the first comes from prefill. Stats land in `self.stats`.
        `num_draft_tokens` overrides the engine's draft size for this request (None = the engine's)."""
        check_prompt(prompt_ids, self.max_len)
        k = self.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        if k is None and self.costs is None:
            raise SpecdecodeError("an automatic draft size needs the verify cost curve: give num_draft_tokens")
        return self._run(list(prompt_ids), params, k)

    @torch.inference_mode()
    def _run(self, tokens: list[int], params: SamplingParams, num_draft_tokens: int | None) -> Iterator[Step]:
        if self.cache is None:
            self.cache = self.target.new_cache(1, self.max_len)
        self.cache.reset()
        self.drafter.reset()
        seq = self.sequence = Sequence(tokens, params, self.drafter, self.cache, self.max_len,
                                       tuple(self.target.config.eos_token_ids), num_draft_tokens, self.costs,
                                       self.target.device)
        # A drafter that reads the target's inner layers (an EAGLE head) has them returned after the final hidden
        # state; set per request, since decoders in one process (the benchmark's) share the target.
        self.target.feature_layers = tuple(getattr(self.drafter, "feature_layers", ()))
        part = seq.prefill_part()
        logits, hidden = self.target(part.tokens[None], part.positions[None], self.cache, part.attn_mask,
                                     logits_from=part.logits_from, decode=prompt_as_decode_rows(self.target))
        step = seq.prefilled(part.tokens.numel(), logits[0], hidden[0])
        yield step
        while step.finish_reason is None:
            draft = seq.propose()
            if seq.auto and draft.scores and len(draft):
                ranked = sorted(draft.scores, reverse=True)
                seq.keep_best(self.costs.best_count(ranked, time.perf_counter() - seq.step_started))
            part = seq.verify_part()
            # decode=True: every row as a one-token forward of its path computes it, so `none` and every drafter
            # agree bit for bit.
            began = time.perf_counter()
            logits, hidden = self.target(part.tokens[None], part.positions[None], self.cache, part.attn_mask,
                                         decode=True)
            if seq.auto and self.target.device.type == "cpu":  # CUDA runs ahead of the clock: its curve stays
                self.costs = seq.costs = self.costs.observe(part.tokens.numel(), time.perf_counter() - began)
            step = seq.verified(logits[0], hidden[0])
            yield step


def check_prompt(prompt_ids: list[int], max_len: int) -> None:
    if not prompt_ids:
        raise SpecdecodeError("the prompt is empty: give at least one token")
    if len(prompt_ids) >= max_len:
        raise SpecdecodeError(
            f"the prompt has {len(prompt_ids)} tokens but the context window is {max_len}: "
            "shorten the prompt or raise max_len"
        )
