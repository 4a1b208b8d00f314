"""A queued Job's events -> an HTTP answer: server-sent events, or one JSON body once generation ends.

Either way the job is cancelled when the answer is abandoned: a streaming response cancels it when it ends for
any reason (done, client gone, server stopping), and a waiting non-streaming request polls for its client.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from specdecode.server.errors import ApiError, error_body
from specdecode.server.formats import DONE, Meta, chunk, live_stats, sse, usage_chunk
from specdecode.server.scheduler import Chunk, Failure, Job

DISCONNECT_POLL_S = 0.25  # how often a waiting non-streaming request checks that its client is still there

UsageFn = Callable[[dict[str, Any]], dict[str, Any]]  # GenerationStats.to_dict() -> OpenAI usage


@dataclass
class Finished:
    text: str
    finish_reason: str
    stats: dict[str, Any]


class JobStream(StreamingResponse):
    """Server-sent events of one job; the job is cancelled whenever the response ends, however it ends."""

    def __init__(self, job: Job, meta: Meta, make_usage: UsageFn, include_usage: bool) -> None:
        # no-cache and no proxy buffering, so every chunk reaches the client at once
        super().__init__(sse_events(job, meta, make_usage, include_usage), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel()  # a no-op after the last chunk; stops generation if the client went away


async def sse_events(job: Job, meta: Meta, make_usage: UsageFn, include_usage: bool) -> AsyncIterator[str]:
    """OpenAI's chunk stream, ending with `data: [DONE]`; a failure mid-stream is sent as an error event."""
    if meta.chat:  # OpenAI opens a chat stream with the role at once, before the first token
        yield sse(chunk(meta, "", role=True))
    while True:
        event = await job.events.get()
        if isinstance(event, Failure):
            yield sse(error_body(event.status, event.message))
            break
        text = "".join(event.pieces)
        if text or event.finish_reason is not None:
            extension = {"pieces": event.pieces, "from_draft": event.from_draft, "stats": live_stats(event.stats)}
            yield sse(chunk(meta, text, event.finish_reason, extension=extension))
        if event.finish_reason is not None:
            if include_usage:
                yield sse(usage_chunk(meta, make_usage(event.stats)))
            break
    yield DONE


async def collect(job: Job, request: Request) -> Finished | None:
    """Wait for the whole generation -> Finished, or None when the client disconnected first."""
    pieces: list[str] = []
    getter: asyncio.Future | None = None
    try:
        while True:
            # One pending get() is kept across polls, so an event is never lost to a timeout.
            getter = getter or asyncio.ensure_future(job.events.get())
            done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
            if not done:
                if await request.is_disconnected():
                    return None
                continue
            event: Chunk | Failure = getter.result()
            getter = None
            if isinstance(event, Failure):
                raise ApiError(event.status, event.message)
            pieces += event.pieces
            if event.finish_reason is not None:
                return Finished("".join(pieces), event.finish_reason, event.stats)
    finally:
        if getter is not None:
            getter.cancel()
        job.cancel()
