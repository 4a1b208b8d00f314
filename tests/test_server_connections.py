"""Connection-level defences of `specdecode serve` (server/connections.py), seen through raw sockets against a live
server on loopback: idle and slow-head deadlines, the head size cap, the per-address cap, the connection cap (N
served, the probes always answered), each refusal an OpenAI-style JSON error."""

from __future__ import annotations

import json
import select
import socket
import threading
import time

import pytest
from test_server_scheduler import ScriptedDecoder

from specdecode.cli import main
from specdecode.server.app import create_app
from specdecode.server.connections import ConnectionLimits
from specdecode.server.run import build_server
from specdecode.server.settings import ServerSettings

DEADLINE = 10.0  # generous bound on waits for hangs, never a timing assertion


class Live:
    """A server on a free loopback port under `limits`, and raw sockets to it."""

    def __init__(self, limits: ConnectionLimits) -> None:
        decoder = ScriptedDecoder()
        decoder.allow()
        self.server = build_server(create_app(decoder, ServerSettings(model_name="m")), "127.0.0.1", 0, "warning",
                                   limits=limits)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.sockets: list[socket.socket] = []

    def __enter__(self) -> Live:
        self.thread.start()
        until = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < until, "the server did not start"
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        for sock in self.sockets:
            sock.close()
        self.server.should_exit = True
        self.thread.join(30)

    def connect(self, source: str = "127.0.0.1") -> socket.socket:
        sock = socket.socket()
        sock.settimeout(DEADLINE)
        sock.bind((source, 0))
        sock.connect(("127.0.0.1", self.port))
        self.sockets.append(sock)
        return sock

    def open_connections(self, count: int) -> None:
        """Wait until the server holds `count` connections (a connect returns before the server accepts)."""
        until = time.monotonic() + DEADLINE
        while len(self.server.server_state.connections) != count:
            assert time.monotonic() < until, f"{len(self.server.server_state.connections)} connections, not {count}"
            time.sleep(0.01)

    def get(self, path: str, sock: socket.socket | None = None, headers: str = "") -> tuple[int, dict]:
        sock = sock or self.connect()
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{headers}\r\n".encode())
        return answer(sock)


def answer(sock: socket.socket) -> tuple[int, dict]:
    """(status, JSON body) of one response; reads until the body is whole or the server closes."""
    data = b""
    while b"\r\n\r\n" not in data or len(data.partition(b"\r\n\r\n")[2]) < content_length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body) if body else {}


def content_length(data: bytes) -> int:
    for line in data.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


def closed(sock: socket.socket) -> bool:
    """The server closed `sock` (read until EOF, or a reset) before DEADLINE."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def test_a_connection_that_sends_nothing_is_closed_after_the_idle_deadline():
    with Live(ConnectionLimits(idle_timeout_s=0.3)) as live:
        idle = live.connect()
        assert closed(idle)
        live.open_connections(0)
        assert live.get("/health")[0] == 200


def test_a_request_head_trickled_byte_by_byte_gets_408_and_is_closed():
    with Live(ConnectionLimits(header_timeout_s=1.0, idle_timeout_s=30)) as live:
        slow = live.connect()
        request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 1000
        until = time.monotonic() + DEADLINE
        for byte in request:  # a byte every 0.2 s: the head never completes, nor does a gap reach the deadline
            assert time.monotonic() < until, "no answer to a head trickled past its deadline"
            if select.select([slow], [], [], 0.2)[0]:
                break
            slow.sendall(bytes([byte]))
        status, body = answer(slow)
        assert status == 408 and "--header-timeout" in body["error"]["message"]
        assert closed(slow)
        assert live.get("/health")[0] == 200


def test_a_huge_head_gets_431_before_it_is_read_whole_and_others_are_still_served():
    with Live(ConnectionLimits(max_head_bytes=64 * 1024)) as live:
        assert live.get("/health", headers="X-Big: " + "a" * 60_000 + "\r\n")[0] == 200  # under the cap: served
        status, body = live.get("/health", headers="X-Big: " + "a" * 70_000 + "\r\n")  # over it, in one read
        assert status == 431 and body["error"]["type"] == "invalid_request_error"
        prompt = json.dumps({"model": "m", "prompt": "x" * 200_000, "max_tokens": 1}).encode()
        post = live.connect()  # a short head and a long body in the same reads: the body is no head
        post.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(prompt), prompt))
        status, body = answer(post)
        assert status == 400 and body["error"]["code"] == "context_length_exceeded"  # parsed whole, then refused
        big = live.connect()
        big.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        sent = 0
        try:
            while not select.select([big], [], [], 0.01)[0]:  # send until the server answers
                assert sent < 100 * 2**20, "a 100 MB head was read whole"
                sent += big.send(b"a" * 16384)
        except (BrokenPipeError, ConnectionResetError):
            pass  # closed by the server: its answer may still be readable
        status, body = answer(big)
        assert status == 431 and "--max-header-bytes" in body["error"]["message"]
        assert sent < 2**20  # refused within a read or so of the cap, not at the end of the head
        assert live.get("/health")[0] == 200


def test_a_malformed_request_gets_a_json_400():
    with Live(ConnectionLimits()) as live:
        sock = live.connect()
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        status, body = answer(sock)
        assert status == 400 and body["error"]["type"] == "invalid_request_error"


def test_probes_answer_while_idle_sockets_fill_the_connection_cap_and_n_connections_are_served():
    with Live(ConnectionLimits(max_connections=4, idle_timeout_s=30)) as live:
        idle = [live.connect() for _ in range(3)]
        live.open_connections(3)
        assert live.get("/v1/models")[0] == 200  # the 4th connection of --max-connections 4: served
        live.sockets.pop().close()
        idle.append(live.connect())
        live.open_connections(4)  # the cap is full of sockets that ask nothing
        for probe in ("/health", "/ready"):
            assert live.get(probe)[0] == 200
        status, body = live.get("/v1/models")
        assert status == 503 and "--max-connections" in body["error"]["message"]
        idle.pop().close()
        live.open_connections(3)
        assert live.get("/v1/models")[0] == 200


def test_one_address_past_its_connection_cap_is_refused_and_others_are_not():
    with Live(ConnectionLimits(max_per_address=2, uncapped=(), idle_timeout_s=30)) as live:
        first, _ = live.connect(), live.connect()
        live.open_connections(2)
        status, body = answer(live.connect())  # refused at once, before it asks anything
        assert status == 429 and "--max-connections-per-address" in body["error"]["message"]
        try:
            other = live.connect("127.0.0.2")  # another address on loopback (Linux routes all of 127/8)
        except OSError:
            other = None
        if other is not None:
            assert live.get("/health", other)[0] == 200
        first.close()
        live.open_connections(2 if other is not None else 1)
        assert live.get("/health")[0] == 200  # the closed one's place is free again


def test_loopback_is_not_capped_per_address_by_default():
    with Live(ConnectionLimits(max_per_address=1, idle_timeout_s=30)) as live:
        live.connect()
        live.open_connections(1)
        assert live.get("/health")[0] == 200


@pytest.mark.parametrize("flag, value, why", [("--max-header-bytes", "10", ">= 1024, got 10"),
                                              ("--max-connections", "0", ">= 1, got 0"),
                                              ("--max-connections-per-address", "-1", ">= 0, got -1"),
                                              ("--idle-timeout", "0", "> 0"), ("--header-timeout", "-1", "> 0")])
def test_bad_connection_limits_are_one_clear_error_before_any_model_loads(flag, value, why, capsys):
    assert main(["serve", flag, value]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specdecode: error: ") and flag in err and err.endswith(why) and "\n" not in err
