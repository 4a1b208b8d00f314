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
from specdecode.drafters.base import Drafter
from specdecode.engine import check_prompt
from specdecode.errors import SpecdecodeError
from specdecode.model import Part, forward_parts
from specdecode.sequence import MAX_AUTO_NODES, Sequence, Step

PREFILL_ROWS_BUSY = 64  # prompt rows per step while other requests decode (their inter-token latency)
PREFILL_ROWS_IDLE = 512  # prompt rows per step when nobody decodes
CHEAP_DRAFT = 0.02  # a drafter taking less than this share of the step always proposes (n-gram)
PRIOR_WEIGHT = 4.0  # drafted steps the batch-wide estimates weigh, for a request that has few of its own


@dataclass
class Outlook:
    """What drafting has been worth for one request: the gate's estimates."""

    draft_s: float = 0.0  # seconds its drafter takes per step (running average)
    nodes: float = 4.0  # nodes it verifies per drafted step (running average)


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
        self.prior = Outlook()  # batch-wide running estimates
        self.prior_gain = 1.0  # accepted tokens per drafted step, batch-wide
        self.last = StepInfo()
        self.eos = tuple(target.config.eos_token_ids)

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
        k = self.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        if k is None and self.costs is None:
            raise SpecdecodeError("an automatic draft size needs the verify cost curve: give num_draft_tokens")

    def add(self, prompt_ids: list[int], params: SamplingParams, num_draft_tokens: int | None = None) -> Sequence:
        """Start a request; it joins the next step. Check `can_admit` first (this raises when it cannot)."""
        self.check(prompt_ids, params, num_draft_tokens)
        if not self.can_admit(len(prompt_ids), params):
            raise SpecdecodeError("the batch is full: wait for a running request to finish")
        k = self.num_draft_tokens if num_draft_tokens is None else num_draft_tokens
        need = self.reservation(len(prompt_ids), params)
        # Slots are reserved in full but allocated as they fill: most answers end long before max_tokens.
        cache = self.target.new_cache(1, min(need, max(len(prompt_ids) + MAX_AUTO_NODES + 1, 256)))
        drafter = self.make_drafter()
        drafter.reset()
        seq = Sequence(prompt_ids, params, drafter, cache, self.max_len, self.eos, k, self.costs,
                       self.target.device)
        self.running.append(seq)
        self.reserved[seq] = need
        self.outlook[seq] = Outlook(self.prior.draft_s, self.prior.nodes)
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
        failed: list[tuple[Sequence, Exception]] = []
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
        failed += self._draft(decoding, prefill_rows)
        for seq in decoding:
            if any(seq is f for f, _ in failed):
                continue
            self._ensure_slots(seq, seq.cache.length + len(seq.draft) + 1)
            parts.append(seq.verify_part())
            owners.append(seq)
        if not parts:
            return self._finish(failed, [])
        began = time.perf_counter()
        outputs = forward_parts(self.target, parts, decode=True)
        rows = sum(p.tokens.numel() for p in parts)
        if self.costs is not None and self.target.device.type == "cpu":
            self.costs = self.costs.observe(rows, time.perf_counter() - began)
        results: list[tuple[Sequence, Step | Exception]] = []
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
        self.last = StepInfo(len(owners), rows, prefill_rows,
                             [len(s.draft) for s in decoding if not any(s is f for f, _ in failed)])
        return self._finish(failed, results)

    def _finish(self, failed: list[tuple[Sequence, Exception]],
                results: list[tuple[Sequence, Step | Exception]]) -> list[tuple[Sequence, Step | Exception]]:
        results = list(failed) + results
        for seq, outcome in results:
            if isinstance(outcome, Exception) or outcome.finish_reason is not None:
                self.remove(seq)
        return results

    def _draft(self, decoding: list[Sequence], prefill_rows: int) -> list[tuple[Sequence, Exception]]:
        """Every decoding request proposes (or skips) its draft; automatic ones are then cut together."""
        costs, failed = self.costs, []
        auto = [s for s in decoding if s.auto]
        drafting = set(self._gate(auto, len(decoding), prefill_rows)) if auto else set()
        for seq in decoding:
            seq.costs = costs  # as lowered by the forwards seen so far
            try:
                if seq.auto and seq not in drafting:
                    seq.skip_draft()
                else:
                    seq.propose(len(decoding) - 1, len(decoding) - 1 + prefill_rows)
            except Exception as e:  # noqa: BLE001 - see step()
                failed.append((seq, e))
        proposed = [s for s in auto if s in drafting and s.draft.scores and len(s.draft)]
        if not proposed:
            return failed
        draft_seconds = sum(s.draft_seconds for s in proposed)  # one after another on this thread
        fixed_rows = sum(len(s.draft) for s in decoding if not s.auto)
        ranked = sorted(((score, i, node) for i, s in enumerate(proposed) for node, score in enumerate(s.draft.scores)),
                        key=lambda t: (-t[0], t[1], t[2]))
        keep = costs.best_count([t[0] for t in ranked], draft_seconds, tokens=len(decoding),
                                rows=len(decoding) + prefill_rows + fixed_rows)
        counts = [0] * len(proposed)
        for _, i, _ in ranked[:keep]:
            counts[i] += 1
        for seq, count in zip(proposed, counts):
            seq.keep_best(count)
        return failed

    def _gate(self, auto: list[Sequence], decoding: int, prefill_rows: int) -> list[Sequence]:
        """The automatic requests that draft this step: best value per second first, while each beats the
        tokens per second the batch makes without it."""
        costs = self.costs
        rows = decoding + prefill_rows
        tokens, seconds = float(decoding), costs.cost(rows)
        chosen, candidates = [], []
        for seq in auto:
            look, gain = self.outlook[seq], self._gain(seq)
            n = max(1, round(look.nodes))
            extra = look.draft_s + costs.cost(rows + n) - costs.cost(rows)
            candidates.append((gain / max(extra, 1e-9), seq, gain, n, look.draft_s))
        for value, seq, gain, n, draft_s in sorted(candidates, key=lambda c: -c[0]):
            extra = draft_s + costs.cost(rows + n) - costs.cost(rows)
            if draft_s <= CHEAP_DRAFT * seconds or gain / max(extra, 1e-9) > tokens / seconds:
                chosen.append(seq)
                tokens, seconds, rows = tokens + gain, seconds + extra, rows + n
        return chosen

    def _gain(self, seq: Sequence) -> float:
        """Expected accepted draft tokens per drafted step: the request's own record, leaning on the batch's."""
        stats = seq.stats
        return (stats.accepted_tokens + PRIOR_WEIGHT * self.prior_gain) / (stats.drafts + PRIOR_WEIGHT)

    def _learn(self, seq: Sequence, step: Step) -> None:
        if not seq.proposed:
            return
        look, n = self.outlook[seq], len(seq.draft)
        look.draft_s = 0.7 * look.draft_s + 0.3 * seq.draft_seconds if seq.stats.drafts > 1 else seq.draft_seconds
        look.nodes = 0.7 * look.nodes + 0.3 * n
        self.prior.draft_s = 0.9 * self.prior.draft_s + 0.1 * seq.draft_seconds
        self.prior.nodes = 0.9 * self.prior.nodes + 0.1 * n
        if n:
            self.prior_gain = 0.95 * self.prior_gain + 0.05 * step.num_accepted

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
