"""The OpenAI-compatible HTTP app: a thin FastAPI layer over SpecDecoder.

    app = create_app(SpecDecoder.load(...), ServerSettings(model_name="smollm2-135m-instruct"))
    uvicorn.run(app)

Routes: POST /v1/completions, POST /v1/chat/completions (stream or not), GET /v1/models, GET /health (the
engine runs), GET /ready (and takes requests: 503 while draining), GET /metrics (Prometheus), GET / (the
playground page), GET /openapi.json and GET /docs (FastAPI's interactive page over it). With an API key, /v1/*
needs the bearer token; /health, /metrics, the pages and the OpenAPI document do not (the pages ask for the key and
send it with their own requests).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from importlib.resources import files

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware

from specdecode.engine.engine import kv_budget_tokens
from specdecode.server.access import REQUEST_ID, RequestIds, bearer_check
from specdecode.server.compute import ComputeThread
from specdecode.server.errors import ApiError, error_body, error_response
from specdecode.server.metrics import Metrics
from specdecode.server.openapi import (
    POST_RESPONSES,
    ChatResponse,
    CompletionResponse,
    Health,
    ModelCard,
    ModelList,
    errors,
    sse_and_json,
)
from specdecode.server.openapi import install as install_openapi
from specdecode.server.scheduler import Scheduler
from specdecode.server.schemas import MAX_CHOICES
from specdecode.server.service import CompletionService
from specdecode.server.settings import ServerSettings

log = logging.getLogger("specdecode.server")


def create_app(decoder, settings: ServerSettings, compute: ComputeThread | None = None) -> FastAPI:
    """`compute`: the thread `decoder` was loaded on, where the engine then runs (compute.py says why it matters;
    None: a thread of the server's own). `app.state.on_fatal` holds what to call if the engine loop dies
    (`specdecode serve` stops the process)."""
    on_fatal: list[Callable[[], None]] = []
    metrics = Metrics(settings.model_name, decoder.method, settings.replica)
    kv_budget = kv_budget_tokens(decoder.engine.target, settings.kv_cache_gib)
    scheduler = Scheduler(decoder, metrics, settings.max_waiting, settings.max_running, settings.max_per_client,
                          kv_budget, compute, lambda: [hook() for hook in on_fatal], settings.request_timeout_s,
                          settings.client_prompt_tokens_per_minute)
    service = CompletionService(decoder, scheduler, settings)
    playground = files("specdecode.server").joinpath("static/playground.html").read_text(encoding="utf-8")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        scheduler.start()
        yield
        await asyncio.to_thread(scheduler.stop)

    # /docs: Swagger UI, whose script and style the reader's browser loads from a CDN (docs/server.md)
    app = FastAPI(title="specdecode", lifespan=lifespan, docs_url="/docs", redoc_url=None)
    keys = settings.keys
    auth = (401,) if keys else ()
    install_openapi(app, settings.model_name, bool(keys),
                    {"vocab_size": len(decoder.tokenizer), "max_len": decoder.engine.max_len,
                     "max_draft_tokens": settings.max_draft_tokens,
                     "max_choices": min(MAX_CHOICES, settings.max_running)})
    app.state.scheduler, app.state.metrics, app.state.on_fatal = scheduler, metrics, on_fatal
    if settings.replica:
        app.add_middleware(ReplicaHeader, replica=settings.replica)
    if settings.allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"])
    if settings.allowed_hosts != ("*",):  # a web page of another name reaching a loopback server: DNS rebinding
        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(settings.allowed_hosts))
    app.add_middleware(RequestIds)  # outermost: every answer carries its id, refusals included
    _add_error_handlers(app, metrics)

    check_key = Depends(bearer_check(keys))
    api = APIRouter(prefix="/v1", dependencies=[check_key])

    @api.post("/completions", responses=sse_and_json(CompletionResponse) | errors(*POST_RESPONSES, *auth))
    async def completions(request: Request) -> Response:
        return await service.handle(request, chat=False)

    @api.post("/chat/completions", responses=sse_and_json(ChatResponse) | errors(*POST_RESPONSES, *auth))
    async def chat_completions(request: Request) -> Response:
        return await service.handle(request, chat=True)

    @api.get("/models", response_model=ModelList, responses=errors(*auth))
    async def models() -> dict:
        return {"object": "list", "data": [model_card(decoder, scheduler, settings)]}

    @api.get("/models/{name:path}", response_model=ModelCard, responses=errors(404, *auth))
    async def model(name: str) -> dict:
        if name != settings.model_name:
            raise ApiError(404, f"model '{name}' is not served here", "model", "model_not_found")
        return model_card(decoder, scheduler, settings)

    app.include_router(api)

    @app.get("/health", response_model=Health, responses={503: {"model": Health, "description": "Engine stopped"}})
    async def health() -> Response:
        alive = scheduler.alive
        body = {"status": "ok" if alive else "engine stopped", "model": settings.model_name}
        if settings.replica:
            body["replica"] = settings.replica
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/ready", response_model=Health, responses={503: {"model": Health,
                                                               "description": "Draining or engine stopped"}})
    async def ready() -> Response:
        ok = scheduler.ready
        body = {"status": "ok" if ok else "draining" if scheduler.alive else "engine stopped",
                "model": settings.model_name}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=Response, dependencies=[check_key] if settings.protect_metrics else [],
             responses={200: {"description": "Prometheus text format",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}} | (
                 errors(401) if settings.protect_metrics and keys else {}))
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/", response_class=HTMLResponse)
    async def page() -> HTMLResponse:
        return HTMLResponse(playground)

    return app


def model_card(decoder, scheduler: Scheduler, settings: ServerSettings) -> dict:
    return {"id": settings.model_name, "object": "model", "created": 0, "owned_by": "specdecode",
            "max_model_len": decoder.engine.max_len,
            "specdecode": {"method": decoder.method, "num_draft_tokens": scheduler.default_num_draft_tokens,
                           "max_draft_tokens": settings.max_draft_tokens,
                           "auth_required": bool(settings.keys)}}


def _add_error_handlers(app: FastAPI, metrics: Metrics) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> Response:
        metrics.record_rejected(err.status)
        return error_response(err)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, err: HTTPException) -> Response:
        # Starlette's own 404 / 405, in OpenAI's error shape like everything else.
        return JSONResponse(error_body(err.status_code, f"{err.detail}: {request.method} {request.url.path}"),
                            status_code=err.status_code, headers=getattr(err, "headers", None))

    @app.exception_handler(Exception)
    async def crash(request: Request, err: Exception) -> Response:
        log.exception("unhandled error on %s %s (request %s)", request.method, request.url.path, REQUEST_ID.get())
        metrics.record_rejected(500)
        return JSONResponse(error_body(500, "internal server error (see the server log)"), status_code=500)


class ReplicaHeader:
    """ASGI middleware: every answer says which replica gave it (X-Specdecode-Replica), streams included."""

    def __init__(self, app, replica: str) -> None:
        self.app = app
        self.header = (b"x-specdecode-replica", replica.encode())

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_tagged(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), self.header]
            await send(message)

        await self.app(scope, receive, send_tagged)
