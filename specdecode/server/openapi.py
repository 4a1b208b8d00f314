"""The server's OpenAPI document (/openapi.json): what each route accepts and answers, so clients and fuzzers can
read it. The POST routes parse their bodies themselves (one clear 400 naming every bad field), so their request
schemas are declared here from the same pydantic models; the served model's name is an enum, and the bearer
scheme appears only when an API key is set."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict

from specdecode.server.schemas import ChatRequest, CompletionRequest

REF = "#/components/schemas/{model}"


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    model_config = ConfigDict(extra="allow")  # + `speculative`: the request's drafting statistics
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Timings(BaseModel):
    """llama-server's per-request timings (formats.timings); draft_n and draft_n_accepted only when drafting."""

    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float | None  # None: no prompt token was computed (all came from the cache)
    prompt_per_second: float | None
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float | None
    predicted_per_second: float | None  # None: one token, no time after it
    draft_n: int | None = None
    draft_n_accepted: int | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None for an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCallOut(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: str
    function: FunctionCallOut


class ChatMessage(BaseModel):
    role: str
    content: str | None  # None: the answer is tool calls
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    timings: Timings


class ChatResponse(CompletionResponse):
    choices: list[ChatChoice]


class ModelCard(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: str
    object: str
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: str
    data: list[ModelCard]


class Health(BaseModel):
    model_config = ConfigDict(extra="allow")
    status: str
    model: str


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    reasons = {400: "Malformed request: the message names every bad field", 401: "Missing or wrong API key",
               404: "Unknown model or route", 413: "Request body too large",
               408: "The request body did not arrive in time", 415: "The body is not sent as application/json",
               429: "Too many requests from this client (see Retry-After)",
               503: "Busy or shutting down (see Retry-After)",
               504: "The request did not finish within the server's --request-timeout"}
    return {status: {"description": reasons[status], "model": ErrorResponse} for status in statuses}


# Each server-sent event: `data:` one chunk object as JSON (an error object if generation fails midway), the last
# one `[DONE]`; lines starting with ':' are keep-alive comments.
SSE_EVENT = {"type": "object", "required": ["data"],
             "properties": {"data": {"type": "string", "description": "a chunk as JSON, or [DONE]"},
                            "event": {"type": "string"}}}


def sse_and_json(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    return {200: {"description": "The answer: one JSON object, or server-sent events with \"stream\": true",
                  "model": model, "content": {"text/event-stream": {"schema": SSE_EVENT}}}}


POST_RESPONSES = {400, 404, 408, 413, 415, 429, 503, 504}


def install(app: FastAPI, model_name: str, auth: bool, limits: dict[str, int]) -> None:
    """Make app.openapi() declare the request bodies (and the bearer scheme when `auth`). `limits`: this server's
    bounds, {"vocab_size", "max_len", "max_draft_tokens"}."""
    bodies = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatRequest}

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                          description="OpenAI-compatible API with lossless speculative decoding.")
        components = doc.setdefault("components", {}).setdefault("schemas", {})
        for path, model in bodies.items():
            schema = model.model_json_schema(ref_template=REF)
            components.update(schema.pop("$defs", {}))
            props = schema["properties"]
            props["model"] = {"type": "string", "enum": [model_name], "description": "the served model"}
            for name in ("max_tokens", "max_completion_tokens"):  # the prompt's tokens count too: 400 beyond
                _bound(props.get(name), limits["max_len"] - 1)
            _bound(props["num_draft_tokens"], limits["max_draft_tokens"])
            _bound(props["n"], limits["max_choices"])  # every choice runs at once
            _bound(props.get("prompt"), limits["vocab_size"] - 1)  # token ids
            components[model.__name__] = schema
            doc["paths"][path]["post"]["requestBody"] = {
                "required": True, "content": {"application/json": {"schema": {"$ref": REF.format(model=model.__name__)}}}}
        for parameter in doc["paths"]["/v1/models/{name}"]["get"].get("parameters", []):
            parameter["example"] = model_name  # the one name that is not a 404
        if auth:
            doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for path, item in doc["paths"].items():
                if path.startswith("/v1/"):
                    for operation in item.values():
                        operation["security"] = [{"bearer": []}]
        app.openapi_schema = doc
        return doc

    app.openapi = openapi


def _bound(schema: dict | list | None, maximum: int) -> None:
    """Give every integer in `schema` (a property, maybe a union or a list) this maximum."""
    if isinstance(schema, list):
        for item in schema:
            _bound(item, maximum)
    elif isinstance(schema, dict):
        if schema.get("type") == "integer":
            schema["maximum"] = maximum
        for key in ("anyOf", "items"):
            _bound(schema.get(key), maximum)
