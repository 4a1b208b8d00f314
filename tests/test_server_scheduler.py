"""The server's scheduler and HTTP plumbing on a scripted batch engine (no model): per-request draft length, the
bound on running requests, fairness between clients, queue and per-client limits (503, 429), cancellation while
waiting and while running, a crashing request that costs only itself, and SSE keep-alive comments."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
from server_thread import BackgroundServer

from specdecode.config import SamplingParams
from specdecode.engine.engine import StepInfo
from specdecode.engine.sequence import Step
from specdecode.engine.stats import GenerationStats
from specdecode.errors import SpecdecodeError
from specdecode.server.app import create_app
from specdecode.server.compute import ComputeThread
from specdecode.server.metrics import Metrics
from specdecode.server.scheduler import Chunk, ClientLimit, Failure, QueueFull, Scheduler, ShuttingDown
from specdecode.server.settings import ServerSettings

PARAMS = SamplingParams(max_new_tokens=3)


class Tokenizer:
    def __len__(self) -> int:
        return 100

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if 123_456 in ids:
            raise ValueError("planted decode crash")
        return "".join(f"t{i}" for i in ids)


class ScriptedSeq:
    def __init__(self, prompt: list[int], k: int | None, steps: int) -> None:
        self.prompt, self.k, self.steps_left = prompt, k, steps
        self.stats = GenerationStats(prompt_tokens=len(prompt))
        self.prompt_logprobs = None


class ScriptedEngine:
    """The Engine's surface as the scheduler uses it; every step takes a permit, so tests control timing."""

    num_draft_tokens, max_len, target = 4, 64, None

    def __init__(self, steps: int, max_running: int) -> None:
        self.steps, self.max_running = steps, max_running
        self.kv_budget_tokens, self.kv_reserved = 1000, 0
        self.running: list[ScriptedSeq] = []
        self.started: list[tuple[list[int], int | None]] = []  # (prompt, draft length) per request admitted
        self.batches: list[list[int]] = []  # the first prompt id of each request in each step
        self.permits = threading.Semaphore(0)
        self.last_step = StepInfo()
        self.threads: set[str] = set()  # the threads its steps ran on
        self.steps_for: dict[int, int] = {}  # first prompt id -> steps of such a request (else `steps`)
        self.step_s = 0.0  # what a step takes (a long request's events must not flood its reader)

    def set_limits(self, max_running: int, kv_budget_tokens: int | None = None) -> None:
        pass  # the test's own max_running stands

    def check(self, prompt, params, k=None, prediction=None, n=1) -> None:
        if len(prompt) > 20:
            raise SpecdecodeError(f"the request needs {len(prompt) + 10} KV cache slots but the server's KV budget "
                                  "is 30")

    def can_admit(self, prompt_len: int, params, count: int = 1) -> bool:
        if prompt_len == 7:
            raise RuntimeError("planted bug outside any request (the scheduler's own code)")
        return len(self.running) < self.max_running

    def add(self, prompt, params, k=None, prediction=None, leader=None) -> ScriptedSeq:
        if prompt == [98]:
            raise RuntimeError("planted admission crash (a cache that cannot be allocated)")
        seq = ScriptedSeq(prompt, k, self.steps_for.get(prompt[0], self.steps))
        self.running.append(seq)
        self.started.append((prompt, k))
        return seq

    def remove(self, seq) -> None:
        if seq in self.running:
            self.running.remove(seq)

    def stop(self, seq, dropped: int) -> None:
        self.remove(seq)

    def step(self):
        assert self.permits.acquire(timeout=10)
        time.sleep(self.step_s)
        self.threads.add(threading.current_thread().name)
        self.batches.append([s.prompt[0] for s in self.running])
        out = []
        for seq in list(self.running):
            if seq.prompt == [99]:
                self.remove(seq)
                out.append((seq, RuntimeError("planted crash")))
                continue
            seq.steps_left -= 1
            seq.stats.record_step(2, 1, 1, 0.01)
            done = seq.steps_left == 0
            out.append((seq, Step([seq.steps_left], 2, 1, "length" if done else None)))
            if done:
                self.remove(seq)
        self.last_step = StepInfo(len(out), len(out), 0, [2] * len(out))
        return out


class ScriptedDecoder:
    method = "ngram"

    def __init__(self, steps: int = 3, max_running: int = 16) -> None:
        self.tokenizer = Tokenizer()
        self.engine = self.batch = ScriptedEngine(steps, max_running)

    def allow(self, steps: int = 10_000) -> None:
        self.batch.permits.release(steps)

    def encode(self, prompt, chat: bool = False) -> list[int]:
        return [ord(c) % 100 for c in str(prompt)]


async def drain(job) -> list:
    events = []
    while not events or isinstance(events[-1], Chunk) and events[-1].finish_reason is None:
        events.append(await asyncio.wait_for(job.events.get(), 10))
    return events


def with_scheduler(decoder: ScriptedDecoder, body, max_waiting: int = 8, max_per_client: int = 32,
                   compute: ComputeThread | None = None) -> None:
    scheduler = Scheduler(decoder, Metrics("m", "ngram"), max_waiting, max_per_client=max_per_client,
                          compute=compute)
    scheduler.start()
    try:
        asyncio.run(body(scheduler))
    finally:
        decoder.allow()
        scheduler.stop()


def test_requests_share_steps_with_their_own_draft_length():
    decoder = ScriptedDecoder()

    async def body(scheduler):
        jobs = [scheduler.submit([i], PARAMS, k) for i, k in ((1, 2), (2, None), (3, 0))]
        decoder.allow()
        for job in jobs:
            events = await drain(job)
            assert [e.token_ids for e in events] == [[2], [1], [0]]
            assert events[-1].stats["new_tokens"] == 3

    with_scheduler(decoder, body)
    assert decoder.batch.started == [([1], 2), ([2], None), ([3], 0)]  # None: the engine's default
    assert decoder.batch.batches[0] == [1, 2, 3]  # one step served all three


def test_the_engine_steps_on_the_thread_that_loaded_the_models():
    """OpenMP is fast from one thread only (compute.py): the server loads on a ComputeThread and steps there."""
    compute = ComputeThread("loader")
    decoder = compute.run(ScriptedDecoder)  # "loads" on it

    async def body(scheduler):
        job = scheduler.submit([1], PARAMS)
        decoder.allow()
        await drain(job)

    with_scheduler(decoder, body, compute=compute)
    assert decoder.engine.threads == {"loader"}
    assert compute.run(threading.current_thread) is not threading.current_thread()  # still serving jobs after


def test_a_compute_thread_runs_jobs_in_order_and_hands_back_errors():
    compute = ComputeThread()
    seen = []
    futures = [compute.submit(seen.append, i) for i in range(5)]
    assert [f.result(timeout=10) for f in futures] == [None] * 5 and seen == list(range(5))
    with pytest.raises(ZeroDivisionError):
        compute.run(lambda: 1 / 0)
    assert compute.run(lambda: threading.current_thread().name) == "specdecode-compute"  # the error ended no thread


def test_a_client_with_many_requests_does_not_starve_another():
    decoder = ScriptedDecoder(steps=2, max_running=2)

    async def body(scheduler):
        greedy = [scheduler.submit([10 + i], PARAMS, client="a") for i in range(6)]
        polite = scheduler.submit([50], PARAMS, client="b")
        decoder.allow()
        for job in greedy + [polite]:
            await drain(job)

    with_scheduler(decoder, body)
    order = [prompt[0] for prompt, _ in decoder.batch.started]
    assert order.index(50) <= 2  # b's request starts as soon as a place frees, not after a's six
    assert all(len(batch) <= 2 for batch in decoder.batch.batches)  # the bound on running requests holds


def test_queue_and_per_client_limits_refuse_and_then_recover():
    decoder = ScriptedDecoder(max_running=1)

    async def body(scheduler):
        running, waiting = scheduler.submit([1], PARAMS), scheduler.submit([2], PARAMS)
        with pytest.raises(QueueFull):
            scheduler.submit([3], PARAMS)
        decoder.allow()
        await drain(running)
        await drain(waiting)
        await drain(scheduler.submit([4], PARAMS))  # room again

    with_scheduler(decoder, body, max_waiting=1)

    async def per_client(scheduler):
        first, second = scheduler.submit([1], PARAMS, client="x"), scheduler.submit([2], PARAMS, client="x")
        with pytest.raises(ClientLimit):
            scheduler.submit([3], PARAMS, client="x")
        other = scheduler.submit([4], PARAMS, client="y")  # another client is not limited by x
        decoder.allow()
        for job in (first, second, other):
            await drain(job)
        await drain(scheduler.submit([5], PARAMS, client="x"))

    decoder = ScriptedDecoder(max_running=1)
    with_scheduler(decoder, per_client, max_per_client=2)


def test_cancelled_requests_are_dropped_or_stopped():
    decoder = ScriptedDecoder(steps=50, max_running=1)

    async def body(scheduler):
        running, queued, after = (scheduler.submit([i], PARAMS) for i in (1, 2, 3))
        queued.cancel()  # still waiting: never starts
        decoder.allow(1)
        assert isinstance(await asyncio.wait_for(running.events.get(), 10), Chunk)
        running.cancel()  # started: leaves the batch before the next step
        decoder.allow()
        events = await drain(after)
        assert events[-1].finish_reason == "length"

    with_scheduler(decoder, body)
    assert [prompt for prompt, _ in decoder.batch.started] == [[1], [3]]
    assert sum(1 in batch for batch in decoder.batch.batches) <= 2


def test_a_crashing_request_fails_alone():
    decoder = ScriptedDecoder()
    decoder.allow()

    async def body(scheduler):
        crash, fine = scheduler.submit([99], PARAMS), scheduler.submit([5], PARAMS)
        failure = await asyncio.wait_for(crash.events.get(), 10)
        assert isinstance(failure, Failure) and failure.status == 500
        assert (await drain(fine))[-1].finish_reason == "length"

    with_scheduler(decoder, body)


def test_admission_and_text_errors_fail_their_request_alone():
    decoder = ScriptedDecoder(steps=3)
    decoder.allow()

    async def body(scheduler):
        bad_add, fine = scheduler.submit([98], PARAMS), scheduler.submit([5], PARAMS)
        failure = await asyncio.wait_for(bad_add.events.get(), 10)
        assert isinstance(failure, Failure) and failure.status == 500
        assert (await drain(fine))[-1].finish_reason == "length"
        decoder.batch.steps = 123_457  # its tokens count down from 123,456, which the tokenizer cannot decode
        events = await drain(scheduler.submit([4], PARAMS))
        assert isinstance(events[-1], Failure) and events[-1].status == 500
        decoder.batch.steps = 3
        assert (await drain(scheduler.submit([6], PARAMS)))[-1].finish_reason == "length"  # the worker lives on
        assert scheduler.alive

    with_scheduler(decoder, body)


def test_a_dead_engine_loop_fails_every_request_and_says_so():
    """A bug outside any one request ends the loop: every request gets an error it can see, new ones 503, /ready
    and /health turn 503, and on_fatal runs (`specdecode serve` then exits non-zero for its supervisor)."""
    decoder = ScriptedDecoder(steps=50)
    fatal = threading.Event()
    scheduler = Scheduler(decoder, Metrics("m", "ngram"), 8, on_fatal=fatal.set)
    scheduler.start()

    async def body():
        running = scheduler.submit([1], PARAMS)
        decoder.allow(1)
        assert isinstance(await asyncio.wait_for(running.events.get(), 10), Chunk)
        doomed = scheduler.submit([1] * 7, PARAMS)  # its admission runs the planted bug
        decoder.allow()
        for job in (running, doomed):
            events = await drain(job)
            assert isinstance(events[-1], Failure) and events[-1].status == 500
        assert fatal.wait(10) and scheduler.failed and not scheduler.alive and not scheduler.ready
        with pytest.raises(ShuttingDown):
            scheduler.submit([2], PARAMS)

    try:
        asyncio.run(body())
    finally:
        scheduler.stop()


def test_drain_finishes_what_runs_refuses_what_comes_and_ends_the_rest_visibly():
    decoder = ScriptedDecoder(steps=10**9, max_running=2)
    decoder.batch.steps_for[1] = 3  # request [1] ends in 3 steps; [2] would not end in a day
    decoder.batch.step_s = 0.01
    drained = threading.Event()

    async def body(scheduler):
        finishing, long = scheduler.submit([1], PARAMS), scheduler.submit([2], PARAMS)
        threading.Thread(target=lambda: (scheduler.drain(1.0), drained.set()), daemon=True).start()
        await asyncio.sleep(0.1)
        assert not scheduler.ready and scheduler.alive
        with pytest.raises(ShuttingDown):
            scheduler.submit([3], PARAMS)
        decoder.allow()
        assert (await drain(finishing))[-1].finish_reason == "length"
        events = await drain(long)  # still running when the drain's time ran out
        assert isinstance(events[-1], Failure) and events[-1].status == 503 and "shutting down" in events[-1].message

    with_scheduler(decoder, body)
    assert drained.wait(10)


def test_a_non_streaming_client_that_leaves_frees_its_slot_while_tokens_flow():
    decoder = ScriptedDecoder(steps=10**9, max_running=1)
    decoder.batch.step_s = 0.01
    app = create_app(decoder, ServerSettings(model_name="m", max_per_client=1))
    body = {"model": "m", "prompt": "hi", "max_tokens": 50}
    with BackgroundServer(app) as url:
        decoder.allow()  # tokens flow all the time: the client's absence must be noticed between them
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/v1/completions", json=body, timeout=0.5)
        deadline = time.monotonic() + 10
        while decoder.batch.running and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not decoder.batch.running  # cancelled: the engine dropped it
        decoder.batch.steps = 3
        assert httpx.post(url + "/v1/completions", json=body, timeout=10).status_code == 200  # its slot is free


def test_http_limits_keepalive_and_unknown_routes():
    decoder = ScriptedDecoder(max_running=1)
    app = create_app(decoder, ServerSettings(model_name="m", max_waiting=0, max_running=1, max_per_client=1,
                                             keepalive_s=0.05))
    body = {"model": "m", "prompt": "hi", "stream": True}
    with BackgroundServer(app) as url, httpx.Client(base_url=url, timeout=10) as client:
        with client.stream("POST", "/v1/completions", json=body) as first:
            assert first.status_code == 200
            limited = client.post("/v1/completions", json=body)  # the same client (address) again
            assert limited.status_code == 429 and limited.headers["retry-after"] == "1"
            assert "too many requests" in limited.json()["error"]["message"]
            lines = first.iter_lines()
            assert next(lines) == ": keep-alive"  # no step has run yet: the stream is kept open
            decoder.allow()
            rest = [line for line in lines if line and line != ": keep-alive"]
        assert rest[-1] == "data: [DONE]"
        too_big = client.post("/v1/completions", json=body | {"prompt": "x" * 40})
        assert too_big.status_code == 400 and "KV budget is 30" in too_big.json()["error"]["message"]
        missing = client.get("/v2/nothing")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def run_in_thread(server) -> tuple[threading.Thread, str]:
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    return thread, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}"


def test_sigterm_drains_streams_to_a_visible_end_then_stops():
    """SIGTERM (handle_exit, as uvicorn calls it): new requests get 503, a stream still running when the drain
    time runs out ends with an error event and [DONE], and the server stops."""
    from specdecode.server.run import build_server

    decoder = ScriptedDecoder(steps=10**9)
    decoder.batch.step_s = 0.01
    server = build_server(create_app(decoder, ServerSettings(model_name="m")), "127.0.0.1", 0, "warning",
                          drain_timeout=0.5)
    thread, url = run_in_thread(server)
    decoder.allow()
    body = {"model": "m", "prompt": "hi", "max_tokens": 50, "stream": True}
    with httpx.Client(base_url=url, timeout=10) as client, client.stream("POST", "/v1/completions", json=body) as r:
        lines = (line for line in r.iter_lines() if line.startswith("data: "))
        assert "choices" in next(lines)
        server.handle_exit(2, None)
        time.sleep(0.1)
        assert client.get("/ready").status_code == 503 and client.get("/health").status_code == 200
        refused = client.post("/v1/completions", json=body | {"stream": False})
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "server_shutting_down"
        rest = list(lines)
    assert rest[-1] == "data: [DONE]" and "shutting down" in rest[-2]
    thread.join(30)
    assert not thread.is_alive()


def test_a_dead_engine_stops_the_server_with_a_non_zero_status():
    from specdecode.server.run import EXIT_ENGINE_DIED, build_server

    decoder = ScriptedDecoder()
    decoder.allow()
    app = create_app(decoder, ServerSettings(model_name="m"))
    server = build_server(app, "127.0.0.1", 0, "warning")
    thread, url = run_in_thread(server)
    reply = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "1234567", "max_tokens": 5},
                       timeout=10)  # 7 prompt tokens: admission runs the planted bug
    assert reply.status_code == 500
    thread.join(30)
    assert not thread.is_alive() and app.state.scheduler.failed
    assert EXIT_ENGINE_DIED != 0


def test_choice_seeds_stay_within_a_generators_64_bits():
    from specdecode.config import choice_seed

    assert [choice_seed(7, i) for i in range(3)] == [7, 8, 9]
    assert choice_seed(2**64 - 1, 1) == 0 and choice_seed(None, 2) is None
