"""The engine serves one request at a time; this module shares it fairly between many HTTP clients.

One worker thread owns the decoder (its single KV cache) and takes requests from a FIFO queue, first come first
served, each to completion. It never waits on a client: every chunk goes into that request's unbounded asyncio
queue via `loop.call_soon_threadsafe`, so a slow reader only lets its own queue grow (bounded by max_tokens).
A request whose client went away is cancelled: skipped if still queued, or stopped after the current step.
Batching speculation across requests is a later step; until then throughput is one request's speed.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from specdecode.config import SamplingParams
from specdecode.errors import SpecdecodeError
from specdecode.server.metrics import Metrics

log = logging.getLogger("specdecode.server")


@dataclass
class Chunk:
    """Text of one engine step, as the worker hands it to the request's event loop."""

    pieces: list[str]
    token_ids: list[int]
    from_draft: list[bool]
    finish_reason: str | None
    stats: dict[str, Any]  # GenerationStats.to_dict() after this step (a copy: the worker goes on mutating)


@dataclass
class Failure:
    status: int
    message: str


class QueueFull(Exception):
    pass


@dataclass
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    num_draft_tokens: int | None
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)  # Chunk... then a final Chunk or a Failure
    arrived: float = field(default_factory=time.perf_counter)
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Safe from any thread, any number of times."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def emit(self, event: Chunk | Failure) -> None:
        """Worker thread -> the request's event loop; never blocks."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            self.cancel()


class Scheduler:
    def __init__(self, decoder, metrics: Metrics, max_waiting: int) -> None:
        self.decoder = decoder
        self.metrics = metrics
        self.max_waiting = max_waiting
        self.default_num_draft_tokens = decoder.engine.num_draft_tokens
        self._queue: queue.Queue[Job | None] = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0  # submitted and not finished, the running one included
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._work, name="specdecode-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what is queued, stop the running request after its current step, and join the worker."""
        self._closing.set()
        self._queue.put(None)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._closing.is_set()

    def submit(self, prompt_ids: list[int], params: SamplingParams, num_draft_tokens: int | None = None) -> Job:
        """Queue a request (call from the event loop). Raises QueueFull past max_waiting requests in line."""
        with self._lock:
            if self._closing.is_set() or self._pending > self.max_waiting:
                raise QueueFull
            self._pending += 1
        job = Job(prompt_ids, params, num_draft_tokens, asyncio.get_running_loop())
        self.metrics.waiting.inc()
        self._queue.put(job)
        return job

    def _work(self) -> None:
        while (job := self._queue.get()) is not None:
            self.metrics.waiting.dec()
            try:
                if self._closing.is_set():
                    job.emit(Failure(503, "the server is shutting down"))
                elif job.cancelled:
                    self.metrics.record_finished(None, "abort", None, time.perf_counter() - job.arrived)
                else:
                    self._serve(job)
            except Exception:  # a bug must cost one request, never the worker that serves everyone
                log.exception("request failed")
                job.emit(Failure(500, "internal server error (see the server log)"))
            finally:
                with self._lock:
                    self._pending -= 1

    def _serve(self, job: Job) -> None:
        started = time.perf_counter()
        self.metrics.queue_time.observe(started - job.arrived)
        self.metrics.running.set(1)
        reason, first_token_at, stats, last = "error", None, None, None
        chunks = self.decoder.stream(job.prompt_ids, job.params, num_draft_tokens=job.num_draft_tokens)
        try:
            for chunk in chunks:
                stats = self.decoder.stats
                first_token_at = first_token_at or time.perf_counter()
                event = Chunk(chunk.pieces, chunk.token_ids, chunk.from_draft, chunk.finish_reason, stats.to_dict())
                if chunk.finish_reason is not None:
                    reason, last = chunk.finish_reason, event
                    break
                job.emit(event)
                if job.cancelled or self._closing.is_set():
                    reason = "abort"
                    break
        except SpecdecodeError as e:
            job.emit(Failure(400, str(e)))
        finally:
            chunks.close()
            self.metrics.running.set(0)
            ttft = first_token_at - job.arrived if first_token_at else None
            self.metrics.record_finished(stats, reason, ttft, time.perf_counter() - job.arrived)
        if last is not None:  # after the metrics, so a client that scrapes /metrics next sees its request
            job.emit(last)
