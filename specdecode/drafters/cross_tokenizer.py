"""A draft model with another tokenizer: it drafts in its own tokens, and its text comes back as the target's.

Each step the request's context is brought into the draft's tokens (token_bridge.DraftSide: only the new text and
a few tokens before it are tokenized again), the draft model's cache is rolled back to the longest prefix it shares
with them (never filled again from the start), the inner draft model drafts a greedy chain, and the chain's text is
tokenized by the target's tokenizer behind the context's last tokens (TokenBridge.to_target).

Why this is lossless, in verify.py's terms: the mapped tokens are a deterministic function of the context, so they
go to the verifier as point masses (`Draft.probs = None`), as prompt lookup's do. The verifier accepts a point-mass
token x with probability p(x) and on rejection samples from p with x removed, renormalised; the output is then
distributed as p whatever x was. The draft's own probabilities are over other tokens and never reach the verifier:
they only rank nodes for the planner (`scores`). The draft drafts greedily under sampling too, since a point mass
is accepted with probability p(x), which the draft's likeliest guess maximises as far as the draft knows.
"""

from __future__ import annotations

from collections.abc import Generator

import torch

from specdecode.config import SamplingParams
from specdecode.drafters.base import Draft, DraftContext
from specdecode.drafters.draft_model import DraftModelDrafter
from specdecode.drafters.wrapping import Wrapping
from specdecode.models.parts import Part
from specdecode.text.token_bridge import DraftSide, TokenBridge

GREEDY = SamplingParams()


class CrossTokenizerDrafter(Wrapping):
    name = "draft model (other tokenizer)"
    inner: DraftModelDrafter

    def __init__(self, inner: DraftModelDrafter, bridge: TokenBridge) -> None:
        super().__init__(inner)
        self.bridge = bridge
        self.side = DraftSide(bridge)
        self.cached: list[int] = []  # the draft tokens in the inner model's cache, in order
        self.fed: list[int] = []  # the context and the chain of the last draft, in the draft's tokens
        inner.name = self.name

    def fork(self) -> CrossTokenizerDrafter:
        return CrossTokenizerDrafter(self.inner.fork(), self.bridge)

    def reset(self) -> None:
        self.inner.reset()
        self.side.reset()
        self.cached, self.fed = [], []

    def behind(self, tokens: list[int]) -> int:
        return len(tokens) - self.side.read + max(0, len(self.side.ids) - len(self.cached) - 1)

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        return super().propose(ctx, max_tokens)

    def drafting(self, ctx: DraftContext, max_tokens: int) -> Generator[Part, torch.Tensor, Draft]:
        context = self.side.update(ctx.tokens) if max_tokens > 0 else None
        if not context:  # nothing asked, or the text ends inside a character: nothing to read yet
            self.fed = []
            return Draft.empty()
        self._roll_back(context)
        inner_ctx = DraftContext(context, GREEDY, None, plan=ctx.plan, max_depth=ctx.max_depth)
        guess = yield from self.inner.drafting(inner_ctx, max_tokens)
        self.fed = context + guess.token_list
        self.cached = self.fed[: self.inner.cache.length]  # the chain's fed tokens follow the context in order
        tokens, owners = self.bridge.to_target(ctx.tokens, guess.token_list)
        keep = min(max_tokens, ctx.max_depth)  # a target token may take less text than a draft token
        tokens, owners = tokens[:keep], owners[:keep]
        scores = [guess.scores[i] for i in owners] if guess.scores else None
        return Draft.chain(torch.tensor(tokens, dtype=torch.long), scores=scores)

    def commit(self, accepted: list[int], verified: list[int] | None = None) -> None:
        """Keep the whole drafted chain in the draft's cache: the next step's context shares a prefix with it up
        to where the target disagreed, and `_roll_back` cuts the rest then."""
        if not self.fed or self.inner.cache is None:
            return
        self.inner.commit(list(range(len(self.inner.kept))))
        self.cached = self.fed[: self.inner.cache.length]

    def _roll_back(self, context: list[int]) -> None:
        """Cut the draft's cache to the longest prefix it shares with `context`, the root left out (the inner
        drafter feeds it)."""
        shared = 0
        for mine, theirs in zip(self.cached, context):
            if mine != theirs:
                break
            shared += 1
        shared = min(shared, len(context) - 1)
        if self.inner.cache is not None and self.inner.cache.length > shared:
            self.inner.cache.truncate(shared)
        self.cached = self.cached[:shared]
