"""A separate, smaller model with the same tokenizer drafts a tree (or a chain) from its own KV cache.

It computes at most `window` prompt tokens (planner.DRAFT_WINDOW: the first few and the newest), so a long prompt
costs it little; a prefix it kept from an earlier request (a system prompt, a chat's earlier turns with their
answers) is copied, not computed, and read whole on top of the window. Bookkeeping with absolute lengths: below
`base_length` the draft cache holds a prefix of the request's tokens (its context from `skipped` tokens on, after
the window's head, when the prompt was cut). `propose` first catches up on the tokens the cache lacks (the last
emitted token; after a fully accepted draft also the last draft token, which was never fed), then grows the draft
depth by depth, best nodes first (EAGLE-2's dynamic tree): the `width` best nodes of the newest depth, by cumulative
draft probability, go through one batched draft forward under a tree mask, and each proposes its `width` most likely
tokens as children. With `expand` below `width` only the best nodes are fed on, and the other children stay leaves:
siblings that cost no draft compute at all, only the verify rows the planner decides they are worth. A chain is the
tree of width 1. Fed nodes sit in draft cache slots after `base_length`; `commit(accepted)` moves the accepted
path's fed nodes into place and drops the rest.

When to stop growing is the planner's answer (planner.StepPlan.grow): with the machine's verify cost curve
(automatic size), as soon as one more draft forward cannot pay for itself even if its best child were accepted
for sure; with a fixed size, at that depth or once the draft's confidence in its best new node falls below
`min_confidence`. Under sampling a node's confidence is
read from the distribution it was drawn from, never from the token drawn (see `_children`): which nodes reach the
verifier must not depend on their own draws, or the output distribution would drift.

Under sampling, children are drawn without replacement from the draft distribution q after the request's
temperature/top-k/top-p (Gumbel top-k: the order of the draw is the order of the perturbed scores), and each
child's row in `Draft.probs` is q with its earlier siblings removed: the distribution it was drawn from, which is
what the verifier's multi-round rule needs (verify.py). Under greedy, children are the top tokens, point masses.
"""

from __future__ import annotations

import time
from collections.abc import Generator

import torch

from specdecode.drafters.base import Draft, DraftContext
from specdecode.drafters.draft import Event, Finished, ForwardTook, Needs
from specdecode.drafters.tree_growth import DepthTrust, ForwardTime, GrowsTrees, Node
from specdecode.models.kv_cache import bytes_per_token
from specdecode.models.model import prompt_as_decode_rows, rows_exact
from specdecode.models.parts import Part, chain_part
from specdecode.models.prompt_cache import DRAFT_PROMPT_CACHE_MB, PromptCache
from specdecode.models.spare_cache import SpareCache

TREE_WIDTH = 3  # children per expanded node in a tree draft; 1 drafts a chain
# Nodes of a depth fed to the next draft forward in a tree. On a 2-core CPU feeding three cost 16.8 ms against
# 14.8 for one and lost speed; leaves as siblings cost no draft compute (BENCHMARKS.md).
TREE_EXPAND = 1
SINK_TOKENS = 4  # the first prompt tokens a windowed draft keeps, as attention sinks (StreamingLLM)
# Most tokens of a kept prefix a draft reads on top of its window: every draft forward reads their keys and values
# (~25 KB a token for the 0.5B, ~5% of its weights' bytes at this many)
KEPT_HEAD_MAX = 512


class DraftModelDrafter(GrowsTrees):
    name = "draft model"

    def __init__(self, model: torch.nn.Module, vocab_size: int, initial_len: int = 256,
                 min_confidence: float = 0.0, width: int = 1, max_depth: int = 8, expand: int | None = None,
                 head_tokens: torch.Tensor | None = None, clock: ForwardTime | None = None,
                 window: int | None = None, prompts: PromptCache | bool | None = None,
                 spare: SpareCache | None = None) -> None:
        """`head_tokens`: the vocabulary id of each logit of a draft head cut to frequent tokens
        (vocab_subset.cut_draft_head), None when it scores the whole vocabulary. `window`: the most prompt tokens
        it computes (its first `SINK_TOKENS`, or a longer prefix it copies, and the newest), None for the whole
        prompt. `prompts`: recent prompts' keys and values, shared with its forks (None: its own, where prompts
        run as one-token forwards, so that a copied row is the row it would compute; False: none)."""
        self.model = model
        self.device = model.device
        self.head_tokens = None if head_tokens is None else head_tokens.to(model.device)
        self.min_confidence = min_confidence
        self.width = width  # children per expanded node
        self.expand = width if expand is None else expand  # nodes of a depth that go through the next forward
        self.max_depth = max_depth
        self.vocab_size = vocab_size  # the target's; a draft vocab that is padded differently is cut or padded
        self.initial_len = initial_len
        self.cache = None
        self.base_length = 0  # cache length when the last draft started: the tokens both models agree on
        self.nodes: list[Node] = []  # the last draft's nodes, before the budget cut
        self.kept: list[int] = []  # which of them went into the Draft, in its order
        self.clock = clock or ForwardTime()  # running seconds of one draft forward, shared with its forks
        self.trust = DepthTrust()  # how far its scores can be believed in this request
        self.forwards = 0  # forwards of the last draft, its catching up excluded
        self.catching_up = False  # the forward now running feeds a prompt or steps this drafter sat out
        self.window = window
        # Exact rows only: what it copies is what it would compute. Where a window cuts a long prompt, what it reads
        # of it depends on what it kept (a seeded sampled request's draws may too, as with suffix decoding's pool;
        # greedy output never does)
        if prompts is None:
            prompts = PromptCache(DRAFT_PROMPT_CACHE_MB) if rows_exact(model) else False
        self.prompts = prompts if isinstance(prompts, PromptCache) else None
        self.skipped = 0  # prompt tokens left out of its cache (between the window's head and its newest tokens):
        # a cache slot past the head holds context token slot + skipped
        self.context: list[int] | None = None  # the request's tokens: the engine's list, which grows with the answer
        self.spare = spare or SpareCache()  # one finished fork's cache (a few MB), for the next fork's request
        self.needs = Needs(forward_model=model, cache_bytes_per_token=bytes_per_token(model) or 0)

    def fork(self) -> DraftModelDrafter:
        return DraftModelDrafter(self.model, self.vocab_size, self.initial_len, self.min_confidence, self.width,
                                 self.max_depth, self.expand, self.head_tokens, self.clock, self.window,
                                 False if self.prompts is None else self.prompts,  # decided once: no rescan
                                 self.spare)

    def memories(self) -> list:
        return [] if self.prompts is None else [self.prompts]

    def reset(self) -> None:
        if self.cache is not None:
            self.cache.reset()
        self.nodes, self.kept, self.base_length, self.skipped = [], [], 0, 0
        self.context = None
        self.trust = DepthTrust()

    @torch.inference_mode()
    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        return super().propose(ctx, max_tokens)

    def drafting(self, ctx: DraftContext, max_tokens: int) -> Generator[Part, torch.Tensor, Draft]:
        """`propose` as a generator: it yields each draft forward it needs (a Part over this drafter's cache), is
        sent that forward's logits, and returns the Draft. The engine runs every drafting request's at once,
        their forwards batched into one (lockstep.run_batched)."""
        self.forwards = 0
        if max_tokens <= 0:
            self.nodes, self.kept = [], []  # nothing for commit to learn from
            return Draft.empty()
        started = time.perf_counter()
        self._ensure_capacity(len(ctx.tokens) + self.max_depth * self.expand + 1)
        pending = ctx.tokens[self.cache.length + self.skipped :]  # [>= 1] tokens not yet in the draft cache
        self.catching_up = True
        self.context = ctx.tokens  # what its cache holds a prefix of (a wrapper may hand it a new list each step)
        if self.cache.length == 0 and len(pending) > 1:
            prompt, self.skipped, _ = self._windowed(pending[:-1])
            # What an earlier prompt shares with this one is copied (a system prompt, a chat's earlier turns).
            reused = self.prompts.reuse(self.cache, prompt, len(prompt)) if self.prompts is not None else 0
            if reused < len(prompt):
                # Each position computed as the target computes it (its prompt as the target reads its own), every
                # later token as a one-row decode. With 8-bit activations a last-bit difference can flip a
                # rounding, and a draft that rounds like the target guesses more of its near-ties right.
                yield self._chain_part(prompt[reused:], decode=prompt_as_decode_rows(self.model))
            if self.prompts is not None:
                self.prompts.store(prompt, self.cache)
            pending = pending[-1:]
        # The root, and the last token of a fully accepted draft: more than that are steps it sat out.
        self.catching_up = len(pending) > 2
        self.forwards += not self.catching_up
        logits = yield self._chain_part(pending)  # [1, vocab] after the root
        self.catching_up = False
        self.base_length = self.cache.length
        return (yield from self._grow_tree(logits, ctx, max_tokens, started, self._nodes_part))

    @property
    def drafting_s(self) -> float:
        """What its last draft cost: its forwards at the running time per forward, catching up excluded."""
        return self.forwards * self.forward_s

    def behind(self, tokens: list[int]) -> int:
        """Tokens its next draft first feeds: the prompt (as far as its window reads it, less what it copies), or
        steps it sat out."""
        if self.cache is None or self.cache.length == 0:
            prompt, _, copied = self._windowed(tokens[:-1])
            return len(prompt) - copied + 1  # and the root
        return len(tokens) - self.cache.length - self.skipped

    def _windowed(self, prompt: list[int]) -> tuple[list[int], int, int]:
        """(the prompt tokens its cache will hold, how many are left out, how many of those it holds its prompt
        cache has: copied, not computed). All of them, or with a `window` a head
        and the newest `window - SINK_TOKENS`. The head is the first SINK_TOKENS (small models lean their attention
        on the first positions) or, where longer, the prefix its prompt cache holds (copied, not computed: a system
        prompt, a chat's earlier turns), up to KEPT_HEAD_MAX. Positions follow the cache, so the window's tokens
        keep their distances to each other. Reading a long prompt costs a draft model about a third of the
        target's prefill, which a short answer never earns back (BENCHMARKS.md, "A window on the draft's
        prompt")."""
        kept = self.prompts.shared(prompt, len(prompt)) if self.prompts is not None else 0
        if self.window is None:
            return prompt, 0, kept
        head = max(SINK_TOKENS, min(kept, KEPT_HEAD_MAX))
        skipped = len(prompt) - head - (self.window - SINK_TOKENS)
        if skipped <= 0:
            return prompt, 0, kept
        return prompt[:head] + prompt[head + skipped :], skipped, min(kept, head)

    def hear(self, event: Event) -> None:
        if isinstance(event, Finished):
            self._finished()
        elif isinstance(event, ForwardTook) and not self.catching_up:  # many rows at once: not a draft forward's cost
            super().hear(event)

    def _finished(self) -> None:
        """Its cache holds the prompt and the answer as far as it fed them: kept, so that a chat's next turn, which
        starts with both, copies them (rows computed as the target's are, where its prompt cache is on). A
        windowed prompt's cache is no prefix of the next turn: not kept."""
        if self.cache is None:  # it never drafted
            return
        if self.prompts is not None and not self.skipped and self.context is not None:
            length = min(self.cache.length, len(self.context))  # its last accepted nodes may be past a stop's cut
            self.prompts.store(self.context[:length], self.cache)
        self.spare.give(self.model, self.cache)  # its request is over: the next one's cache
        self.cache = None

    def commit(self, accepted: list[int], verified: list[int] | None = None) -> None:
        # Accepted nodes that were fed stay, moved behind the agreed prefix; a node never fed (a leaf) ends them.
        if self.cache is None:  # nothing drafted yet (a request with a draft budget of 0)
            return
        self.learn_trust(accepted, verified)
        slots = []
        for index in accepted:
            slot = self.nodes[self.kept[index]].slot
            if slot < 0:
                break
            slots.append(slot)
        self.cache.truncate(self.base_length)
        if slots != list(range(self.base_length, self.base_length + len(slots))):
            self.cache.keep(slots)
        else:
            self.cache.truncate(self.base_length + len(slots))

    def _nodes_part(self, expand: list[int], nodes: list[Node]) -> Part:
        """One draft forward over the nodes `expand` (one depth), each seeing the prefix and its ancestors."""
        self.forwards += 1
        ids, positions, rows = self._place(expand, nodes, self.cache.length, self.base_length)
        return Part(ids, positions, self.cache, None, rows=rows, device=self.device)  # a mask, where read: from rows

    def _chain_part(self, tokens: list[int], decode: bool = True) -> Part:
        """A chain of tokens at the next cache positions; the logits of the last one."""
        return chain_part(tokens, self.cache, len(tokens) - 1, decode, device=self.device)

    def _ensure_capacity(self, needed: int) -> None:
        if self.cache is None:
            self.cache = self.spare.take(self.model, max(needed, self.initial_len))
        elif self.cache.max_len < needed:
            self.cache.grow(max(needed, 2 * self.cache.max_len))
