"""Connection-level defences: what a connection may cost before its request reaches the app (or an API key check).

uvicorn's h11 protocol, plus:
- an idle deadline: a new connection that sends nothing for `idle_timeout_s` is closed;
- a head deadline: the request line and headers must all arrive within `header_timeout_s` of their first byte
  (else 408), so headers trickled a byte at a time hold no connection for ever;
- a head size cap: h11 is fed at most `max_head_bytes` + 1 bytes of a head and refuses one still unfinished
  (uvicorn's `h11_max_incomplete_event_size`) with 431, instead of a 100 MB head read whole while the event
  loop, and so every other client, waits;
- a per-address cap: one peer address's connections past `max_per_address` are refused at once (429), so one
  host cannot fill the connection cap; loopback and trusted proxies are not capped (they carry many clients);
- the connection cap itself: `max_connections` connections are served (uvicorn's `limit_concurrency` counts the
  asking connection too, so it serves one fewer) and the probes /health and /ready are always answered, so a
  cap full of idle sockets does not read as a dead server to a load balancer.
h11 rather than httptools: it always comes with uvicorn, and it bounds an unfinished head by itself.
Every refusal is an OpenAI-style JSON error; the checks cost O(1) per read, on the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import json
import sys
from collections import Counter
from dataclasses import dataclass
from http import HTTPStatus

import h11
from starlette.responses import JSONResponse
from uvicorn.config import Config
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.server import ServerState

from specdecode.errors import SpecdecodeError
from specdecode.server.errors import error_body

PROBES = ("/health", "/ready")  # answered whatever the connection count
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


@dataclass(frozen=True)
class ConnectionLimits:
    max_connections: int = 256  # connections served at once; requests on more get 503 (the probes excepted)
    max_per_address: int = 64  # connections one peer address may hold open (0: no cap); more are refused (429)
    uncapped: tuple[str, ...] = LOOPBACK  # peers the per-address cap skips: loopback, trusted proxies
    idle_timeout_s: float = 10.0  # a new connection that sends nothing this long is closed
    header_timeout_s: float = 10.0  # a request head not whole this long after its first byte gets 408
    max_head_bytes: int = 64 * 1024  # request line + headers; a longer head gets 431

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise SpecdecodeError(f"--max-connections must be >= 1, got {self.max_connections}")
        if self.max_per_address < 0:
            raise SpecdecodeError(f"--max-connections-per-address must be >= 0, got {self.max_per_address}")
        if not self.idle_timeout_s > 0 or not self.header_timeout_s > 0:
            raise SpecdecodeError("--idle-timeout and --header-timeout must be > 0")
        if self.max_head_bytes < 1024:
            raise SpecdecodeError(f"--max-header-bytes must be >= 1024, got {self.max_head_bytes}")


def uvicorn_options(limits: ConnectionLimits) -> dict:
    """uvicorn.Config options that put `limits` on every connection of one server."""
    protocol = functools.partial(GuardedProtocol, limits=limits, per_address=Counter())  # one count per server
    return {"http": protocol, "h11_max_incomplete_event_size": limits.max_head_bytes}


class GuardedProtocol(H11Protocol):
    """One connection: uvicorn's h11 protocol under `limits`; `per_address` is shared by the server's connections."""

    def __init__(self, config: Config, server_state: ServerState, app_state: dict,
                 _loop: asyncio.AbstractEventLoop | None = None, *, limits: ConnectionLimits,
                 per_address: Counter[str]) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.limits, self.per_address = limits, per_address
        self.inner_app, self.app = self.app, self.admit  # uvicorn starts every request on `self.app`
        self.limit_concurrency = None  # admit() applies the cap instead: uvicorn's is off by one, probes included
        self.deadline: asyncio.TimerHandle | None = None
        self.head_begun = False  # part of a request head has arrived, not all of it
        self.head_bytes = 0  # of that head, fed to h11 so far
        self.address: str | None = None  # counted in per_address while open

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        host = self.client[0] if self.client else None
        if host is not None and self.limits.max_per_address and host not in self.limits.uncapped:
            if self.per_address[host] >= self.limits.max_per_address:
                self.refuse(429, f"{host} already holds {self.limits.max_per_address} open connections, the most "
                                 "one address may (--max-connections-per-address); reuse them or close some")
                return
            self.per_address[host] += 1
            self.address = host
        self.arm(self.limits.idle_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self.disarm()
        if self.address is not None:
            self.per_address[self.address] -= 1
            if not self.per_address[self.address]:
                del self.per_address[self.address]
            self.address = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        # h11 checks the cap only on a head still unfinished after a whole read (up to 256 KiB): feed it no more
        # than the cap + 1 bytes of a head, so that a longer one gets 431 however the client split it.
        while data and self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            room = max(self.limits.max_head_bytes + 1 - self.head_bytes, 1)
            self.head_bytes += min(room, len(data))
            super().data_received(data[:room])
            data = data[room:]
        if data and not self.transport.is_closing():
            super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():  # a head begun, not whole yet
            if not self.head_begun:
                self.head_begun = True
                self.arm(self.limits.header_timeout_s)
        else:  # the head is whole (the body has its own timeout in the app), or the connection is done
            self.head_begun, self.head_bytes = False, 0
            self.disarm()

    def send_400_response(self, msg: str) -> None:
        # uvicorn calls this inside its `except h11.RemoteProtocolError`: h11's status hint tells a head over
        # the cap (431) from a malformed one (400).
        error = sys.exc_info()[1]
        status = getattr(error, "error_status_hint", 400)
        if status == 431:
            self.refuse(431, f"the request line and headers are over {self.limits.max_head_bytes} bytes, the most "
                             "this server reads (--max-header-bytes)")
        else:
            self.refuse(400, f"malformed HTTP request: {error or msg}")

    async def admit(self, scope, receive, send) -> None:
        """The app, unless more than max_connections are open; the probes are answered whatever the count."""
        if len(self.connections) > self.limits.max_connections and scope.get("path") not in PROBES:
            message = (f"the server is at its {self.limits.max_connections} open connections (--max-connections); "
                       "retry shortly")
            response = JSONResponse(error_body(503, message), status_code=503,
                                    headers={"Retry-After": "1", "Connection": "close"})
            await response(scope, receive, send)
            return
        await self.inner_app(scope, receive, send)

    def arm(self, seconds: float) -> None:
        self.disarm()
        self.deadline = self.loop.call_later(seconds, self.expire)

    def disarm(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
            self.deadline = None

    def expire(self) -> None:
        self.deadline = None
        if self.transport.is_closing():
            return
        if self.head_begun:
            self.refuse(408, f"the request line and headers did not all arrive within {self.limits.header_timeout_s:g}"
                             " s of their first byte (--header-timeout)")
        else:  # asked nothing: nothing to answer
            self.transport.close()

    def refuse(self, status: int, message: str) -> None:
        """Answer `status` with an OpenAI-style error and close; nothing of this connection reaches the app."""
        body = json.dumps(error_body(status, message)).encode()
        head = (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
        self.transport.write(head.encode() + body)
        self.transport.close()
