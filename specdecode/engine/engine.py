"""The speculative decoding engine: every running request advances in ONE target forward per step.

    engine = Engine(target, drafter, num_draft_tokens=None, costs=curve)
    seq = engine.add(prompt_ids, params)           # joins the next step
    for seq, step in engine.step(): ...             # one forward for everyone; finished requests leave
    for step in engine.generate(prompt_ids, params): ...   # one request alone: a batch of one

Each step, every decoding request the planner lets draft proposes its own draft (its own drafter, a fork of the
engine's), and the rows of all of them, [root, *draft] each, plus chunks of prompts still being prefilled, go
through one ragged forward (`forward_parts`: rows concatenated, no padding; attention per request against its own
cache). Each request is then verified with its own sampling settings and generator, keeps or drops its own cache
slots (sequence.py), and requests join or leave between steps. A long prompt is fed in chunks while others decode,
so it does not stall their inter-token latency. Draft models' forwards are batched across requests too
(drafters/lockstep.py). Every cost decision (who drafts, how many nodes are verified) is the planner's
(planner.py); the engine knows token ids only: text, stop strings and chat templates live one layer up (api.py).

Exactness: in decode mode every row is computed as its own one-token forward would be (the CPU kernels make rows
independent of each other), prompt chunks included on the CPU, so a request's tokens do not depend on what it was
batched with or how its prompt was chunked; a seeded sampled request draws from its own generator. On a GPU a
prompt chunk is one attention call (its kernels are not batch-invariant in any case).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from specdecode import settings
from specdecode.config import SamplingParams
from specdecode.drafters.base import Draft, DraftContext, Drafter
from specdecode.drafters.draft import Finished
from specdecode.drafters.lockstep import run_batched
from specdecode.drafters.prediction import PredictionDrafter
from specdecode.engine.sequence import Sequence, Step
from specdecode.errors import SpecdecodeError
from specdecode.models.cuda_graphs import use_graphs
from specdecode.models.kv_cache import KVCache, bytes_per_token
from specdecode.models.model import Transformer, prompt_as_decode_rows, rows_exact
from specdecode.models.parts import Part
from specdecode.models.prompt_cache import PromptCache
from specdecode.models.spare_cache import SpareCache
from specdecode.planner.budget import CostCurve
from specdecode.planner.planner import Planner
from specdecode.planner.tuning import MAX_AUTO_NODES, PREFILL_ROWS_ECHO

__all__ = ["Engine", "Sequence", "Step", "StepInfo", "check_prompt", "kv_budget_tokens"]


Outcome = tuple[Sequence, "Step | Exception"]


@dataclass
class StepInfo:
    """What one step did and where its time went: /metrics reads the last one, and a profiler is handed each as it
    ends (`Engine.on_step`), so nothing needs patching to time a step."""

    requests: int = 0  # requests with rows in the forward (decoding and prefilling)
    rows: int = 0
    prefill_rows: int = 0
    draft_tokens: list[int] = field(default_factory=list)  # per decoding request, the draft size verified
    draft_s: float = 0.0  # from the step's start to its target forward: prompt chunks, the planner, drafting
    forward_s: float = 0.0  # the target forward (on a GPU: its launch, the clock runs ahead of the device)
    verify_s: float = 0.0  # after it: verification, the caches kept, drafters' commits


class Engine:
    def __init__(self, target: torch.nn.Module, drafter: Drafter, num_draft_tokens: int | None = 4,
                 max_len: int = 8192, costs: CostCurve | None = None, max_running: int = 16,
                 kv_budget_tokens: int | None = None, prompt_cache: PromptCache | None = None,
                 cuda_graphs: bool | None = None, graph_rows: bool | None = None) -> None:
        """`drafter`: each request drafts with its own `drafter.fork()`. `num_draft_tokens` None = automatic
        (needs `costs`, the target's verify cost curve). `kv_budget_tokens`: cache slots all running requests may
        reserve together (None: max_running full windows). `prompt_cache`: recent prompts' keys and values, which
        a request starting with the same tokens copies instead of computing (used where prompts run as
        one-token forwards, so the copy is exact; None: every prompt is computed in full). `cuda_graphs`: on a GPU a
        lone request's forwards replay as CUDA graphs; `graph_rows`: attention one row at a time inside them (None:
        the settings', settings.py)."""
        self.target = target
        self.drafter = drafter
        self.num_draft_tokens = num_draft_tokens
        self.planner = Planner(costs)
        self.max_len = min(max_len, target.max_context)
        self.set_limits(max_running, kv_budget_tokens)
        self.running: list[Sequence] = []
        self.reserved: dict[Sequence, int] = {}
        self.last_step = StepInfo()
        self.on_step: Callable[[StepInfo], None] | None = None  # called with each step's record as it ends
        self.last: Sequence | None = None  # the request `generate` ran last
        self.eos = tuple(target.config.eos_token_ids)
        self.prompt_decode = prompt_as_decode_rows(target)
        # CUDA runs ahead of the clock: its curve stays as measured (asked once: a module's device is a lookup chain)
        self.times_forwards = target.device.type == "cpu"
        self.prompt_cache = prompt_cache if rows_exact(target) else None  # copied rows are the rows it would compute
        self.spare = SpareCache()  # the last lone request's cache, for the next
        # Requests whose prompt is in their cache and not yet in the prompt cache: copied when another request
        # arrives (it may share it) or when they leave. A lone request's prompt is then copied once, with its
        # answer, not once more after its prefill (a copy of ~6-17 MB for the 1.5B target).
        self.unstored: list[Sequence] = []
        # A drafter's own cache grows with the context too: the KV budget counts it, in target tokens.
        self.kv_scale = 1.0 + drafter.needs.cache_bytes_per_token / (bytes_per_token(target) or math.inf)
        chosen = settings.current()
        cuda_graphs = chosen.cuda_graphs if cuda_graphs is None else cuda_graphs
        graph_rows = chosen.graph_rows if graph_rows is None else graph_rows
        if cuda_graphs:  # on a GPU a lone request's forwards replay as CUDA graphs: launches cost the most there
            for model in (target, drafter.needs.forward_model):
                if isinstance(model, Transformer) and model.device.type == "cuda":
                    use_graphs(model, cache_len=self.max_len, rows_apart=graph_rows)

    def set_limits(self, max_running: int, kv_budget_tokens: int | None = None) -> None:
        self.max_running = max_running
        self.kv_budget_tokens = kv_budget_tokens or max_running * self.max_len

    @property
    def costs(self) -> CostCurve | None:
        """The verify cost curve, as the forwards seen so far have priced it."""
        return self.planner.costs

    # --- admission -------------------------------------------------------------------------------------------

    def reservation(self, prompt_len: int, params: SamplingParams) -> int:
        """Cache slots a request may need: prompt, every new token, and one full draft beyond."""
        return min(self.max_len, prompt_len + params.max_new_tokens + MAX_AUTO_NODES + 1)

    def kv_cost(self, slots: int) -> int:
        """What `slots` of a request weigh in the KV budget (in target tokens): its drafter's cache included."""
        return math.ceil(slots * self.kv_scale)

    @property
    def kv_reserved(self) -> int:
        return sum(self.kv_cost(slots) for slots in self.reserved.values())

    def can_admit(self, prompt_len: int, params: SamplingParams, count: int = 1) -> bool:
        """Whether `count` such requests (n > 1: one per choice) can start now."""
        return (len(self.running) + count <= self.max_running and self.kv_reserved
                + count * self.kv_cost(self.reservation(prompt_len, params)) <= self.kv_budget_tokens)

    def check(self, prompt_ids: list[int], params: SamplingParams, num_draft_tokens: int | None = None,
              prediction: list[int] | None = None, n: int = 1) -> None:
        """Raise SpecdecodeError for a request this engine could never run (`n`: its choices run at once)."""
        check_prompt(prompt_ids, self.max_len)
        if prediction is not None:
            check_prediction(prediction, self.max_len - len(prompt_ids))
        vocab = self.target.config.vocab_size
        if bad := [t for t in params.logit_bias if t >= vocab]:
            raise SpecdecodeError(f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {vocab})", "logit_bias")
        need = n * self.kv_cost(self.reservation(len(prompt_ids), params))
        if need > self.kv_budget_tokens:
            what = f"{n} choices need" if n > 1 else "the request needs"
            raise SpecdecodeError(f"{what} {need} KV cache slots (prompt + max_tokens + a draft each) but the KV "
                                  f"budget is {self.kv_budget_tokens}: lower max_tokens or n, or shorten the prompt",
                                  *(("n", None) if n > 1 else ("max_tokens", "context_length_exceeded")))
        if n > self.max_running:
            raise SpecdecodeError(f"n is {n} but at most {self.max_running} requests run at once: lower n", "n")
        self.planner.draft_size(num_draft_tokens, self.num_draft_tokens)

    def add(self, prompt_ids: list[int], params: SamplingParams, num_draft_tokens: int | None = None,
            prediction: list[int] | None = None, leader: Sequence | None = None) -> Sequence:
        """Start a request; it joins the next step. Check `can_admit` first (this raises when it cannot).
        `num_draft_tokens` overrides the engine's draft size for this request (None = the engine's).
        `prediction`: the output the client expects (Predicted Outputs), copied where the output follows it.
        `leader`: a running request with the same prompt (n > 1) whose prefill this one copies, not repeats."""
        self.check(prompt_ids, params, num_draft_tokens, prediction)
        if not self.can_admit(len(prompt_ids), params):
            raise SpecdecodeError("the batch is full: wait for a running request to finish")
        need = self.reservation(len(prompt_ids), params)
        spare = self.spare.cache  # the last request's, which `take` may lend: counted whole below
        # Slots are reserved in full but allocated as they fill: most answers end long before max_tokens.
        cache = self.spare.take(self.target, min(need, max(len(prompt_ids) + MAX_AUTO_NODES + 1, 256)))
        drafter = self.drafter.fork()
        k = self.planner.draft_size(num_draft_tokens, self.num_draft_tokens)
        if prediction is not None:
            drafter = PredictionDrafter(drafter, prediction)
            k = self.planner.prediction_size(k)  # a method that never drafts still copies the prediction
        seq = Sequence(prompt_ids, params, drafter, cache, self.max_len, self.eos, k, self.target.device,
                       self.target.config.vocab_size)
        seq.stats.verify_costs = self.costs if seq.auto else None
        if (leader is not None and leader in self.reserved and leader.prefilling and leader.tokens == seq.tokens
                and isinstance(cache, KVCache)):  # a transformers cache is not copied: it prefills on its own
            seq.leader = leader
        elif self._reuses_prompt(seq):  # at least the last prompt token is computed: its logits are the first token's
            self._store_prompts()
            seq.fed = seq.stats.cached_prompt_tokens = self.prompt_cache.reuse(cache, prompt_ids, len(prompt_ids) - 1)
        self.running.append(seq)
        # a lent cache (only to a request that starts alone) may be larger than this one needs: the budget counts
        # what it holds
        self.reserved[seq] = max(need, cache.max_len) if cache is spare else need
        self.planner.join(id(seq))
        return seq

    def remove(self, seq: Sequence) -> None:
        """Drop a request (finished, cancelled or failed); its cache is freed with it, or lent to the next one."""
        if seq in self.reserved:
            self.running.remove(seq)
            del self.reserved[seq]
            self.planner.leave(id(seq))
            for other in self.running:
                if other.leader is seq:  # its prefill will never come: it prefills on its own
                    other.leader = None
            prompt_unstored = seq in self.unstored
            if prompt_unstored:
                self.unstored.remove(seq)
            kept = False
            if seq.finish_reason is not None:
                seq.drafter.hear(Finished(seq.tokens[seq.stats.prompt_tokens :]))
                if self._reuses_prompt(seq):  # with its answer: a chat's next turn starts with both
                    kept = self.prompt_cache.store(seq.tokens[: min(seq.cache.length, len(seq.tokens))], seq.cache)
            if prompt_unstored and not kept:  # cancelled, failed, or its answer too long to keep: its prompt
                self.prompt_cache.store(seq.tokens[: seq.stats.prompt_tokens], seq.cache)
            if not self.running:  # lent to the next request; in a batch kept for none (the budget counts caches)
                self.spare.give(self.target, seq.cache)

    def stop(self, seq: Sequence, dropped: int) -> None:
        """A stop string one layer up ended `seq` inside its last step: its last `dropped` tokens are not output."""
        seq.stop(dropped)
        self.remove(seq)

    # --- one request alone ----------------------------------------------------------------------------------

    def generate(self, prompt_ids: list[int], params: SamplingParams, num_draft_tokens: int | None = None,
                 prediction: list[int] | None = None) -> Iterator[Step]:
        """Run one request alone: yield one Step per target forward that emitted tokens (the first from prefill).
        Its Sequence (tokens, stats) is `self.last`. Close the iterator to stop early."""
        if self.last is not None:
            self.remove(self.last)  # an earlier generate left unfinished (its iterator dropped, not closed)
            self.last = None  # its cache goes back to the model before the next one is lent
        if self.running:
            raise SpecdecodeError("generate runs one request alone; this engine is serving others (use add/step)")
        self.last = self.add(prompt_ids, params, num_draft_tokens, prediction)
        return self._run_alone(self.last)

    def _run_alone(self, seq: Sequence) -> Iterator[Step]:
        try:
            while seq in self.reserved:
                for _, outcome in self.step():
                    if isinstance(outcome, Exception):
                        raise outcome
                    yield outcome
        finally:
            self.remove(seq)  # closed early (a stop string) or failed

    # --- one step -------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def step(self) -> list[Outcome]:
        """One target forward for every running request -> the Steps of those that emitted tokens (a request
        still prefilling emits nothing), or the exception that ended one. Finished requests are removed."""
        started = time.perf_counter()
        decoding = [s for s in self.running if not s.prefilling]
        parts: list[Part] = []
        owners: list[Sequence] = []
        room = self.planner.prefill_rows(sum(1 + len(s.draft) for s in decoding))
        for seq in self.running:
            if seq.prefilling and room > 0 and seq.leader is None:
                n = min(room, seq.prompt_left, PREFILL_ROWS_ECHO if seq.prompt_logprobs is not None else room)
                self._ensure_slots(seq, seq.fed + n)
                parts.append(seq.prefill_part(n, self.prompt_decode))
                owners.append(seq)
                room -= n
        prefill_rows = sum(p.count for p in parts)
        results: list[Outcome] = self._draft(decoding, prefill_rows)
        broken = {id(seq) for seq, _ in results}
        decoding = [seq for seq in decoding if id(seq) not in broken]
        verifying = []
        for seq in decoding:
            try:  # a drafter's malformed draft (a token that is not an id) fails its own part: that request alone
                self._ensure_slots(seq, seq.cache.length + len(seq.draft) + 1)
                part = seq.verify_part()
            except Exception as e:  # noqa: BLE001
                results.append((seq, e))
                continue
            parts.append(part)
            owners.append(seq)
            verifying.append(seq)
        decoding = verifying
        if not parts:
            return self._finish(results)
        shares = [(p.count, getattr(p.cache, "length", 0)) for p in parts] if self.times_forwards else []
        began = time.perf_counter()
        # Every part in decode mode (prompts too, on the CPU): rows as if alone. Drafters of one engine are forks
        # of one, so they read the same target layers.
        outputs = self.target.forward_parts(parts, self.drafter.needs.feature_layers)
        rows = sum(p.count for p in parts)
        forwarded = time.perf_counter()
        if self.times_forwards:
            self.planner.observe(rows, forwarded - began, prefill_rows, shares)
        for seq, part, (logits, hidden) in zip(owners, parts, outputs):
            try:
                if seq.prefilling:
                    step = seq.prefilled(part.count, logits, hidden)
                    if step is not None:
                        results += self._copy_prefill(seq, logits[-1:])
                        if self._reuses_prompt(seq):  # kept when a request that may share it arrives, or as
                            self.unstored.append(seq)  # it leaves (with its answer): a copy only where it can serve
                else:
                    step = seq.verified(logits, hidden)
                    self.planner.learn(seq.record(), step.num_accepted)
            except Exception as e:  # noqa: BLE001 - a drafter's bug must cost one request, not the batch
                results.append((seq, e))
                continue
            if step is not None:
                results.append((seq, step))
        self.last_step = StepInfo(len(owners), rows, prefill_rows, [len(s.draft) for s in decoding],
                                  began - started, forwarded - began, time.perf_counter() - forwarded)
        if self.on_step is not None:
            self.on_step(self.last_step)
        return self._finish(results)

    def _store_prompts(self) -> None:
        """Keep the prompts of the running requests that were not kept yet (before a new request looks for its)."""
        for seq in self.unstored:
            self.prompt_cache.store(seq.tokens[: seq.stats.prompt_tokens], seq.cache)
        self.unstored.clear()

    def _reuses_prompt(self, seq: Sequence) -> bool:
        """Can `seq`'s prompt rows come from (and go to) the prompt cache? Not when it needs every prompt row
        computed: their logits (prompt logprobs) or their features (a drafter that reads every position)."""
        return (self.prompt_cache is not None and isinstance(seq.cache, KVCache) and seq.prompt_logprobs is None
                and not seq.needs.every_position)

    def _copy_prefill(self, leader: Sequence, last_logits: torch.Tensor) -> list[Outcome]:
        """The requests that wait for `leader`'s prompt (n > 1) take it now -> their first Steps."""
        out: list[Outcome] = []
        for seq in [s for s in self.running if s.leader is leader]:
            try:
                self._ensure_slots(seq, leader.fed)
                out.append((seq, seq.adopt_prefill(leader, last_logits)))
            except Exception as e:  # noqa: BLE001 - that request alone
                out.append((seq, e))
        return out

    def _finish(self, results: list[Outcome]) -> list[Outcome]:
        """Remove the requests that ended (finished or failed) -> `results`."""
        for seq, outcome in results:
            if isinstance(outcome, Exception) or outcome.finish_reason is not None:
                self.remove(seq)
        return results

    def _draft(self, decoding: list[Sequence], prefill_rows: int) -> list[tuple[Sequence, Exception]]:
        """The requests the planner chooses propose; the others decode plainly this step. Then the planner cuts
        the automatic drafts together."""
        lag = self.lag_of(decoding) if len(decoding) > 1 else None
        chosen = self.planner.choose([seq.record() for seq in decoding], prefill_rows, lag)
        asked: list[tuple[Sequence, int, DraftContext]] = []  # (request, budget, context) of those who draft
        early: list[tuple[Sequence, Exception]] = []
        for seq in decoding:
            if id(seq) not in chosen:
                seq.skip_draft()  # its drafter catches up when it drafts again
                continue
            try:  # the grammar's forced tokens are read here: a grammar's failure costs this request alone
                budget, ctx = seq.draft_request(self.planner.plan(seq.auto, len(decoding), prefill_rows))
                if not seq.proposed:  # nothing to draft, or the grammar's forced tokens
                    seq.proposed_draft(Draft.empty(self.target.device))
            except Exception as e:  # noqa: BLE001
                early.append((seq, e))
                continue
            if seq.proposed:
                asked.append((seq, budget, ctx))
        failed = early + self._propose_all(asked)
        broken = {id(s) for s, _ in failed}
        live = [s for s in decoding if id(s) not in broken]
        kept = self.planner.cut([s.record() for s in live], prefill_rows)
        for seq in live:
            if id(seq) in kept:
                seq.keep_best(kept[id(seq)])
        return failed

    @staticmethod
    def lag_of(decoding: list[Sequence]) -> Callable[[int], tuple[int, float]]:
        """What the planner's gate may ask of these requests, by key (planner.Lag)."""
        by_key = {id(seq): seq for seq in decoding}
        return lambda key: by_key[key].lag()

    def _propose_all(self, asked: list[tuple[Sequence, int, DraftContext]]) -> list[tuple[Sequence, Exception]]:
        """Every asked drafter proposes. Those whose forwards batch (a draft model's) run together, one forward of
        their model per depth for all of them (drafters/lockstep.py); the others one after another. Each request
        is charged its share of the time."""
        failed, together = [], []
        for seq, budget, ctx in asked:
            if seq.needs.forward_model is not None:
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
        drafts = run_batched([(seq.drafter.drafting(ctx, budget), seq.needs.forward_model, seq.drafter)
                              for seq, budget, ctx in together])
        share = (time.perf_counter() - began) / len(together)
        self.planner.drafted_together(len(together))
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

    def _ensure_slots(self, seq: Sequence, needed: int) -> None:
        cache = seq.cache
        if cache.max_len < needed:
            cache.grow(min(self.reserved[seq], max(needed, 2 * cache.max_len)))


def check_prompt(prompt_ids: list[int], max_len: int) -> None:
    if not prompt_ids:
        raise SpecdecodeError("the prompt is empty: give at least one token", "max_tokens", "context_length_exceeded")
    if len(prompt_ids) >= max_len:
        raise SpecdecodeError(f"the prompt has {len(prompt_ids)} tokens but the context window is {max_len}: "
                              "shorten the prompt or raise max_len", "max_tokens", "context_length_exceeded")


def check_prediction(prediction: list[int], room: int) -> None:
    if not prediction:
        raise SpecdecodeError("the prediction is empty: leave it out, or give the text you expect the answer to be",
                              "prediction")
    # Longer than max_tokens is allowed, as OpenAI allows it: what is never reached counts as rejected. Longer than
    # the context window leaves after the prompt, it could never be the answer.
    if len(prediction) > room:
        raise SpecdecodeError(f"the prediction has {len(prediction)} tokens but the context window leaves {room} "
                              "after the prompt: shorten the prediction", "prediction", "context_length_exceeded")


def kv_budget_tokens(target: torch.nn.Module, gib: float) -> int | None:
    """Target tokens whose keys and values fit in `gib` GiB (None for a model whose cache size is unknown)."""
    per_token = bytes_per_token(target)
    return None if per_token is None else int(gib * 2**30 // per_token)
