"""Who may call, and who a caller is: API keys, the client a request counts against, and request ids.

- Keys: `--api-key` and/or `--api-key-file` (one per line, `#` comments); a request's bearer token is compared
  with every key, each as a SHA-256 digest in constant time, so neither a key nor its length leaks through timing.
- The client a request's fairness and limits count against: its key (a short digest of it) when keys are in use,
  so users behind one TLS proxy are not one bucket; else its peer address, or the first `X-Forwarded-For` address
  when the peer is a proxy named in `--trust-forwarded-for` (never trusted from anyone else: it is a header any
  client can write).
- Every answer carries an `X-Request-Id`: the caller's own if it sent a plain one, else a fresh one; server logs
  name it.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import uuid
from contextvars import ContextVar
from pathlib import Path

from fastapi import Request

from specdecode.errors import SpecdecodeError
from specdecode.server.errors import ApiError

REQUEST_ID: ContextVar[str] = ContextVar("request_id", default="-")
SAFE_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # a caller's id is echoed only if it is this plain


def read_key_file(path: str) -> tuple[str, ...]:
    """Keys from a file, one per line; blank lines and `#` comments skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise SpecdecodeError(f"--api-key-file {path}: {e.strerror}") from None
    keys = tuple(line.strip() for line in lines if line.strip() and not line.strip().startswith("#"))
    if not keys:
        raise SpecdecodeError(f"--api-key-file {path} holds no key")
    return keys


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def bearer_token(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" else None


def bearer_check(keys: tuple[str, ...]):
    """A dependency demanding `Authorization: Bearer <one of keys>` (a no-op without keys)."""
    expected = [digest(key) for key in keys]

    async def check(request: Request) -> None:
        if not expected:
            return
        token = digest(bearer_token(request) or "")
        matches = [hmac.compare_digest(token, key) for key in expected]  # every key, whichever matches
        if not any(matches) or bearer_token(request) is None:
            raise ApiError(401, "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    return check


def client_of(request: Request, keyed: bool, trusted_proxies: tuple[str, ...]) -> str:
    """The client a request's fairness and per-client limit count against."""
    if keyed and (token := bearer_token(request)):
        return "key:" + digest(token).hex()[:12]
    peer = request.client.host if request.client else "unknown"
    forwarded = request.headers.get("x-forwarded-for", "")
    if peer in trusted_proxies and forwarded:
        return forwarded.split(",")[0].strip() or peer
    return peer


class RequestIds:
    """ASGI middleware: an `X-Request-Id` on every answer (the caller's plain one, or a fresh one), set for the
    logs while the request runs."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = dict(scope.get("headers", [])).get(b"x-request-id", b"").decode("latin-1")
        request_id = given if SAFE_ID.fullmatch(given) else uuid.uuid4().hex
        token = REQUEST_ID.set(request_id)

        async def send_tagged(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode())]
            await send(message)

        try:
            await self.app(scope, receive, send_tagged)
        finally:
            REQUEST_ID.reset(token)
