"""The server's scheduler and HTTP plumbing on a scripted decoder (no model): FIFO order, per-request draft length,
queue limit (503), cancellation while queued and while running, and a crashing request that costs only itself."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import httpx
import pytest

from specdecode.api import TextChunk
from specdecode.config import SamplingParams
from specdecode.server.app import create_app
from specdecode.server.background import BackgroundServer
from specdecode.server.metrics import Metrics
from specdecode.server.scheduler import Chunk, Failure, QueueFull, Scheduler
from specdecode.server.settings import ServerSettings
from specdecode.stats import GenerationStats

PARAMS = SamplingParams(max_new_tokens=3)


class ScriptedDecoder:
    """SpecDecoder's surface as the server uses it; every step takes a permit, so tests control timing."""

    method = "ngram"

    def __init__(self, steps: int = 3) -> None:
        self.engine = SimpleNamespace(num_draft_tokens=4, max_len=64)
        self.tokenizer = [None] * 100  # len() is the vocabulary size
        self.stats = GenerationStats()
        self.steps = steps
        self.permits = threading.Semaphore(0)
        self.served: list[tuple[list[int], int]] = []  # (prompt ids, draft length) per request started
        self.steps_run: list[int] = []  # per request started

    def allow(self, steps: int = 10_000) -> None:
        self.permits.release(steps)

    def encode(self, prompt, chat: bool = False) -> list[int]:
        return [ord(c) % 100 for c in str(prompt)]

    def stream(self, ids: list[int], params: SamplingParams, num_draft_tokens: int | None = None):
        self.served.append((ids, self.engine.num_draft_tokens if num_draft_tokens is None else num_draft_tokens))
        self.steps_run.append(0)
        self.stats = GenerationStats(prompt_tokens=len(ids))
        if ids == [99]:
            raise RuntimeError("planted crash")
        for i in range(self.steps):
            assert self.permits.acquire(timeout=10)
            self.steps_run[-1] += 1
            self.stats.record_step(2, 1, 2, 0.01)
            yield TextChunk([f"t{i}", ""], [i, i], [True, False], "length" if i == self.steps - 1 else None)


async def drain(job) -> list:
    events = []
    while not events or isinstance(events[-1], Chunk) and events[-1].finish_reason is None:
        events.append(await asyncio.wait_for(job.events.get(), 10))
    return events


def with_scheduler(decoder: ScriptedDecoder, max_waiting: int, body) -> None:
    metrics = Metrics("m", "ngram")
    scheduler = Scheduler(decoder, metrics, max_waiting)
    scheduler.start()
    try:
        asyncio.run(body(scheduler))
    finally:
        decoder.allow()
        scheduler.stop()


def test_requests_run_first_come_first_served_with_their_own_draft_length():
    decoder = ScriptedDecoder()

    async def body(scheduler):
        jobs = [scheduler.submit([i], PARAMS, k) for i, k in ((1, 2), (2, None), (3, 0))]
        decoder.allow()
        for job in jobs:
            events = await drain(job)
            assert [e.pieces for e in events] == [["t0", ""], ["t1", ""], ["t2", ""]]
            assert events[-1].stats["new_tokens"] == 6

    with_scheduler(decoder, 8, body)
    assert decoder.served == [([1], 2), ([2], 4), ([3], 0)]  # None -> the server's default (4)


def test_queue_limit_refuses_and_then_recovers():
    decoder = ScriptedDecoder()

    async def body(scheduler):
        running, waiting = scheduler.submit([1], PARAMS), scheduler.submit([2], PARAMS)
        with pytest.raises(QueueFull):
            scheduler.submit([3], PARAMS)
        decoder.allow()
        await drain(running)
        await drain(waiting)
        await drain(scheduler.submit([4], PARAMS))  # room again

    with_scheduler(decoder, 1, body)


def test_cancelled_requests_are_skipped_or_stopped():
    decoder = ScriptedDecoder(steps=50)

    async def body(scheduler):
        running, queued, after = (scheduler.submit([i], PARAMS) for i in (1, 2, 3))
        queued.cancel()  # still waiting: never starts
        decoder.allow(1)
        assert isinstance(await asyncio.wait_for(running.events.get(), 10), Chunk)
        running.cancel()  # started: stops after its current step
        decoder.allow()
        events = await drain(after)
        assert events[-1].finish_reason == "length"

    with_scheduler(decoder, 8, body)
    assert [ids for ids, _ in decoder.served] == [[1], [3]]
    assert decoder.steps_run[0] <= 2 and decoder.steps_run[1] == 50


def test_a_crashing_request_fails_alone():
    decoder = ScriptedDecoder()
    decoder.allow()

    async def body(scheduler):
        crash = await asyncio.wait_for(scheduler.submit([99], PARAMS).events.get(), 10)
        assert isinstance(crash, Failure) and crash.status == 500
        assert (await drain(scheduler.submit([5], PARAMS)))[-1].finish_reason == "length"

    with_scheduler(decoder, 8, body)


def test_http_503_when_the_queue_is_full_and_404_for_unknown_routes():
    decoder = ScriptedDecoder()
    app = create_app(decoder, ServerSettings(model_name="m", max_waiting=0))
    body = {"model": "m", "prompt": "hi", "stream": True}
    with BackgroundServer(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        with client.stream("POST", "/v1/completions", json=body) as first:
            assert first.status_code == 200
            busy = client.post("/v1/completions", json=body)
            assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
            assert "busy" in busy.json()["error"]["message"]
            decoder.allow()
            lines = [line for line in first.iter_lines() if line]
        assert lines[-1] == "data: [DONE]"
        missing = client.get("/v2/nothing")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
