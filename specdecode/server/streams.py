"""A queued Job's events -> an HTTP answer: server-sent events, or one JSON body once generation ends.

Either way the job is cancelled when the answer is abandoned: a streaming response cancels it when it ends for
any reason (done, client gone, server stopping), and a non-streaming request asks after its client every
DISCONNECT_POLL_S while it waits.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from specdecode.server.errors import ApiError, error_body
from specdecode.server.formats import DONE, Meta, chunk, live_stats, sse, usage_chunk
from specdecode.server.scheduler import Chunk, Failure, Job

KEEPALIVE_S = 10.0  # default seconds between SSE keep-alive comments
KEEPALIVE = ": keep-alive\n\n"
DISCONNECT_POLL_S = 0.25  # how often a waiting non-streaming request checks that its client is still there

UsageFn = Callable[[dict[str, Any]], dict[str, Any]]  # GenerationStats.to_dict() -> OpenAI usage


@dataclass
class Finished:
    text: str
    finish_reason: str
    stats: dict[str, Any]


class JobStream(StreamingResponse):
    """Server-sent events of one job; the job is cancelled whenever the response ends, however it ends."""

    def __init__(self, job: Job, meta: Meta, make_usage: UsageFn, include_usage: bool,
                 keepalive_s: float = KEEPALIVE_S) -> None:
        # no-cache and no proxy buffering, so every chunk reaches the client at once
        super().__init__(sse_events(job, meta, make_usage, include_usage, keepalive_s),
                         media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()  # a no-op after the last chunk; stops generation if the client went away


async def sse_events(job: Job, meta: Meta, make_usage: UsageFn, include_usage: bool,
                     keepalive_s: float = KEEPALIVE_S) -> AsyncIterator[str]:
    """OpenAI's chunk stream, ending with `data: [DONE]`; a failure mid-stream is sent as an error event. While
    the request waits for the batch (or a step), an SSE comment every `keepalive_s` keeps proxies from closing
    the connection; clients ignore comments."""
    if meta.chat:  # OpenAI opens a chat stream with the role at once, before the first token
        yield sse(chunk(meta, "", role=True))
    async with aclosing(job_events(job, keepalive_s)) as events:
        async for event in events:
            if event is None:
                yield KEEPALIVE
                continue
            if isinstance(event, Failure):
                yield sse(error_body(event.status, event.message))
                break
            text = "".join(event.pieces)
            if text or event.finish_reason is not None:
                extension = {"pieces": event.pieces, "from_draft": event.from_draft,
                             "drafted_by": event.drafted_by, "stats": live_stats(event.stats)}
                yield sse(chunk(meta, text, event.finish_reason, extension=extension))
            if event.finish_reason is not None:
                if include_usage:
                    yield sse(usage_chunk(meta, make_usage(event.stats)))
                break
    yield DONE


async def collect(job: Job, request: Request) -> Finished | None:
    """Wait for the whole generation -> Finished, or None when the client disconnected first. Whether the client
    is still there is asked every DISCONNECT_POLL_S, tokens flowing or not: a client that left mid-answer frees its
    slot and its cache within a step or so."""
    pieces: list[str] = []
    asked = asyncio.get_running_loop().time()
    try:
        async with aclosing(job_events(job, DISCONNECT_POLL_S)) as events:
            async for event in events:
                now = asyncio.get_running_loop().time()
                if event is None or now - asked >= DISCONNECT_POLL_S:
                    asked = now
                    if await request.is_disconnected():
                        return None
                if event is None:
                    continue
                if isinstance(event, Failure):
                    raise ApiError(event.status, event.message)
                pieces += event.pieces
                if event.finish_reason is not None:
                    return Finished("".join(pieces), event.finish_reason, event.stats)
    finally:
        job.cancel()
    return None


async def job_events(job: Job, timeout: float) -> AsyncIterator[Chunk | Failure | None]:
    """The job's events as they come, and None each time `timeout` seconds pass without one."""
    getter: asyncio.Future | None = None
    try:
        while True:
            # One pending get() is kept across timeouts, so an event is never lost to one.
            getter = getter or asyncio.ensure_future(job.events.get())
            done, _ = await asyncio.wait({getter}, timeout=timeout)
            if not done:
                yield None
                continue
            event, getter = getter.result(), None
            yield event
    finally:
        if getter is not None:
            getter.cancel()
