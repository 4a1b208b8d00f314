"""A separate, smaller model with the same tokenizer drafts tokens one by one from its own KV cache.

Bookkeeping with absolute lengths: the draft cache always holds a prefix of the request's tokens. `propose` first
catches up on the tokens the cache lacks (the last emitted token; after a fully accepted draft also the last draft
token, which was never fed), then drafts. `commit(num_accepted)` truncates the cache to the accepted prefix.
Drafting stops early when the draft model is unsure (`min_confidence`), which adapts the draft length to the
text at no cost to exactness. Under sampling each token is drawn from the draft's distribution after the request's temperature/top-k/top-p,
and that distribution is returned for the verifier's ratio test; under greedy the draft is a point mass.
"""

from __future__ import annotations

import torch

from specdecode.drafters.base import Draft, DraftContext
from specdecode.masks import chain_mask
from specdecode.sampling import sample, to_probs


class DraftModelDrafter:
    def __init__(self, model: torch.nn.Module, vocab_size: int, initial_len: int = 1024,
                 min_confidence: float = 0.0) -> None:
        self.model = model
        # Adaptive length: stop drafting once the draft's own top probability falls below this, because an
        # unsure draft token is rarely accepted and every further guess costs a draft forward.
        self.min_confidence = min_confidence
        self.vocab_size = vocab_size  # the target's; a draft vocab that is padded differently is cut or padded
        self.initial_len = initial_len
        self.cache = None
        self.base_length = 0  # cache length when the last draft started: the tokens both models agree on

    def reset(self) -> None:
        if self.cache is not None:
            self.cache.reset()

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        if max_tokens <= 0:
            return Draft.empty()
        self._ensure_capacity(len(ctx.tokens) + max_tokens)
        pending = ctx.tokens[self.cache.length :]  # [>= 1] tokens not yet in the draft cache
        if self.cache.length == 0 and len(pending) > 1:
            # Each position computed as the target computes it: the prompt batched (its prefill), every later
            # token as a one-row decode. With 8-bit activations a last-bit difference can flip a rounding, and a
            # draft that rounds like the target guesses more of its near-ties right.
            self._forward(pending[:-1], decode=False)
            pending = pending[-1:]
        logits = self._forward(pending)
        self.base_length = self.cache.length
        tokens, probs = [], []
        for i in range(max_tokens):
            token, token_probs, confidence = self._choose(logits, ctx)
            tokens.append(token)
            probs.append(token_probs)
            if i + 1 == max_tokens or confidence < self.min_confidence:
                break  # the last draft token is fed on the next catch-up, and only if it is accepted
            logits = self._forward(token)
        draft_tokens = torch.cat(tokens)
        draft_probs = None if ctx.params.greedy else torch.stack(probs)
        return Draft.chain(draft_tokens, draft_probs)

    def commit(self, num_accepted: int) -> None:
        # Accepted draft tokens fed to the cache stay; rejected ones go. The last draft token was never fed.
        if self.cache is None:  # nothing drafted yet (a request with a draft budget of 0)
            return
        self.cache.truncate(min(self.cache.length, self.base_length + num_accepted))

    def _choose(self, logits: torch.Tensor, ctx: DraftContext) -> tuple[torch.Tensor, torch.Tensor | None, float]:
        """-> (token [1], the draft distribution or None for greedy, the draft's top probability)."""
        logits = self._fit_vocab(logits)  # [vocab]
        if ctx.params.greedy:
            token = logits.argmax(-1, keepdim=True)
            confidence = float(logits.float().softmax(-1)[token]) if self.min_confidence > 0 else 1.0
            return token, None, confidence
        probs = to_probs(logits, ctx.params)
        return sample(probs, ctx.generator)[None], probs, float(probs.max())

    def _forward(self, tokens: list[int] | torch.Tensor, decode: bool = True) -> torch.Tensor:
        """Feed tokens at the next cache positions; -> logits of the last one [vocab]."""
        ids = torch.as_tensor(tokens, dtype=torch.long, device=self.model.device).view(1, -1)  # [1, T]
        start, count = self.cache.length, ids.shape[1]
        positions = torch.arange(start, start + count, device=ids.device)[None]
        mask = chain_mask(start, count, ids.device)
        logits, _ = self.model(ids, positions, self.cache, mask, logits_from=count - 1, decode=decode)
        self.cache.truncate(start + count)
        return logits[0, -1]

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        size = logits.shape[-1]
        if size == self.vocab_size:
            return logits
        if size > self.vocab_size:
            return logits[: self.vocab_size]
        return torch.nn.functional.pad(logits, (0, self.vocab_size - size), value=float("-inf"))

    def _ensure_capacity(self, needed: int) -> None:
        if self.cache is None:
            self.cache = self.model.new_cache(1, max(needed, self.initial_len))
        elif self.cache.max_len < needed:
            self.cache.grow(max(needed, 2 * self.cache.max_len))
