"""One request's decoding state, advanced one target forward at a time by the engine (engine.py):

    prefill_part() -> target forward -> prefilled()        the prompt, in chunks; the first token
    draft_request() -> the drafter proposes -> proposed_draft() [keep_best()] -> verify_part() -> target forward
        -> verified()        each decode step

`verify_part` is [root, *draft] at explicit positions (a tree's nodes sit at their depth, under a mask that shows
each node its ancestors only); `verified` runs the verifier, keeps the root and the accepted path in the cache (a
chain's prefix by truncation, a tree's path moved into contiguous slots), lets the drafter commit, and cuts the
emitted tokens at EOS or the token budget. Invariant between decode steps, asserted in the tests:
    cache.length == len(tokens) - 1      (the last token is emitted but not yet fed)
"""

from __future__ import annotations

import operator
import time
from dataclasses import dataclass

import torch

from specdecode.config import SamplingParams
from specdecode.drafters.base import Draft, DraftContext, Drafter
from specdecode.drafters.draft import TargetSaw
from specdecode.engine.stats import GenerationStats
from specdecode.errors import SpecdecodeError
from specdecode.models.kv_cache import KVCache
from specdecode.models.masks import tree_row_slots
from specdecode.models.parts import Part, RowSlots, chain_part
from specdecode.planner.planner import Request
from specdecode.planner.prices import StepPlan
from specdecode.planner.tuning import MAX_AUTO_NODES
from specdecode.rules import OutputRules
from specdecode.sampling import greedy_tokens, make_generator, sample, to_probs
from specdecode.verify import verify_chain, verify_tree

# A token's log-probability under the target, and its `logprobs` likeliest alternatives as (token id, logprob)
TokenLogprob = tuple[float, list[tuple[int, float]]]


@dataclass(slots=True)
class Step:
    tokens: list[int]  # emitted by this step, after stop cuts
    num_drafted: int
    num_accepted: int  # the first num_accepted of `tokens` (or fewer, after a cut) came from the draft
    finish_reason: str | None  # None, "stop" (EOS) or "length" (max_new_tokens or context)
    drafter: str | None = None  # who proposed the accepted tokens (Drafter.proposer), None without a draft
    logprobs: list[TokenLogprob] | None = None  # per token, when the request asked (SamplingParams.logprobs)


class Sequence:
    def __init__(self, prompt_ids: list[int], params: SamplingParams, drafter: Drafter, cache: KVCache,
                 max_len: int, eos_token_ids: tuple[int, ...], num_draft_tokens: int | None,
                 device: torch.device, vocab_size: int | None = None) -> None:
        """`num_draft_tokens` None = automatic (the planner cuts each draft). `vocab_size`: the target's, which a
        drafter's token must be below (None: not checked)."""
        self.tokens = list(prompt_ids)
        self.params = params
        self.drafter = drafter
        self.cache = cache
        self.max_len = max_len
        self.num_draft_tokens = num_draft_tokens
        self.device = device
        self.vocab_size = vocab_size
        self.eos = set() if params.ignore_eos else set(eos_token_ids)
        self.generator = None if params.greedy else make_generator(params.seed, device)
        self.stats = GenerationStats(prompt_tokens=len(prompt_ids))
        if (counts := drafter.prediction_counts()) is not None:  # Predicted Outputs
            self.stats.prediction_tokens = counts[0]
        self.stats.draft_budget = "auto" if self.auto else num_draft_tokens
        self.fed = 0  # prompt tokens in the cache so far
        # Target hidden states for the drafter: of the last step's emitted tokens, or, for a drafter that reads
        # every position's features (an EAGLE head), of every position it has not seen yet.
        self.hidden: torch.Tensor | None = None
        self.needs = drafter.needs  # what it needs from this request's forwards, declared once
        self.draft = Draft.empty(device)
        self._depths: list[int] = []  # of this step's draft nodes, set by verify_part
        self._chain = True  # whether this step's draft is a chain, set by verify_part
        self._verifying: Part | None = None  # this step's verify part (its logits' row argmax, where found)
        self.proposed = False  # whether the drafter was asked this step (and so has something to commit)
        self.draft_seconds = 0.0  # what proposing took this step
        self.finish_reason: str | None = None
        self.started = self.step_started = time.perf_counter()
        self.rules = OutputRules(params, prompt_ids, eos_token_ids)
        self.free_draft = False  # this step's draft is the grammar's forced tokens, not the drafter's
        # Prompt logprobs (echo): None for the first token, which nothing predicts.
        self.prompt_logprobs: list[TokenLogprob | None] | None = None if params.prompt_logprobs is None else [None]
        self.leader: Sequence | None = None  # n > 1: the request whose prefill this one copies

    @property
    def auto(self) -> bool:
        return self.num_draft_tokens is None

    @property
    def prefilling(self) -> bool:
        return self.fed < self.stats.prompt_tokens

    @property
    def prompt_left(self) -> int:
        return self.stats.prompt_tokens - self.fed

    def prefill_part(self, max_rows: int, decode: bool) -> Part:
        """The next prompt tokens to feed (at most `max_rows`); `decode`: as one-token forwards would."""
        n = min(max_rows, self.prompt_left)
        every_row = self.prompt_logprobs is not None  # echo: each prompt token's logprob, from the row before it
        return chain_part(self.tokens[self.fed : self.fed + n], self.cache, 0 if every_row else n - 1, decode,
                          start=self.fed, device=self.device)

    def prefilled(self, n: int, logits: torch.Tensor, hidden: torch.Tensor) -> Step | None:
        """`n` prompt tokens went in (logits [1, vocab] of the last, hidden [n, d]); -> the first token's Step once
        the whole prompt is in, else None."""
        if self.prompt_logprobs is not None:
            known = min(n, self.stats.prompt_tokens - self.fed - 1)  # rows that predict a prompt token
            following = torch.tensor(self.tokens[self.fed + 1 : self.fed + 1 + known])
            self.prompt_logprobs += token_logprobs(logits[:known], following, self.params.prompt_logprobs)
        self.fed += n
        self.cache.truncate(self.fed)  # the sampled first token becomes the root of the first decode step
        if self.needs.every_position:
            self._hold(hidden)
        if self.prefilling:
            return None
        if not self.needs.every_position and self.needs.hidden:
            self.hidden = hidden[-1:]
        return self._first_token(logits[-1:])

    def adopt_prefill(self, leader: Sequence, last_logits: torch.Tensor) -> Step:
        """n > 1: take `leader`'s prefilled prompt (its cache, features, prompt logprobs) instead of computing it
        again, and sample this request's own first token from the prompt's last logits [1, vocab]."""
        fed = leader.fed
        self.cache.k[:, :, :, :fed] = leader.cache.k[:, :, :, :fed]
        self.cache.v[:, :, :, :fed] = leader.cache.v[:, :, :, :fed]
        self.fed, self.leader = fed, None
        self.cache.truncate(fed)
        self.hidden = None if leader.hidden is None else leader.hidden.clone()
        if leader.prompt_logprobs is not None and self.prompt_logprobs is not None:
            self.prompt_logprobs = list(leader.prompt_logprobs)
        return self._first_token(last_logits)

    def _first_token(self, logits: torch.Tensor) -> Step:
        """The prompt is in: sample the first token from its last row's logits [1, vocab]."""
        shaped = self.rules.shape(logits)
        probs = to_probs(shaped[-1], self.params)
        token = int(probs.argmax()) if self.params.greedy else int(sample(probs, self.generator))
        self._show_target(torch.tensor(self.tokens[-1:]), logits[-1:])
        stats = self.stats
        stats.ttft_s = time.perf_counter() - self.started
        step = self._finish([token], 0, 0, logits[-1:])
        stats.new_tokens = len(step.tokens)
        stats.wall_s = stats.ttft_s
        return step

    def draft_request(self, plan: StepPlan) -> tuple[int, DraftContext]:
        """Start a step: (how many nodes the drafter may propose, what it sees); `proposed` says whether to ask.
        `plan`: what the planner lets this draft cost."""
        self.step_started = time.perf_counter()
        # A budget larger than the room left is cut, never an error: nodes need cache slots, and a path longer
        # than the tokens still to generate would be cut after verification.
        budget = min(MAX_AUTO_NODES if self.auto else self.num_draft_tokens, self.max_len - len(self.tokens) - 1)
        depth_room = self.params.max_new_tokens - self.stats.new_tokens - 1
        ctx = DraftContext(self.tokens, self.params, self.generator, self.hidden, plan, depth_room,
                           self.rules if self.rules.active else None)
        self.proposed = budget > 0 and depth_room > 0
        # The grammar's forced tokens cost nothing to draft: even a request that drafts nothing else takes them.
        room = min(MAX_AUTO_NODES, self.max_len - len(self.tokens) - 1, depth_room)
        forced = self.rules.forced(room) if room > 0 else []
        self.free_draft = bool(forced)
        if forced:  # the grammar allows one continuation: a draft the drafter need not be asked for
            self.proposed = False
            self.draft = Draft.chain(forced, scores=[1.0] * len(forced), device=self.device)
        if self.proposed and self.needs.every_position:
            self.hidden = None  # the drafter takes these rows now
        return budget, ctx

    def proposed_draft(self, draft: Draft) -> Draft:
        """The drafter's answer to draft_request (or, when it was not asked, an empty one) -> this step's draft."""
        if self.free_draft:
            draft = self.draft
        draft.check()
        draft = draft.within_depth(self.params.max_new_tokens - self.stats.new_tokens - 1)
        legal = self.rules.cut(draft.token_list, draft.parent_list)
        self.draft = draft if legal is None or len(legal) == len(draft) else draft.select(legal)
        self.draft_seconds = time.perf_counter() - self.step_started
        return self.draft

    def skip_draft(self) -> None:
        """Decode this step without a draft (speculation does not pay now); the drafter catches up next time."""
        self.step_started = time.perf_counter()
        self.draft, self.proposed, self.draft_seconds = Draft.empty(self.device), False, 0.0
        self.free_draft = False

    def keep_best(self, count: int) -> None:
        self.draft = self.draft.best(count)

    def record(self) -> Request:
        """What the planner reads of this request now: plain values, no reference to it."""
        stats, draft = self.stats, self.draft
        return Request(id(self), self.auto, self.proposed, draft.scores, len(draft), self.draft_seconds,
                       self.needs.forward_model is not None, stats.accepted_tokens, stats.drafts,
                       self.params.max_new_tokens - stats.new_tokens, self.cache.length)

    def lag(self) -> tuple[int, float]:
        """(tokens its drafter's own state lacks, its seconds per forward where that is more than two, else 0): what
        the planner's gate asks of a request it weighs (planner.Lag)."""
        behind = self.drafter.behind(self.tokens)
        return behind, self.drafter.forward_s if behind > 2 else 0.0

    def verify_part(self) -> Part:
        """[root, *draft]: a node's rotary position is its depth (a chain's: its index); it sees the prefix, the
        root and its own ancestors. The tree's layout is worked out on lists: a draft has a few nodes, and tensor
        operations on so few cost more than the arithmetic."""
        draft, device = self.draft, self.device
        parents = draft.parent_list
        self._chain, self._depths = draft.is_chain, draft.depth_list()
        start = self.cache.length
        ids = [self.tokens[-1], *map(operator.index, draft.token_list)]
        # A drafter's token that is not an id of the target fails this request here, not the whole batch's forward
        if draft.token_list and (min(ids) < 0 or (self.vocab_size is not None and max(ids) >= self.vocab_size)):
            raise SpecdecodeError(f"a drafter proposed a token outside the vocabulary [0, {self.vocab_size}): "
                                  f"{ids[1:]}")
        if self._chain:
            part = chain_part(ids, self.cache, device=device)
        else:
            spans, extras = tree_row_slots(start, parents)
            part = Part(ids, [start] + [start + d for d in self._depths], self.cache, None,
                        rows=RowSlots(spans, extras), device=device)  # its mask: tree_mask's
        # greedy verification of unshaped logits reads each row's argmax only: found as the LM head writes them
        part.wants_argmax = self.params.greedy and not self.rules.active
        self._verifying = part
        return part

    def verified(self, logits: torch.Tensor, hidden: torch.Tensor) -> Step:
        """The target's logits [n + 1, vocab] and hidden states [n + 1, d] over verify_part's rows -> the Step."""
        draft, params = self.draft, self.params
        start = self.cache.length
        chain = self._chain
        shaped = self.rules.shape(logits, draft.token_list, None if chain else draft.parent_list)
        part, self._verifying = self._verifying, None
        argmax = part.row_argmax if part is not None and shaped is logits else None
        if chain:
            verdict = verify_chain(shaped, draft.token_list, draft.probs, params, self.generator, argmax)
        else:
            verdict = verify_tree(shaped, draft.token_list, draft.parent_list, draft.probs, params, self.generator,
                                  argmax)
        accepted = verdict.accepted_nodes
        # Valid now: the root and the accepted nodes. The emitted last token is fed next step.
        if accepted == list(range(len(accepted))):
            self.cache.truncate(start + 1 + len(accepted))  # a prefix of the draft sits in place already
        else:
            self.cache.truncate(start + 1)
            self.cache.keep([start + 1 + node for node in accepted])
        if self.needs.hidden:  # a gather, ~0.1 ms on the caches a forward flushed: only for a head
            rows = hidden[torch.tensor([0] + [node + 1 for node in accepted], device=hidden.device)]
            if self.needs.every_position:
                self._hold(rows)
            else:
                self.hidden = rows
        if self.needs.target_topk:  # the rows' tokens, built only for a drafter that reads them
            self._show_target(torch.tensor([self.tokens[-1], *draft.token_list]), logits, draft.origin)
        if self.proposed:  # a drafter that was not asked has nothing to roll back or learn from
            self.drafter.commit(draft.as_proposed(accepted), draft.origin)
            if (counts := self.drafter.prediction_counts()) is not None:
                self.stats.accepted_prediction_tokens = counts[1]
        rows = [0] + [node + 1 for node in accepted]  # the row each emitted token was sampled from
        step = self._finish(verdict.emitted, len(draft), len(accepted), logits, rows)
        step.drafter = ("grammar" if self.free_draft else self.drafter.proposer) if len(draft) else None
        now = time.perf_counter()
        self.stats.record_step(len(draft), len(accepted), len(step.tokens), now - self.step_started,
                               depth=max(self._depths, default=0),
                               drafter=step.drafter, draft_s=self.draft_seconds)
        self.stats.wall_s = now - self.started
        return step

    def stop(self, dropped: int) -> None:
        """A stop string one layer up ended the request inside its last step: its last `dropped` tokens are not
        output (and not counted)."""
        if dropped:
            del self.tokens[-dropped:]
            self.stats.new_tokens -= dropped
        self.finish_reason = "stop"

    def _show_target(self, tokens: torch.Tensor, logits: torch.Tensor, proposed: list[int] | None = None) -> None:
        """A drafter that learns from the target's guesses (token recycling, lookahead) gets each row's likeliest
        next tokens (one: the argmax the greedy verifier computes too)."""
        if k := self.needs.target_topk:
            top = greedy_tokens(logits)[:, None] if k == 1 else logits.topk(k, dim=-1).indices
            self.drafter.hear(TargetSaw(tokens, top, proposed))

    def _hold(self, rows: torch.Tensor) -> None:
        self.hidden = rows if self.hidden is None else torch.cat((self.hidden, rows))

    def _finish(self, emitted: list[int], num_drafted: int, num_accepted: int, logits: torch.Tensor,
                rows: list[int] | None = None) -> Step:
        """Cut `emitted` at EOS or the token budget, append it to `tokens`, and say why generation ends.
        `logits`: the target's raw rows, `rows` the one each emitted token was sampled from (None: in order); read
        only when the request asked for logprobs (a copy of 152k-wide rows every step otherwise)."""
        reason = None
        for i, token in enumerate(emitted):
            if token in self.eos:
                emitted, reason = emitted[: i + 1], "stop"
                break
        room = self.params.max_new_tokens - (len(self.tokens) + len(emitted) - self.stats.prompt_tokens)
        if room <= 0:
            emitted, reason = emitted[: len(emitted) + room], reason or "length"
        self.tokens.extend(emitted)
        self.rules.emitted(emitted)
        if reason is None and len(self.tokens) >= self.max_len:
            reason = "length"
        self.finish_reason = reason
        logprobs = None
        if self.params.logprobs is not None:
            picked = logits if rows is None else logits[rows[: len(emitted)]]
            logprobs = token_logprobs(picked[: len(emitted)], torch.tensor(emitted), self.params.logprobs)
        return Step(emitted, num_drafted, min(num_accepted, len(emitted)), reason, logprobs=logprobs)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, top: int) -> list[TokenLogprob]:
    """Each token's log-probability under its row of raw target logits [t, vocab] (log-softmax: before
    temperature, penalties and grammar, as OpenAI and vLLM report them), with the row's `top` likeliest tokens.
    Each row alone: a row's numbers do not depend on how many rows a forward verified with it."""
    out = []
    for row, token in zip(logits.float(), tokens.tolist()):
        logp = row.log_softmax(-1)
        alternatives = []
        if top:
            values, ids = logp.topk(top)
            alternatives = list(zip(ids.tolist(), values.tolist()))
        out.append((float(logp[token]), alternatives))
    return out
