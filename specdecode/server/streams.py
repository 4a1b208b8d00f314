"""A queued Job's events -> an HTTP answer: server-sent events, or one JSON body once generation ends.

Either way the job is cancelled when the answer is abandoned: a streaming response cancels it when it ends for
any reason (done, client gone, server stopping), and a non-streaming request asks after its client every
DISCONNECT_POLL_S while it waits.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from specdecode.server.answers import Answer, Finished
from specdecode.server.errors import ApiError, error_body
from specdecode.server.formats import DONE, Meta, chunk, live_stats, sse, timings, usage_chunk
from specdecode.server.scheduler import Chunk, Failure, Job

KEEPALIVE_S = 10.0  # default seconds between SSE keep-alive comments
KEEPALIVE = ": keep-alive\n\n"
DISCONNECT_POLL_S = 0.25  # how often a waiting non-streaming request checks that its client is still there

UsageFn = Callable[[dict[str, Any]], dict[str, Any]]  # GenerationStats.to_dict() -> OpenAI usage


class JobStream(StreamingResponse):
    """Server-sent events of one request's jobs (one per choice); they are cancelled whenever the response ends,
    however it ends."""

    def __init__(self, jobs: list[Job], meta: Meta, answer: Answer, make_usage: UsageFn, include_usage: bool,
                 keepalive_s: float = KEEPALIVE_S) -> None:
        # no-cache and no proxy buffering, so every chunk reaches the client at once
        super().__init__(sse_events(jobs, meta, answer, make_usage, include_usage, keepalive_s),
                         media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.jobs = jobs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for job in self.jobs:
                job.cancel()  # a no-op after the last chunk; stops generation if the client went away


async def sse_events(jobs: list[Job], meta: Meta, answer: Answer, make_usage: UsageFn, include_usage: bool,
                     keepalive_s: float = KEEPALIVE_S) -> AsyncIterator[str]:
    """OpenAI's chunk stream, ending with `data: [DONE]`; a failure mid-stream is sent as an error event. While
    the request waits for the batch (or a step), an SSE comment every `keepalive_s` keeps proxies from closing
    the connection; clients ignore comments. With tools, a choice's text is held until it ends, then sent as text
    or as tool calls (a call is only known once its closing tag is out)."""
    if meta.chat:  # OpenAI opens a chat stream with the role at once, before the first token
        for index in range(len(jobs)):
            yield sse(chunk(meta, "", role=True, index=index))
    held = [""] * len(jobs)
    offsets = [0] * len(jobs)  # characters of each choice's text sent so far (completions' text_offset)
    echoed = [answer.echo is None] * len(jobs)
    finals: dict[int, dict] = {}
    async with aclosing(merged_events(jobs, keepalive_s)) as events:
        async for index, event in events:
            if event is None:
                yield KEEPALIVE
                continue
            if isinstance(event, Failure):
                yield sse(error_body(event.status, event.message))
                break
            text = "".join(event.pieces)
            done = event.finish_reason is not None
            if done:
                finals[index] = event.stats
            last = done and len(finals) == len(jobs)
            # llama-server's timings ride on the stream's final chunk: this one, or the usage chunk after it
            final = {"timings": timings([finals[i] for i in range(len(jobs))])} if last and not include_usage else {}
            if answer.tools is not None:
                held[index] += text
                if done:
                    yield sse(tool_chunk(meta, answer, index, held[index], event) | final)
            else:
                prompt = None
                if not echoed[index]:  # echo: the prompt opens each choice's first chunk, with its logprobs
                    text, echoed[index] = answer.echo + text, True
                    if event.prompt_logprobs is not None:
                        prompt = (answer.echo_ids, event.prompt_logprobs)
                logprobs = answer.logprobs(event.token_ids, event.logprobs, prompt, offsets[index])
                offsets[index] += len(text)
                if text or done or logprobs:
                    extension = {"pieces": event.pieces, "from_draft": event.from_draft,
                                 "drafted_by": event.drafted_by, "stats": live_stats(event.stats)}
                    yield sse(chunk(meta, text, event.finish_reason, extension=extension, index=index,
                                    logprobs=logprobs) | final)
            if last:
                if include_usage:
                    stats = [finals[i] for i in range(len(jobs))]
                    yield sse(usage_chunk(meta, make_usage(stats)) | {"timings": timings(stats)})
                break
    yield DONE


def tool_chunk(meta: Meta, answer: Answer, index: int, text: str, event: Chunk) -> dict:
    """A choice's whole answer in one chunk: its text, or its tool calls (each with its `index`)."""
    message, reason = answer.message(text, event.finish_reason)
    calls = [dict(call, index=i) for i, call in enumerate(message.get("tool_calls") or [])]
    return chunk(meta, message["content"] or "", reason, index=index, tool_calls=calls or None)


async def collect(jobs: list[Job], request: Request) -> list[Finished] | None:
    """Wait for every choice whole -> one Finished each, or None when the client disconnected first. Whether the
    client is still there is asked every DISCONNECT_POLL_S, tokens flowing or not: a client that left mid-answer
    frees its slots and caches within a step or so."""
    parts: list[dict] = [{"pieces": [], "ids": [], "logprobs": None, "prompt": None} for _ in jobs]
    finished: dict[int, Finished] = {}
    asked = asyncio.get_running_loop().time()
    try:
        async with aclosing(merged_events(jobs, DISCONNECT_POLL_S)) as events:
            async for index, event in events:
                now = asyncio.get_running_loop().time()
                if event is None or now - asked >= DISCONNECT_POLL_S:
                    asked = now
                    if await request.is_disconnected():
                        return None
                if event is None:
                    continue
                if isinstance(event, Failure):
                    raise ApiError(event.status, event.message)
                part = parts[index]
                part["pieces"] += event.pieces
                part["ids"] += event.token_ids
                if event.logprobs is not None:
                    part["logprobs"] = (part["logprobs"] or []) + event.logprobs
                if event.prompt_logprobs is not None:
                    part["prompt"] = event.prompt_logprobs
                if event.finish_reason is not None:
                    finished[index] = Finished("".join(part["pieces"]), event.finish_reason, event.stats,
                                               part["ids"], part["logprobs"], part["prompt"])
                    if len(finished) == len(jobs):
                        return [finished[i] for i in range(len(jobs))]
    finally:
        for job in jobs:
            job.cancel()
    return None


async def merged_events(jobs: list[Job], timeout: float) -> AsyncIterator[tuple[int, Chunk | Failure | None]]:
    """(choice index, event) of every job as they come, and (-1, None) each time `timeout` seconds pass without
    one. A job's events stop after its last."""
    streams = [job_events(job, timeout) for job in jobs]
    if len(streams) == 1:
        async for event in streams[0]:
            yield 0, event
        return
    pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                yield -1, None
                continue
            for future in done:
                index = pending.pop(future)
                try:
                    event = future.result()
                except StopAsyncIteration:
                    continue
                if event is None:  # that job's own quiet spell: wait on it again
                    pending[asyncio.ensure_future(streams[index].__anext__())] = index
                    continue
                yield index, event
                if not (isinstance(event, Failure) or event.finish_reason is not None):
                    pending[asyncio.ensure_future(streams[index].__anext__())] = index
    finally:
        for future in pending:
            future.cancel()
        await asyncio.gather(*pending, return_exceptions=True)  # a generator closes only once nobody awaits it
        for stream in streams:
            await stream.aclose()


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
