"""The speculative decoding loop: prefill, then propose -> verify -> commit until a stop.

Each decode step feeds the target the last committed token (the root) followed by the draft, all in one forward
at explicit positions (a tree's nodes sit at their depth, under a mask that shows each node its ancestors only);
the verifier keeps a path of the draft and adds one token of the target's own; the cache keeps the root and the
accepted path (a chain's prefix by truncation, a tree's path moved into contiguous slots). When the draft size is
automatic, the budget chooser (budget.py) first keeps the draft's best nodes for this machine's verify costs.
Invariant between steps, asserted in the tests:
    cache.length == len(tokens) - 1      (the last token is emitted but not yet fed)
The engine knows token ids only; text, stop strings and chat templates live one layer up (api.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from specdecode.config import SamplingParams
from specdecode.budget import CostCurve
from specdecode.drafters.base import Draft, DraftContext, Drafter
from specdecode.errors import SpecdecodeError
from specdecode.masks import chain_mask, tree_mask
from specdecode.sampling import make_generator, sample, to_probs
from specdecode.stats import GenerationStats
from specdecode.verify import verify_chain, verify_tree

MAX_AUTO_NODES = 16  # the most draft tokens an automatic budget may verify (the measured cost curve's end)


@dataclass(slots=True)
class Step:
    tokens: list[int]  # emitted by this step, after stop cuts
    num_drafted: int
    num_accepted: int  # the first num_accepted of `tokens` (or fewer, after a cut) came from the draft
    finish_reason: str | None  # None, "stop" (EOS) or "length" (max_new_tokens or context)


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
        self.stats = GenerationStats()  # of the request in progress, or the last one
        self.tokens: list[int] = []  # prompt + emitted tokens of that request

    def generate(self, prompt_ids: list[int], params: SamplingParams,
                 num_draft_tokens: int | None = None) -> Iterator[Step]:
        """Yield one Step per target forward; the first comes from prefill. Stats land in `self.stats`.
        `num_draft_tokens` overrides the engine's draft size for this request (None = the engine's)."""
        if not prompt_ids:
            raise SpecdecodeError("the prompt is empty: give at least one token")
        if len(prompt_ids) >= self.max_len:
            raise SpecdecodeError(
                f"the prompt has {len(prompt_ids)} tokens but the context window is {self.max_len}: "
                "shorten the prompt or raise max_len"
            )
        k = self.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        if k is None and self.costs is None:
            raise SpecdecodeError("an automatic draft size needs the verify cost curve: give num_draft_tokens")
        return self._run(list(prompt_ids), params, k)

    @torch.inference_mode()
    def _run(self, tokens: list[int], params: SamplingParams, num_draft_tokens: int | None) -> Iterator[Step]:
        if self.cache is None:
            self.cache = self.target.new_cache(1, self.max_len)
        cache, drafter = self.cache, self.drafter
        cache.reset()
        drafter.reset()
        self.tokens = tokens
        stats = self.stats = GenerationStats(prompt_tokens=len(tokens))
        auto = num_draft_tokens is None
        stats.draft_budget = "auto" if auto else num_draft_tokens
        stats.verify_costs = self.costs if auto else None
        generator = None if params.greedy else make_generator(params.seed, self.target.device)
        eos = set() if params.ignore_eos else set(self.target.config.eos_token_ids)
        start = time.perf_counter()

        first, hidden = self._prefill(tokens, params, generator)
        stats.ttft_s = time.perf_counter() - start
        step = self._finish([first], 0, 0, tokens, params, eos)
        stats.new_tokens = len(step.tokens)
        stats.wall_s = stats.ttft_s
        yield step
        while step.finish_reason is None:
            t0 = time.perf_counter()
            # A budget larger than the room left is cut, never an error: nodes need cache slots, and a path
            # longer than the tokens still to generate would be cut after verification.
            budget = min(MAX_AUTO_NODES if auto else num_draft_tokens, self.max_len - len(tokens) - 1)
            depth_room = params.max_new_tokens - stats.new_tokens - 1
            ctx = DraftContext(tokens, params, generator, hidden, self.costs if auto else None, depth_room)
            proposed = budget > 0 and depth_room > 0
            draft = drafter.propose(ctx, budget) if proposed else Draft.empty()
            draft.check()
            draft = draft.within_depth(depth_room)
            if auto and draft.scores and len(draft):
                ranked = sorted(draft.scores, reverse=True)
                draft = draft.best(self.costs.best_count(ranked, time.perf_counter() - t0))
            node_depths = draft.depths()  # [n], once: the forward's positions and the statistics use it
            emitted, accepted, hidden = self._verify(tokens[-1], draft, node_depths, params, generator)
            if proposed:  # a drafter that was not asked has nothing to roll back or learn from
                drafter.commit(draft.as_proposed(accepted), draft.origin)
            step = self._finish(emitted, len(draft), len(accepted), tokens, params, eos)
            now = time.perf_counter()
            stats.record_step(len(draft), len(accepted), len(step.tokens), now - t0,
                              depth=int(node_depths.max()) if len(draft) else 0)
            stats.wall_s = now - start
            yield step

    def _prefill(self, tokens: list[int], params: SamplingParams,
                 generator: torch.Generator | None) -> tuple[int, torch.Tensor]:
        ids = torch.tensor([tokens], device=self.target.device)  # [1, T]
        positions = torch.arange(len(tokens), device=ids.device)[None]
        logits, hidden = self.target(ids, positions, self.cache, chain_mask(0, len(tokens), ids.device),
                                     logits_from=len(tokens) - 1)
        self.cache.truncate(len(tokens))  # the sampled first token becomes the root of the first decode step
        probs = to_probs(logits[0, -1], params)
        token = int(probs.argmax()) if params.greedy else int(sample(probs, generator))
        return token, hidden[0, -1:]

    def _verify(self, root: int, draft: Draft, node_depths: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], list[int], torch.Tensor]:
        """One target forward over [root, *draft]; -> (emitted tokens, accepted nodes, their hidden states)."""
        device = self.target.device
        start, n = self.cache.length, len(draft)
        ids = torch.cat((torch.tensor([root], device=device), draft.tokens.to(device)))[None]  # [1, n + 1]
        # A node's rotary position is its depth (a chain's: its index); it sees the prefix, the root and its
        # own ancestors.
        positions = (start + torch.cat((torch.zeros(1, dtype=torch.long, device=device), node_depths.to(device))))[None]
        chain = draft.is_chain
        mask = chain_mask(start, n + 1, device) if chain else tree_mask(start, draft.parents.to(device))
        # decode=True: every row as a one-token forward of its path computes it, so `none` and every drafter
        # agree bit for bit.
        began = time.perf_counter()
        logits, hidden = self.target(ids, positions, self.cache, mask, decode=True)
        if self.costs is not None and device.type == "cpu":  # CUDA runs ahead of the clock; its curve stays as measured
            self.costs = self.costs.observe(n + 1, time.perf_counter() - began)
        if chain:
            verdict = verify_chain(logits[0], draft.tokens.to(device), draft.probs, params, generator)
        else:
            verdict = verify_tree(logits[0], draft.tokens.to(device), draft.parents.tolist(), draft.probs, params,
                                  generator)
        accepted = verdict.accepted_nodes
        # Valid now: the root and the accepted nodes. The emitted last token is fed next step.
        if accepted == list(range(len(accepted))):
            self.cache.truncate(start + 1 + len(accepted))  # a prefix of the draft sits in place already
        else:
            self.cache.truncate(start + 1)
            self.cache.keep(torch.tensor(accepted, device=device) + start + 1)
        rows = torch.tensor([0] + [node + 1 for node in accepted], device=device)
        return verdict.emitted.tolist(), accepted, hidden[0, rows]

    def _finish(self, emitted: list[int], num_drafted: int, num_accepted: int, tokens: list[int],
                params: SamplingParams, eos: set[int]) -> Step:
        """Cut `emitted` at EOS or the token budget, append it to `tokens`, and say why generation ends."""
        reason = None
        for i, token in enumerate(emitted):
            if token in eos:
                emitted, reason = emitted[: i + 1], "stop"
                break
        room = params.max_new_tokens - (len(tokens) + len(emitted) - self.stats.prompt_tokens)
        if room <= 0:
            emitted, reason = emitted[: len(emitted) + room], reason or "length"
        tokens.extend(emitted)
        if reason is None and len(tokens) >= self.max_len:
            reason = "length"
        return Step(emitted, num_drafted, min(num_accepted, len(emitted)), reason)
