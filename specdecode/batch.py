"""Continuous batching with speculation: every running request advances in ONE target forward per step.

Each step, every request that is decoding proposes its own draft (its own drafter, its own draft size) and the
rows of all of them, [root, *draft] each, plus chunks of prompts still being prefilled, go through one ragged
forward (`model.forward_parts`: rows concatenated, no padding; attention per request against its own cache).
Each request is then verified with its own sampling settings and generator, keeps or drops its own cache slots,
and requests join or leave between steps. A long prompt is fed in chunks of at most `prefill_rows` rows while
others are decoding, so it does not stall their inter-token latency.

Exactness: in decode mode every row is computed as its own one-token forward would be (the CPU kernels make rows
independent of each other), prompt chunks included, so a request's tokens do not depend on what it was batched
with or how its prompt was chunked; a seeded sampled request draws from its own generator.

Speculation that adapts to load. With an automatic draft size the verify cost curve C(m) decides for the whole
batch: a request drafts only when what it is expected to gain (its running accepted tokens per drafted step)
per second of extra work (its drafting time plus the verify rows it adds) beats the tokens per second the batch
makes without it; cheap drafters (n-gram) always propose. Then all proposed nodes, best scores first, are kept
while (tokens of the batch + their scores) / (drafting time + C(rows)) still grows: the single-request chooser
with every request's root in the base. As the batch grows, C's slope makes each extra row dearer, and drafts
shrink to nothing: plain decoding, batched.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specdecode.budget import CostCurve
from specdecode.config import SamplingParams
from specdecode.drafters.base import Draft, DraftContext, Drafter
from specdecode.drafters.lockstep import batches_forwards, run_batched
from specdecode.engine import check_prompt
from specdecode.errors import SpecdecodeError
from specdecode.model import Part, forward_parts
from specdecode.sequence import MAX_AUTO_NODES, Sequence, Step

PREFILL_ROWS_BUSY = 64  # prompt rows per step while other requests decode (their inter-token latency)
PREFILL_ROWS_IDLE = 512  # prompt rows per step when nobody decodes
CHEAP_DRAFT = 0.02  # a drafter taking less than this share of the step always proposes (n-gram)
CATCH_UP_STEPS = 8  # a draft model's catching up is paid back over at most this many steps of drafting
PRIOR_WEIGHT = 4.0  # drafted steps the batch-wide estimates weigh, for a request that has few of its own
# A request kept from drafting tries again after this many steps: its estimates would otherwise never change
# (one such request per step at most, so a full batch pays little for it).
EXPLORE_EVERY = 16
EXPLORE_BATCH = 2  # only in batches this small: in larger ones a draft model's retry (catching up) costs everyone


@dataclass
class Outlook:
    """What drafting has been worth for one request: the gate's estimates."""

    draft_s: float | None = None  # seconds its drafter takes per step (running average); None = not known yet
    nodes: float = 4.0  # nodes it verifies per drafted step (running average)
    steady: bool = False  # it drafted the step before too: no catching up in this step's drafting time
    idle: int = 0  # steps since it last drafted


@dataclass
class StepInfo:
    """What the last step did, for /metrics."""

    requests: int = 0  # requests with rows in the forward (decoding and prefilling)
    rows: int = 0
    prefill_rows: int = 0
    draft_tokens: list[int] = field(default_factory=list)  # per decoding request, the draft size verified


class BatchEngine:
    def __init__(self, target: torch.nn.Module, make_drafter: Callable[[], Drafter], num_draft_tokens: int | None,
                 max_len: int = 8192, costs: CostCurve | None = None, max_running: int = 16,
                 kv_budget_tokens: int | None = None) -> None:
        """`num_draft_tokens` None = automatic (needs `costs`). `kv_budget_tokens`: cache slots all running
        requests may reserve together (None: max_running full windows)."""
        self.target = target
        self.make_drafter = make_drafter
        self.num_draft_tokens = num_draft_tokens
        self.costs = costs
        self.max_len = min(max_len, target.max_context)
        self.max_running = max_running
        self.kv_budget_tokens = kv_budget_tokens or max_running * self.max_len
        self.running: list[Sequence] = []
        self.reserved: dict[Sequence, int] = {}
        self.outlook: dict[Sequence, Outlook] = {}
        self.prior = Outlook()  # engine-wide running estimates (over every request so far)
        self.prior_gain = 2.0  # accepted tokens per drafted step, batch-wide (hopeful until measured)
        self._alone_factor = 1.0  # a batched drafter's share of the last draft forwards -> its time alone
        self.last = StepInfo()
        self.eos = tuple(target.config.eos_token_ids)
        self.feature_layers: tuple[int, ...] = ()  # target layers the drafters read, set as requests arrive

    # --- admission -------------------------------------------------------------------------------------------

    def reservation(self, prompt_len: int, params: SamplingParams) -> int:
        """Cache slots a request may need: prompt, every new token, and one full draft beyond."""
        return min(self.max_len, prompt_len + params.max_new_tokens + MAX_AUTO_NODES + 1)

    @property
    def kv_reserved(self) -> int:
        return sum(self.reserved.values())

    def can_admit(self, prompt_len: int, params: SamplingParams) -> bool:
        return (len(self.running) < self.max_running
                and self.kv_reserved + self.reservation(prompt_len, params) <= self.kv_budget_tokens)

    def check(self, prompt_ids: list[int], params: SamplingParams, num_draft_tokens: int | None = None) -> None:
        """Raise SpecdecodeError for a request this engine could never run."""
        check_prompt(prompt_ids, self.max_len)
        need = self.reservation(len(prompt_ids), params)
        if need > self.kv_budget_tokens:
            raise SpecdecodeError(f"the request needs {need} KV cache slots (prompt + max_tokens + a draft) but "
                                  f"the server's KV budget is {self.kv_budget_tokens}: lower max_tokens or "
                                  "shorten the prompt")
        if self._draft_size(num_draft_tokens) is None and self.costs is None:
            raise SpecdecodeError("an automatic draft size needs the verify cost curve: give num_draft_tokens")

    def _draft_size(self, num_draft_tokens: int | None) -> int | None:
        """The request's draft size: its own, else the engine's (None = automatic)."""
        return self.num_draft_tokens if num_draft_tokens is None else num_draft_tokens

    def add(self, prompt_ids: list[int], params: SamplingParams, num_draft_tokens: int | None = None) -> Sequence:
        """Start a request; it joins the next step. Check `can_admit` first (this raises when it cannot)."""
        self.check(prompt_ids, params, num_draft_tokens)
        if not self.can_admit(len(prompt_ids), params):
            raise SpecdecodeError("the batch is full: wait for a running request to finish")
        need = self.reservation(len(prompt_ids), params)
        # Slots are reserved in full but allocated as they fill: most answers end long before max_tokens.
        cache = self.target.new_cache(1, min(need, max(len(prompt_ids) + MAX_AUTO_NODES + 1, 256)))
        drafter = self.make_drafter()
        drafter.reset()
        self.feature_layers = tuple(getattr(drafter, "feature_layers", ()))  # every request's drafter is alike
        seq = Sequence(prompt_ids, params, drafter, cache, self.max_len, self.eos,
                       self._draft_size(num_draft_tokens), self.costs, self.target.device)
        self.running.append(seq)
        self.reserved[seq] = need
        self.outlook[seq] = Outlook(None, self.prior.nodes)
        return seq

    def remove(self, seq: Sequence) -> None:
        """Drop a request (finished, cancelled or failed); its cache is freed with it."""
        if seq in self.reserved:
            self.running.remove(seq)
            del self.reserved[seq], self.outlook[seq]

    # --- one step -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[tuple[Sequence, Step | Exception]]:
        """One target forward for every running request -> the Steps of those that emitted tokens (a request
        still prefilling emits nothing), or the exception that ended one. Finished requests are removed."""
        decoding = [s for s in self.running if not s.prefilling]
        parts: list[Part] = []
        owners: list[Sequence] = []
        room = PREFILL_ROWS_BUSY if decoding else PREFILL_ROWS_IDLE
        for seq in self.running:
            if seq.prefilling and room > 0:
                n = min(room, seq.prompt_left)
                self._ensure_slots(seq, seq.fed + n)
                parts.append(seq.prefill_part(n))
                owners.append(seq)
                room -= n
        prefill_rows = sum(p.tokens.numel() for p in parts)
        failed = self._draft(decoding, prefill_rows)
        broken = {id(seq) for seq, _ in failed}
        decoding = [seq for seq in decoding if id(seq) not in broken]
        for seq in decoding:
            self._ensure_slots(seq, seq.cache.length + len(seq.draft) + 1)
            parts.append(seq.verify_part())
            owners.append(seq)
        results: list[tuple[Sequence, Step | Exception]] = list(failed)
        if not parts:
            return self._finish(results)
        began = time.perf_counter()
        self.target.feature_layers = self.feature_layers  # what the drafters read (engine.py)
        outputs = forward_parts(self.target, parts)  # every part in decode mode: rows as if alone
        rows = sum(p.tokens.numel() for p in parts)
        if self.costs is not None and self.target.device.type == "cpu":
            self.costs = self.costs.observe(rows, time.perf_counter() - began)
        for seq, part, (logits, hidden) in zip(owners, parts, outputs):
            try:
                if seq.prefilling:
                    step = seq.prefilled(part.tokens.numel(), logits, hidden)
                else:
                    step = seq.verified(logits, hidden)
                    self._learn(seq, step)
            except Exception as e:  # noqa: BLE001 - a drafter's bug must cost one request, not the batch
                results.append((seq, e))
                continue
            if step is not None:
                results.append((seq, step))
        self.last = StepInfo(len(owners), rows, prefill_rows, [len(s.draft) for s in decoding])
        return self._finish(results)

    def _finish(self, results: list[tuple[Sequence, Step | Exception]]) -> list[tuple[Sequence, Step | Exception]]:
        """Remove the requests that ended (finished or failed) -> `results`."""
        for seq, outcome in results:
            if isinstance(outcome, Exception) or outcome.finish_reason is not None:
                self.remove(seq)
        return results

    def _draft(self, decoding: list[Sequence], prefill_rows: int) -> list[tuple[Sequence, Exception]]:
        """Every decoding request proposes (or skips) its draft; automatic ones are then cut together."""
        costs, failed = self.costs, []
        auto = [s for s in decoding if s.auto]
        drafting = set(self._gate(auto, len(decoding), prefill_rows)) if auto else set()
        asked: list[tuple[Sequence, int, DraftContext]] = []  # (request, budget, context) of those who draft
        for seq in decoding:
            seq.costs = costs  # as lowered by the forwards seen so far
            # A drafter that skipped steps (or never drafted: a draft model's first call feeds it the prompt)
            # first catches up; that one-off must not count as what drafting costs per step.
            look = self.outlook[seq]
            look.steady = seq.proposed
            if seq.auto and seq not in drafting:
                look.idle += 1
                seq.skip_draft()
                continue
            look.idle = 0
            budget, ctx = seq.draft_request(len(decoding) - 1, len(decoding) - 1 + prefill_rows)
            if seq.proposed:
                asked.append((seq, budget, ctx))
            else:
                seq.proposed_draft(Draft.empty(self.target.device))
        failed += self._propose_all(asked)
        broken = {id(s) for s, _ in failed}
        proposed = [s for s in auto if s in drafting and id(s) not in broken and s.draft.scores and len(s.draft)]
        if not proposed:
            return failed
        draft_seconds = sum(s.draft_seconds for s in proposed)  # one after another on this thread
        fixed_rows = sum(len(s.draft) for s in decoding if not s.auto)
        ranked = sorted(((score, i, node) for i, s in enumerate(proposed) for node, score in enumerate(s.draft.scores)),
                        key=lambda t: (-t[0], t[1], t[2]))
        keep = costs.best_count([t[0] for t in ranked], draft_seconds, tokens=len(decoding),
                                rows=len(decoding) + fixed_rows, sunk_rows=prefill_rows)
        counts = [0] * len(proposed)
        for _, i, _ in ranked[:keep]:
            counts[i] += 1
        for seq, count in zip(proposed, counts):
            seq.keep_best(count)
        return failed

    def _propose_all(self, asked: list[tuple[Sequence, int, DraftContext]]) -> list[tuple[Sequence, Exception]]:
        """Every asked drafter proposes. Drafters written as generators (a draft model's) run together, their
        forwards batched (drafters/lockstep.py); the others one after another. Each request is charged its
        share of the time."""
        failed, together = [], []
        for seq, budget, ctx in asked:
            if batches_forwards(seq.drafter):
                together.append((seq, budget, ctx))
                continue
            began = time.perf_counter()
            try:
                seq.proposed_draft(seq.drafter.propose(ctx, budget))
            except Exception as e:  # noqa: BLE001 - a drafter's bug must cost one request, not the batch
                failed.append((seq, e))
            seq.draft_seconds = time.perf_counter() - began  # its own time, not the others' before it
        if not together:
            return failed
        began = time.perf_counter()
        drafts = run_batched([(seq.drafter.drafting(ctx, budget), seq.drafter.model, seq.drafter)
                              for seq, budget, ctx in together])
        share = (time.perf_counter() - began) / len(together)
        # What one of them would have taken alone (the gate's unit): the forwards' cost shared by k requests.
        self._alone_factor = len(together) * self.costs.cost(1) / self.costs.cost(len(together)) \
            if self.costs is not None else 1.0
        for (seq, _, _), draft in zip(together, drafts):
            if isinstance(draft, Exception):
                failed.append((seq, draft))
                continue
            try:
                seq.proposed_draft(draft)
            except Exception as e:  # noqa: BLE001
                failed.append((seq, e))
                continue
            seq.draft_seconds = share
        return failed

    def _gate(self, auto: list[Sequence], decoding: int, prefill_rows: int) -> list[Sequence]:
        """The automatic requests that draft this step. Cheap drafters (n-gram) always do: the node chooser
        decides what their guesses are worth. Of the others, best value per second first, the number k that
        maximises the batch's tokens per second: (decoding + their expected gains) / (C(decoding) + drafting time
        + what their rows add to the forward). Draft-model forwards are batched (lockstep.py), so k of them draft
        in about their one-request time times C(k) / C(1) (the target's curve standing in for the draft model's:
        the same architecture, smaller). Until a drafter's cost per step is known (from any request of this
        engine), one request at a time drafts to learn it: a draft model's first draft costs it the prompt,
        which a full batch should not pay for every request."""
        costs = self.costs
        rows = decoding + prefill_rows  # prompt rows are paid for anyway: drafting is weighed against decoding
        base_seconds = costs.cost(decoding)
        chosen, candidates, explorer = [], [], None
        for seq in auto:
            look, gain = self.outlook[seq], self._gain(seq)
            draft_s = look.draft_s if look.draft_s is not None else self.prior.draft_s
            if draft_s is None:
                explorer = explorer or seq
            elif draft_s <= CHEAP_DRAFT * base_seconds:
                chosen.append(seq)
            else:
                n, catch_up = max(1, round(look.nodes)), self._catch_up(seq, gain)
                value = gain / (draft_s + catch_up + costs.cost(rows + n) - costs.cost(rows))
                candidates.append((value, seq, gain, n, draft_s, catch_up, batches_forwards(seq.drafter)))
        if explorer is not None:
            chosen.append(explorer)
        candidates.sort(key=lambda c: -c[0])
        best, best_rate = 0, decoding / base_seconds
        tokens, nodes, alone_s, batched_s, batched, catch_ups = float(decoding), 0, 0.0, 0.0, 0, 0.0
        for k, (_, _, gain, n, draft_s, catch_up, together) in enumerate(candidates, start=1):
            tokens, nodes, catch_ups = tokens + gain, nodes + n, catch_ups + catch_up
            if together:
                batched, batched_s = batched + 1, batched_s + draft_s
            else:
                alone_s += draft_s
            drafting = alone_s + catch_ups + (batched_s / batched * costs.cost(batched) / costs.cost(1)
                                              if batched else 0.0)
            rate = tokens / (base_seconds + drafting + costs.cost(rows + nodes) - costs.cost(rows))
            if rate > best_rate:
                best, best_rate = k, rate
        chosen += [c[1] for c in candidates[:best]]
        stale = [c[1] for c in candidates[best:] if self.outlook[c[1]].idle >= EXPLORE_EVERY]
        if stale and explorer is None and decoding <= EXPLORE_BATCH:
            chosen.append(max(stale, key=lambda s: self.outlook[s].idle))
        return chosen

    def _catch_up(self, seq: Sequence, gain: float) -> float:
        """A draft model that sat out steps (or never drafted) first feeds what it missed, one forward over those
        rows (its cost taken as the target's curve scaled to the draft's one-row time), paid back over the steps
        the request has left."""
        drafter = seq.drafter
        behind = drafter.behind(seq.tokens) if hasattr(drafter, "behind") else 0
        if behind <= 2:  # the usual: the last token, maybe the last draft token
            return 0.0
        one_row = getattr(drafter, "forward_s", 0.0) or (self.prior.draft_s or 0.0) / 4
        steps_left = (seq.params.max_new_tokens - seq.stats.new_tokens) / (1.0 + gain)
        return one_row * self.costs.cost(behind) / self.costs.cost(1) / min(max(1.0, steps_left), CATCH_UP_STEPS)

    def _gain(self, seq: Sequence) -> float:
        """Expected accepted draft tokens per drafted step: the request's own record, leaning on the batch's."""
        stats = seq.stats
        return (stats.accepted_tokens + PRIOR_WEIGHT * self.prior_gain) / (stats.drafts + PRIOR_WEIGHT)

    def _learn(self, seq: Sequence, step: Step) -> None:
        if not seq.proposed:
            return
        look, n = self.outlook[seq], len(seq.draft)
        look.nodes = 0.7 * look.nodes + 0.3 * n
        self.prior.nodes = 0.9 * self.prior.nodes + 0.1 * n
        if look.steady:
            seconds, prior = seq.draft_seconds, self.prior.draft_s
            if batches_forwards(seq.drafter):
                seconds *= self._alone_factor
            look.draft_s = seconds if look.draft_s is None else 0.7 * look.draft_s + 0.3 * seconds
            self.prior.draft_s = seconds if prior is None else 0.9 * prior + 0.1 * seconds
        if n:
            self.prior_gain = 0.9 * self.prior_gain + 0.1 * step.num_accepted

    def _ensure_slots(self, seq: Sequence, needed: int) -> None:
        cache = seq.cache
        if cache.max_len < needed:
            cache.grow(min(self.reserved[seq], max(needed, 2 * cache.max_len)))


def kv_budget_tokens(target: torch.nn.Module, gib: float) -> int | None:
    """Cache slots that fit in `gib` GiB of keys and values (None for a model whose cache size is unknown)."""
    try:
        config = target.config
        per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * target.dtype.itemsize
    except AttributeError:
        return None
    return int(gib * 2**30 // per_token)
