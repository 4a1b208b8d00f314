"""Access: several API keys (fairness counted per key), /metrics behind a key, Host and CORS checks, forwarded
clients from trusted proxies only, request ids."""

from __future__ import annotations

import httpx
import pytest
from server_thread import BackgroundServer
from test_server_scheduler import ScriptedDecoder

from specdecode.errors import SpecdecodeError
from specdecode.server.access import read_key_file
from specdecode.server.app import create_app
from specdecode.server.settings import ServerSettings

BODY = {"model": "m", "prompt": "hi", "max_tokens": 3}


def serve(**settings) -> tuple[ScriptedDecoder, BackgroundServer]:
    decoder = ScriptedDecoder(steps=3)
    decoder.batch.step_s = 0.01  # a long request holds its slot for as long as a test needs
    return decoder, BackgroundServer(create_app(decoder, ServerSettings(model_name="m", **settings)))


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_every_listed_key_opens_the_api_and_limits_count_per_key():
    decoder, server = serve(api_key="alpha", api_keys=("beta", "gamma"), max_per_client=1, protect_metrics=True)
    with server as url, httpx.Client(base_url=url, timeout=10) as http:
        decoder.allow()
        for key in ("alpha", "beta", "gamma"):
            assert http.post("/v1/completions", json=BODY, headers=bearer(key)).status_code == 200
        for headers in ({}, bearer("delta"), bearer("alph")):
            assert http.post("/v1/completions", json=BODY, headers=headers).status_code == 401
        assert http.get("/metrics").status_code == 401 and http.get("/metrics", headers=bearer("beta")).status_code == 200
        assert http.get("/health").status_code == 200  # probes need no key
        decoder.batch.steps = 10**9  # a request that holds its slot
        with http.stream("POST", "/v1/completions", json=BODY | {"stream": True}, headers=bearer("alpha")) as held:
            assert held.status_code == 200 and "choices" in next(held.iter_lines())  # it runs, holding its slot
            # One address, two users behind it: each key has its own quota of one.
            assert http.post("/v1/completions", json=BODY, headers=bearer("alpha")).status_code == 429
            decoder.batch.steps_for[4] = 3  # "hi" encodes to [4, 5]: short requests from here on
            assert http.post("/v1/completions", json=BODY, headers=bearer("beta")).status_code == 200


def test_host_and_origin_checks():
    decoder, server = serve(allowed_hosts=("localhost", "127.0.0.1"), allowed_origins=("https://app.example",))
    with server as url, httpx.Client(base_url=url, timeout=10) as http:
        decoder.allow()
        assert http.post("/v1/completions", json=BODY).status_code == 200
        rebound = http.post("/v1/completions", json=BODY, headers={"Host": "attacker.example"})
        assert rebound.status_code == 400  # a page served as attacker.example, resolved to 127.0.0.1
        ok = http.options("/v1/completions", headers={"Origin": "https://app.example",
                                                     "Access-Control-Request-Method": "POST"})
        assert ok.headers.get("access-control-allow-origin") == "https://app.example"
        other = http.options("/v1/completions", headers={"Origin": "https://evil.example",
                                                        "Access-Control-Request-Method": "POST"})
        assert "access-control-allow-origin" not in other.headers


def test_forwarded_clients_count_only_from_trusted_proxies():
    for trusted, limited in (((), True), (("127.0.0.1",), False)):
        decoder, server = serve(max_per_client=1, trusted_proxies=trusted)
        decoder.batch.steps = 10**9  # a request that holds its slot: "zz" (its first id 22)
        # "hi" (4, 5) is short. Set before either request starts: set while the held one may still be joining, it
        # made that one short too, and it ended before the other came (a 200 where a 429 was due).
        decoder.batch.steps_for[4] = 3
        with server as url, httpx.Client(base_url=url, timeout=10) as http:
            decoder.allow()
            with http.stream("POST", "/v1/completions", json=BODY | {"stream": True, "prompt": "zz"},
                             headers={"X-Forwarded-For": "10.0.0.1"}) as held:
                assert held.status_code == 200 and "choices" in next(held.iter_lines())  # it runs, holding its slot
                other = http.post("/v1/completions", json=BODY, headers={"X-Forwarded-For": "10.0.0.2"})
                assert (other.status_code == 429) == limited, trusted


def test_every_answer_carries_a_request_id():
    decoder, server = serve()
    with server as url, httpx.Client(base_url=url, timeout=10) as http:
        decoder.allow()
        fresh = http.post("/v1/completions", json=BODY).headers["x-request-id"]
        assert len(fresh) == 32
        assert http.get("/health", headers={"X-Request-Id": "trace-42"}).headers["x-request-id"] == "trace-42"
        odd = http.get("/health", headers={"X-Request-Id": "a b\tc"}).headers["x-request-id"]
        assert odd != "a b\tc" and len(odd) == 32  # not plain: not echoed
        assert "x-request-id" in http.post("/v1/nothing", json=BODY).headers  # refusals too


def test_key_files(tmp_path):
    path = tmp_path / "keys"
    path.write_text("# team keys\nalpha\n\n  beta  \n")
    assert read_key_file(str(path)) == ("alpha", "beta")
    path.write_text("# nothing\n")
    with pytest.raises(SpecdecodeError, match="no key"):
        read_key_file(str(path))
    with pytest.raises(SpecdecodeError, match="missing"):
        read_key_file(str(tmp_path / "missing"))


def test_a_request_past_its_deadline_ends_with_504_and_a_trickled_body_with_408():
    import socket
    import time

    decoder, server = serve(request_timeout_s=0.3, body_timeout_s=0.5)
    decoder.batch.steps = 10**9
    with server as url, httpx.Client(base_url=url, timeout=10) as http:
        decoder.allow()
        began = time.monotonic()
        late = http.post("/v1/completions", json=BODY)
        assert late.status_code == 504 and "request-timeout" in late.json()["error"]["message"]
        assert time.monotonic() - began < 5
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as raw:  # promises 100 bytes, sends 10
            raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                        b"Content-Length: 100\r\n\r\n{\"model\": ")
            raw.settimeout(10)
            answer = raw.recv(4096).decode()
        assert answer.startswith("HTTP/1.1 408") and "did not arrive" in answer
