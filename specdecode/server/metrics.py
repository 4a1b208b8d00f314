"""Prometheus metrics for /metrics, named as vLLM names them (vllm:... -> specdecode:...) so dashboards carry over.

Everything lives on a private CollectorRegistry owned by one Metrics object (no module globals), so two
servers in one process, or tests, never share counters. prometheus_client objects are thread-safe: the
scheduler's worker thread records, the event loop only renders.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from specdecode.engine.stats import GenerationStats

P = "specdecode:"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64)
DRAFT_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16)


class Metrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, method: str, replica: str | None = None) -> None:
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name, "method": method}
        if replica:  # one of several replicas behind one endpoint (Ray Serve): its series stay apart
            labels["replica"] = replica
        names, r = list(labels), self.registry

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(P + name, doc, names + list(extra), registry=r)

        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.").labels(**labels)
        self.cached_prompt_tokens = counter("prompt_tokens_cached", "Of them, tokens copied from the prompt cache."
                                            ).labels(**labels)
        self.generation_tokens = counter("generation_tokens", "Tokens generated.").labels(**labels)
        self._finished = counter("request_success", "Finished requests by reason (stop, length, abort, error, timeout).",
                                 ("finished_reason",))
        self._rejected = counter("request_rejected", "Requests refused before generation, by HTTP status.",
                                 ("status",))
        self.num_drafts = counter("spec_decode_num_drafts", "Decode steps that verified a draft.").labels(**labels)
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.").labels(**labels)
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens",
                                           "Draft tokens accepted by the target.").labels(**labels)
        self._accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                         "Accepted draft tokens by depth in the draft (0 = first; a chain's "
                                         "position).", ("position",))
        self._drafted_per_pos = counter("spec_decode_num_drafts_per_pos",
                                        "Drafts that reached this depth (per-depth acceptance = accepted / this).",
                                        ("position",))
        self._drafted_by = counter("spec_decode_num_draft_tokens_by_drafter",
                                   "Draft tokens proposed, by the drafter that proposed them (hybrid chooses one "
                                   "per step).", ("drafter",))
        self._accepted_by = counter("spec_decode_num_accepted_tokens_by_drafter",
                                    "Draft tokens accepted, by the drafter that proposed them (acceptance = this / "
                                    "num_draft_tokens_by_drafter).", ("drafter",))
        self.num_tree_steps = counter("spec_decode_num_tree_steps",
                                      "Decode steps that verified a tree (several guesses at some depth).").labels(**labels)
        self.running = Gauge(P + "num_requests_running", "Requests generating now.", names,
                             registry=r).labels(**labels)
        self.waiting = Gauge(P + "num_requests_waiting", "Requests queued for the engine.", names,
                             registry=r).labels(**labels)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Arrival to first token (queue time included).",
                              names, buckets=TTFT_BUCKETS, registry=r).labels(**labels)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Time per output token after the first.",
                             names, buckets=ITL_BUCKETS, registry=r).labels(**labels)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to last token.", names,
                             buckets=E2E_BUCKETS, registry=r).labels(**labels)
        self.queue_time = Histogram(P + "request_queue_time_seconds", "Time spent waiting for the engine.",
                                    names, buckets=E2E_BUCKETS, registry=r).labels(**labels)
        self.batch_size = Histogram(P + "batch_size", "Requests with rows in one engine step (decoding and "
                                    "prefilling).", names, buckets=BATCH_BUCKETS, registry=r).labels(**labels)
        self.batch_rows = Histogram(P + "batch_rows", "Rows (tokens) in one engine step's target forward.", names,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512), registry=r).labels(**labels)
        self.draft_tokens_per_step = Histogram(
            P + "spec_decode_draft_tokens_per_step", "Draft tokens verified for one request in one step (0 = "
            "speculation off for it: the planner found drafting does not pay at this load).", names,
            buckets=DRAFT_BUCKETS, registry=r).labels(**labels)
        self.kv_reserved = Gauge(P + "kv_cache_reserved_tokens", "KV cache slots reserved by running requests.",
                                 names, registry=r).labels(**labels)
        self.kv_budget = Gauge(P + "kv_cache_budget_tokens", "KV cache slots all running requests may reserve.",
                               names, registry=r).labels(**labels)
        self.kv_usage = Gauge(P + "kv_cache_usage_perc", "Reserved share of the KV cache budget (0-1).", names,
                              registry=r).labels(**labels)
        self._kv_budget = 0
        self._labels = labels

    def record_step(self, info, running: int, kv_reserved: int) -> None:
        """One engine step: `info` is engine.StepInfo."""
        self.batch_size.observe(info.requests)
        self.batch_rows.observe(info.rows)
        for n in info.draft_tokens:
            self.draft_tokens_per_step.observe(n)
        self.running.set(running)
        self.kv_reserved.set(kv_reserved)
        self.kv_usage.set(kv_reserved / self._kv_budget if self._kv_budget else 0.0)

    def set_kv_budget(self, tokens: int) -> None:
        self._kv_budget = tokens
        self.kv_budget.set(tokens)

    def record_finished(self, stats: GenerationStats | None, reason: str, ttft_s: float | None,
                        e2e_s: float) -> None:
        """One request left the engine (stats is None when it was cancelled before it started)."""
        self._finished.labels(**self._labels, finished_reason=reason).inc()
        self.e2e.observe(e2e_s)
        if ttft_s is not None:
            self.ttft.observe(ttft_s)
        if stats is None:
            return
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.cached_prompt_tokens.inc(stats.cached_prompt_tokens)
        self.generation_tokens.inc(stats.new_tokens)
        self.num_drafts.inc(stats.drafts)
        self.num_draft_tokens.inc(stats.drafted_tokens)
        self.num_accepted_tokens.inc(stats.accepted_tokens)
        self.num_tree_steps.inc(stats.tree_steps)
        for pos, (drafted, accepted) in enumerate(zip(stats.drafted_at, stats.accepted_at)):
            self._accepted_per_pos.labels(**self._labels, position=str(pos)).inc(accepted)
            self._drafted_per_pos.labels(**self._labels, position=str(pos)).inc(drafted)
        for drafter, (drafted, accepted) in stats.by_drafter.items():
            self._drafted_by.labels(**self._labels, drafter=drafter).inc(drafted)
            self._accepted_by.labels(**self._labels, drafter=drafter).inc(accepted)
        for seconds in stats.token_latencies_s:
            self.itl.observe(seconds)

    def record_rejected(self, status: int) -> None:
        self._rejected.labels(**self._labels, status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
