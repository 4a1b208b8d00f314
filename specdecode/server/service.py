"""POST /v1/completions and /v1/chat/completions: body -> checks -> queued Job -> streamed or whole answer.

Every check a request can fail runs here, before it is queued, so a bad request costs the engine nothing and
gets its 4xx at once: body size, JSON and field types, model name, prompt length, max_tokens against the
context window, token ids in range, queue room.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from specdecode.config import SamplingParams
from specdecode.errors import SpecdecodeError
from specdecode.planner.planner import Planner
from specdecode.server.access import client_of
from specdecode.server.answers import Answer, TokenTexts
from specdecode.server.budgets import OverBudget
from specdecode.server.errors import ApiError
from specdecode.server.formats import Meta, completion, usage
from specdecode.server.scheduler import ClientLimit, QueueFull, Scheduler, ShuttingDown
from specdecode.server.schemas import ChatRequest, CompletionRequest, SamplingFields, parse_request, sampling_params
from specdecode.server.settings import ServerSettings
from specdecode.server.streams import JobStream, collect

MAX_CHARS_PER_TOKEN = 32  # a prompt longer than the window times this cannot fit; a token is rarely over 10 chars


class CompletionService:
    def __init__(self, decoder, scheduler: Scheduler, settings: ServerSettings) -> None:
        self.decoder = decoder
        self.scheduler = scheduler
        self.settings = settings
        self.max_len = decoder.engine.max_len
        self.vocab_size = len(decoder.tokenizer)
        self.texts = TokenTexts(decoder.tokenizer)

    async def handle(self, request: Request, chat: bool) -> Response:
        check_json_content_type(request)
        raw = await read_body(request, self.settings.max_body_bytes, self.settings.body_timeout_s)
        req = parse_request(raw, ChatRequest if chat else CompletionRequest)
        if req.model != self.settings.model_name:
            raise ApiError(404, f"model '{req.model}' is not served here; this server serves "
                                f"'{self.settings.model_name}' (see GET /v1/models)", "model", "model_not_found")
        ids = await self._encode(req, chat)
        room = self.max_len - len(ids)
        if room < 1:
            raise ApiError(400, f"the prompt has {len(ids)} tokens but the context window is {self.max_len}: "
                                "shorten the prompt", "messages" if chat else "prompt", "context_length_exceeded")
        params = sampling_params(req, room, None if chat else self.settings.completion_default_max_tokens)
        if bad := [t for t in params.logit_bias if t >= self.vocab_size]:
            raise ApiError(400, f"logit_bias: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                           "logit_bias", "token_out_of_vocabulary")
        if req.n > self.settings.max_per_client:
            raise ApiError(400, f"n is {req.n} but a client may run at most {self.settings.max_per_client} requests "
                                "at once: lower n", "n")
        params = replace(params, grammar=await self._constraint(req, chat))
        k = self._num_draft_tokens(req, params)
        prediction = await self._encode_prediction(req)
        try:
            self.scheduler.check(ids, params, k, prediction, req.n)
        except SpecdecodeError as e:  # the field it names; else what a request too large for the window is told
            field, code = (e.field, e.code) if e.field else ("max_tokens", "context_length_exceeded")
            raise ApiError(400, str(e), field, code) from None
        client = client_of(request, bool(self.settings.keys), self.settings.trusted_proxies)
        try:
            job = self.scheduler.submit(ids, params, k, client, prediction, req.n)
        except QueueFull:
            raise ApiError(503, f"the server is busy ({self.settings.max_waiting} requests already waiting): "
                                "retry shortly", code="server_busy", headers={"Retry-After": "1"}) from None
        except ShuttingDown:
            raise ApiError(503, "the server is shutting down: retry on another replica or shortly",
                           code="server_shutting_down", headers={"Retry-After": "1"}) from None
        except ClientLimit:
            raise ApiError(429, f"too many requests from this client: at most {self.settings.max_per_client} at "
                                "once (running and waiting); retry when one has finished", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"}) from None
        except OverBudget as e:
            wait = f"{e.retry_after_s:.0f}"
            raise ApiError(429, f"this client has sent its {self.settings.client_prompt_tokens_per_minute} prompt "
                                f"tokens a minute (the server's --client-prompt-tokens-per-minute): retry in {wait} s",
                           code="rate_limit_exceeded", headers={"Retry-After": wait}) from None

        meta = Meta(req.model, chat)
        used_k = self.scheduler.default_num_draft_tokens if k is None else k
        answer = await self._answer(req, chat, ids)

        def make_usage(stats: list[dict]) -> dict:
            return usage(stats, self.decoder.method, used_k)

        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            return JobStream(job.members, meta, answer, make_usage, include_usage, self.settings.keepalive_s)
        finished = await collect(job.members, request)
        if finished is None:  # the client left; nobody will read this
            return Response(status_code=499)
        return JSONResponse(completion(meta, answer, finished, make_usage([f.stats for f in finished])))

    async def _constraint(self, req: SamplingFields, chat: bool):
        """The grammar the answer must follow: response_format's JSON, or (tool_choice required or a named
        function) tool calls; None for free text. Compiled off the event loop (the first one reads the tokenizer)."""
        tools = req.tool_dicts() if chat else None
        choice = req.choice_of_tool() if tools else "auto"
        fmt = req.response_format.as_dict() if req.response_format is not None else None
        try:
            if tools and choice != "auto":
                return await asyncio.to_thread(self.decoder.grammars.tool_calls, tools, choice,
                                               req.parallel_tool_calls)
            if fmt is not None and fmt["type"] != "text":
                return await asyncio.to_thread(self.decoder.response_format, fmt)
        except SpecdecodeError as e:  # JSON Schema cannot say which schemas the grammar engine supports
            raise ApiError(400, str(e), "tools" if tools and choice != "auto" else "response_format",
                           "unsupported_schema") from None
        return None

    async def _answer(self, req: SamplingFields, chat: bool, ids: list[int]) -> Answer:
        top = req.top_logprobs_wanted()
        if top is not None:  # the token texts are read once, off the event loop (a second for 150k tokens)
            await asyncio.to_thread(self.texts.bytes_of, 0)
        if chat:
            return Answer(True, self.texts, top, tools=req.tool_dicts())
        echo = None
        if req.echo:
            prompt = req.single_prompt()
            echo = prompt if isinstance(prompt, str) else await asyncio.to_thread(self.decoder.tokenizer.decode, ids)
        return Answer(False, self.texts, top, echo, ids if echo is not None else [])

    async def _encode(self, req: SamplingFields, chat: bool) -> list[int]:
        prompt = req.message_dicts() if chat else req.single_prompt()
        chars = len(json.dumps(prompt)) if not isinstance(prompt, str) else len(prompt)
        if chars > self.max_len * MAX_CHARS_PER_TOKEN:  # cannot fit: refused before the tokenizer spends on it
            raise ApiError(400, f"the prompt has {chars} characters, more than a context window of {self.max_len} "
                                "tokens can hold: shorten the prompt", "messages" if chat else "prompt",
                           "context_length_exceeded")
        if chat and req.tool_dicts():
            return await self._encode_with_tools(prompt, req.tool_dicts())
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            bad = [t for t in prompt if not 0 <= t < self.vocab_size]
            if bad:
                raise ApiError(400, f"prompt: token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                               "prompt")
            return prompt
        try:
            # Off the event loop: a long prompt takes a while to tokenize, and other clients are streaming.
            ids = await asyncio.to_thread(self.decoder.encode, prompt, chat)
        except SpecdecodeError as e:
            raise ApiError(400, str(e), e.field or ("messages" if chat else "prompt")) from None
        if not ids:
            raise ApiError(400, "the prompt is empty after tokenization", "prompt")
        return ids

    async def _encode_with_tools(self, messages: list[dict], tools: list[dict]) -> list[int]:
        tokenizer = self.decoder.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise ApiError(400, "this model has no chat template to render tools with", "tools")
        try:  # the decoder's encode keeps special token text in messages and tools as text
            return await asyncio.to_thread(self.decoder.encode, messages, True, tools)
        except SpecdecodeError as e:
            raise ApiError(400, str(e), e.field or "tools") from None

    async def _encode_prediction(self, req: SamplingFields) -> list[int] | None:
        if req.prediction is None:
            return None
        text = req.prediction.text()
        if len(text) > self.max_len * MAX_CHARS_PER_TOKEN:
            raise ApiError(400, f"the prediction has {len(text)} characters, more than a context window of "
                                f"{self.max_len} tokens can hold: shorten it", "prediction")
        return await asyncio.to_thread(self.decoder.encode_prediction, text)

    def _num_draft_tokens(self, req: SamplingFields, params: SamplingParams) -> int | None:
        k, limit = req.num_draft_tokens, self.settings.max_draft_tokens
        if k is not None and k > limit:
            raise ApiError(400, f"num_draft_tokens must be <= {limit}, got {k}", "num_draft_tokens")
        return Planner.served_size(k, self.scheduler.default_num_draft_tokens, params)


def check_json_content_type(request: Request) -> None:
    """Only JSON bodies: a web page may post `text/plain` to a server it can reach without asking first (no CORS
    preflight for it); `application/json` needs the server's consent."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind != "application/json":
        raise ApiError(415, f"the request body must be JSON, sent with 'Content-Type: application/json' (got "
                            f"'{kind or 'none'}')", code="unsupported_media_type")


async def read_body(request: Request, limit: int, timeout_s: float = 30.0) -> bytes:
    """The request body, refused with 413 as soon as it is known to exceed `limit` bytes, and with 408 if it has not
    all arrived within `timeout_s` seconds (a client that trickles its body would hold a connection for ever)."""
    too_large = ApiError(413, f"the request body is larger than {limit} bytes")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    parts = request.stream().__aiter__()
    while True:
        try:
            part = await asyncio.wait_for(parts.__anext__(), max(0.0, deadline - loop.time()))
        except StopAsyncIteration:
            return bytes(body)
        except asyncio.TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout",
                           headers={"Connection": "close"}) from None
        body += part
        if len(body) > limit:
            raise too_large
