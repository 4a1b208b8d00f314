"""Many HTTP clients, one engine: continuous batching with speculation (engine.py).

One worker thread owns the decoder's Engine: the thread that loaded the models, where the server built them on a
`ComputeThread` (compute.py: OpenMP is fast from one thread only). Each loop it admits waiting requests while the engine has room (a bound on
running requests and on reserved KV cache slots), runs ONE engine step for every running request, and hands
each request the text its step released. Requests join and leave between steps.

Fairness: a client is its peer address. Admission takes the waiting request of the client with the fewest
requests running (the earliest among ties), so a client that sends many requests gets its turn like every
other, never all the slots; a client may hold at most `max_per_client` requests, running and waiting
(beyond that: 429), and send at most its budget of prompt tokens a minute where one is set (budgets.py: 429). The worker never waits on a client: every chunk goes into that request's asyncio queue via
`loop.call_soon_threadsafe`, so a slow reader only lets its own queue grow (bounded by max_tokens). A request
whose client went away is cancelled: dropped if still waiting, or removed from the batch before the next step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field, replace
from typing import Any

from specdecode.api import release_text
from specdecode.config import SamplingParams, choice_seed
from specdecode.errors import SpecdecodeError
from specdecode.server.budgets import PromptTokenBudget
from specdecode.server.compute import ComputeThread
from specdecode.server.metrics import Metrics
from specdecode.text.stream import TextStream

log = logging.getLogger("specdecode.server")


@dataclass
class Chunk:
    """Text of one engine step, as the worker hands it to the request's event loop."""

    pieces: list[str]
    token_ids: list[int]
    from_draft: list[bool]
    finish_reason: str | None
    stats: dict[str, Any]  # GenerationStats.to_dict() after this step (a copy: the worker goes on mutating)
    drafted_by: list[str | None] = field(default_factory=list)  # per token: the drafter that proposed it
    logprobs: list | None = None  # per token (sequence.TokenLogprob), when the request asked
    prompt_logprobs: list | None = None  # with the first chunk of an echo request: per prompt token


@dataclass
class Failure:
    status: int
    message: str


class QueueFull(Exception):
    pass


class ClientLimit(Exception):
    pass


class ShuttingDown(Exception):
    pass


INTERNAL = "internal server error (see the server log)"


@dataclass(eq=False)
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    num_draft_tokens: int | None
    loop: asyncio.AbstractEventLoop
    client: str = ""
    prediction: list[int] | None = None  # Predicted Outputs: the answer the client expects, as token ids
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # Chunk... then a final Chunk or a Failure
    arrived: float = field(default_factory=time.perf_counter)
    seq: Any = None  # the engine's Sequence once admitted
    followers: list[Job] = field(default_factory=list)  # n > 1: the other choices, admitted with this one
    text: TextStream | None = None
    first_token_at: float | None = None
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Safe from any thread, any number of times."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    @property
    def members(self) -> list[Job]:
        """This job and the choices admitted with it."""
        return [self, *self.followers]

    def emit(self, event: Chunk | Failure) -> None:
        """Worker thread -> the request's event loop; never blocks."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel()


class Scheduler:
    def __init__(self, decoder, metrics: Metrics, max_waiting: int, max_running: int = 16,
                 max_per_client: int = 32, kv_budget_tokens: int | None = None,
                 compute: ComputeThread | None = None, on_fatal: Callable[[], None] | None = None,
                 request_timeout_s: float | None = None, prompt_tokens_per_minute: int | None = None) -> None:
        """`compute`: the thread the decoder was loaded on, which then runs the engine (None: a thread of its own).
        `on_fatal`: called once if the engine loop dies (`specdecode serve` then exits non-zero, for a supervisor
        to restart it). `prompt_tokens_per_minute`: each client's budget (budgets.py; None: none)."""
        self.decoder = decoder
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.max_per_client = max_per_client
        self.engine = decoder.engine
        self.engine.set_limits(max_running, kv_budget_tokens)
        self.default_num_draft_tokens = self.engine.num_draft_tokens
        self._waiting: list[Job] = []
        self._running: list[Job] = []
        self._per_client: Counter[str] = Counter()  # running + waiting
        self.prompt_budget = PromptTokenBudget(prompt_tokens_per_minute) if prompt_tokens_per_minute else None
        self._cond = threading.Condition()
        self._closing = threading.Event()
        self._draining = threading.Event()  # no new requests: the server is about to stop
        self._on_fatal = on_fatal
        self.request_timeout_s = request_timeout_s  # None: no deadline
        self.failed = False  # the engine loop died of an error outside any one request
        self._compute = compute
        self._worker: Future | None = None  # the engine loop, once started
        metrics.set_kv_budget(self.engine.kv_budget_tokens)

    def start(self) -> None:
        self._compute = self._compute or ComputeThread("specdecode-engine")
        self._worker = self._compute.submit(self._work)

    def stop(self, timeout: float = 30.0) -> None:
        """Fail what is waiting, stop the running requests after the current step, and join the worker."""
        with self._cond:
            self._closing.set()
            self._cond.notify_all()
        if self._worker is not None:
            wait([self._worker], timeout)

    @property
    def started(self) -> bool:
        return self._worker is not None

    @property
    def alive(self) -> bool:
        return self._worker is not None and not self._worker.done() and not self._closing.is_set()

    @property
    def ready(self) -> bool:
        """Alive and taking new requests (not draining)."""
        return self.alive and not self._draining.is_set()

    def drain(self, timeout: float) -> int:
        """Stop taking requests and wait up to `timeout` seconds for those queued or running to finish; then stop
        (the rest end with a 503 error their clients see) -> how many that was. Call from any thread but the
        engine's."""
        self._draining.set()
        deadline = time.monotonic() + timeout
        with self._cond:
            while (self._waiting or self._running) and self.alive and time.monotonic() < deadline:
                self._cond.wait(min(0.1, max(0.0, deadline - time.monotonic())))
            cut = sum(len(j.members) for j in self._waiting) + len(self._running)
        self.stop()
        return cut

    def check(self, prompt_ids: list[int], params: SamplingParams, num_draft_tokens: int | None = None,
              prediction: list[int] | None = None, n: int = 1) -> None:
        """Raise SpecdecodeError for a request the engine could never run (too long for the KV budget)."""
        self.engine.check(prompt_ids, params, num_draft_tokens, prediction, n)

    def submit(self, prompt_ids: list[int], params: SamplingParams, num_draft_tokens: int | None = None,
               client: str = "", prediction: list[int] | None = None, n: int = 1) -> Job:
        """Queue a request of `n` choices, one job each, admitted together (call from the event loop) -> the first
        (`members`: all of them); with a seed, choice i draws from seed + i. Raises QueueFull past max_waiting requests in line, ClientLimit when
        this client would hold more than max_per_client, and OverBudget when its prompt tokens are spent (the
        choices share one prefill: the prompt counts once)."""
        with self._cond:
            if self._per_client[client] + n > self.max_per_client:
                raise ClientLimit
            if self._draining.is_set() or not self.alive and self.started:
                raise ShuttingDown
            if self._closing.is_set() or len(self._waiting) >= self.max_waiting + self._free_slots():
                raise QueueFull
            if self.prompt_budget is not None:
                self.prompt_budget.charge(client, len(prompt_ids))  # last: a request refused above costs nothing
            loop = asyncio.get_running_loop()
            jobs = [Job(prompt_ids, replace(params, seed=choice_seed(params.seed, i)),
                        num_draft_tokens, loop, client, prediction) for i in range(n)]
            jobs[0].followers = jobs[1:]
            self._per_client[client] += n
            self._waiting.append(jobs[0])
            self.metrics.waiting.set(len(self._waiting))
            self._cond.notify_all()
        return jobs[0]

    def _free_slots(self) -> int:
        """Requests that could start at once (the engine has room for them)."""
        return max(0, self.engine.max_running - len(self._running))

    # --- the worker -----------------------------------------------------------------------------------------

    def _work(self) -> None:
        try:
            self._loop()
        except BaseException:  # noqa: BLE001 - a bug outside any one request: fail everyone, then say so
            log.exception("the engine loop died; the server stops (a supervisor should restart it)")
            self.failed = True
        finally:
            self._shut_down()
        if self.failed and self._on_fatal is not None:
            self._on_fatal()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._closing.is_set() and not self._waiting and not self._running:
                    self._cond.wait()
                if self._closing.is_set():
                    break
                admitted = self._admit()
            for job in admitted:
                self.metrics.queue_time.observe(time.perf_counter() - job.arrived)
            self._drop_cancelled()
            if self._running:
                self._step()

    def _admit(self) -> list[Job]:
        """Move waiting jobs into the batch, fairest first, while the engine has room (lock held)."""
        admitted = []
        while self._waiting:
            self._waiting = [j for j in self._waiting if not self._forget_if_cancelled(j)]
            if not self._waiting:
                break
            running = Counter(j.client for j in self._running)
            job = min(self._waiting, key=lambda j: (running[j.client], j.arrived))
            if not self.engine.can_admit(len(job.prompt_ids), job.params, len(job.members)):
                break  # the fairest waits for room; nobody overtakes it, so it cannot starve
            self._waiting.remove(job)
            for member in job.members:  # the first choice prefills; the others copy its prompt
                if self._start(member, job.seq if member is not job else None):
                    admitted.append(member)
        self.metrics.waiting.set(len(self._waiting))
        return admitted

    def _start(self, job: Job, leader) -> bool:
        try:
            job.seq = self.engine.add(job.prompt_ids, job.params, job.num_draft_tokens, job.prediction, leader)
            job.text = TextStream(self.decoder.tokenizer, job.params.stop)
        except SpecdecodeError as e:
            self._end(job, Failure(400, str(e)), "error")
            return False
        except Exception:  # noqa: BLE001 - this request's admission failed (a cache, a drafter): it alone
            log.exception("admitting a request failed")
            if job.seq is not None:
                self.engine.remove(job.seq)
            self._end(job, Failure(500, INTERNAL), "error")
            return False
        self._running.append(job)
        return True

    def _forget_if_cancelled(self, job: Job) -> bool:
        if not any(member.cancelled for member in job.members):
            return False
        for member in job.members:
            self._per_client[member.client] -= 1
            self.metrics.record_finished(None, "abort", None, time.perf_counter() - member.arrived)
        return True

    def _drop_cancelled(self) -> None:
        for job in [j for j in self._running if j.cancelled]:
            self.engine.remove(job.seq)
            self._end(job, None, "abort")
        if self.request_timeout_s is None:
            return
        deadline = time.perf_counter() - self.request_timeout_s
        with self._cond:
            late = [j for j in self._waiting if j.arrived < deadline]
            self._waiting = [j for j in self._waiting if j.arrived >= deadline]
        for job in [m for j in late for m in j.members] + [j for j in self._running if j.arrived < deadline]:
            if job.seq is not None:
                self.engine.remove(job.seq)
            self._end(job, Failure(504, f"the request did not finish within {self.request_timeout_s:g} s (the "
                                        "server's --request-timeout)"), "timeout")

    def _step(self) -> None:
        try:
            results = self.engine.step()
        except Exception:  # a bug in the forward fails the requests in it, never the worker serving everyone
            log.exception("engine step failed")
            for job in list(self._running):
                self.engine.remove(job.seq)
                self._end(job, Failure(500, INTERNAL), "error")
            return
        self.metrics.record_step(self.engine.last_step, len(self._running), self.engine.kv_reserved)
        jobs = {id(j.seq): j for j in self._running}
        for seq, outcome in results:
            job = jobs.get(id(seq))
            if job is None:  # a request the server did not add (the decoder used beside it): not its to run
                self.engine.remove(seq)
                continue
            if isinstance(outcome, Exception):
                if isinstance(outcome, SpecdecodeError):
                    failure = Failure(400, str(outcome))
                else:
                    log.error("request failed", exc_info=outcome)
                    failure = Failure(500, INTERNAL)
                self._end(job, failure, "error")
                continue
            try:
                self._deliver(job, seq, outcome)
            except Exception:  # noqa: BLE001 - its text failed (a tokenizer's decode): this request alone
                log.exception("turning a step into text failed")
                self.engine.remove(seq)
                self._end(job, Failure(500, INTERNAL), "error")

    def _deliver(self, job: Job, seq, step) -> None:
        """A step's tokens -> the text they release, to the job's client; a stop string ends the request here."""
        chunk = release_text(self.engine, seq, job.text, step)
        prompt_logprobs = seq.prompt_logprobs if job.first_token_at is None else None
        job.first_token_at = job.first_token_at or time.perf_counter()
        event = Chunk(chunk.pieces, chunk.token_ids, chunk.from_draft, chunk.finish_reason, seq.stats.to_dict(),
                      chunk.drafted_by, chunk.logprobs, prompt_logprobs)
        if chunk.finish_reason is None:
            job.emit(event)
        else:
            self.engine.remove(seq)
            self._end(job, event, chunk.finish_reason)

    def _end(self, job: Job, last: Chunk | Failure | None, reason: str) -> None:
        """The job leaves: metrics first, so a client that scrapes /metrics after its answer sees its request."""
        if job in self._running:
            self._running.remove(job)
        with self._cond:
            self._per_client[job.client] -= 1
        stats = job.seq.stats if job.seq is not None else None
        ttft = job.first_token_at - job.arrived if job.first_token_at else None
        self.metrics.record_finished(stats, reason, ttft, time.perf_counter() - job.arrived)
        self.metrics.running.set(len(self._running))
        if last is not None:
            job.emit(last)
        with self._cond:
            self._cond.notify_all()  # a drain may be waiting for the last one

    def _shut_down(self) -> None:
        with self._cond:
            waiting, self._waiting = self._waiting, []
            self._closing.set()  # nothing more is queued behind a loop that has ended
        message = INTERNAL if self.failed else "the server is shutting down"
        for job in [m for j in waiting for m in j.members] + list(self._running):
            if job.seq is not None:
                self.engine.remove(job.seq)
            if job in self._running:
                self._running.remove(job)
            job.emit(Failure(500 if self.failed else 503, message))
