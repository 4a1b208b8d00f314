"""`specdecode serve --replicas N` on SIGTERM: Serve and Ray are shut down before the process ends (without it,
the local Ray cluster's processes outlive the server), then the process exits 0, as the one-process server does
after its drain."""

from __future__ import annotations

import os
import signal
import threading

from specdecode.server import ray_app
from specdecode.server.settings import ServerSettings


def test_sigterm_shuts_ray_down_then_exits_0(monkeypatch):
    calls: list[str] = []
    monkeypatch.setattr(ray_app, "connect", lambda *a, **k: None)
    monkeypatch.setattr(ray_app, "start", lambda *a, **k: calls.append("start") or "http://127.0.0.1:1")
    monkeypatch.setattr(ray_app, "stop", lambda: calls.append("stop"))
    monkeypatch.setattr(signal, "raise_signal", lambda sig: calls.append(f"raise {sig.name}"))
    before = signal.getsignal(signal.SIGTERM)
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGTERM)).start()
    code = ray_app.serve_forever({}, ServerSettings(model_name="m"), 2, "127.0.0.1", 1, None, None, drain_timeout=1)
    assert calls == ["start", "stop"] and code == 0  # not killed by the signal: atexit runs
    assert signal.getsignal(signal.SIGTERM) is before  # the process's own handler is back


def test_a_signal_while_deploying_stops_what_started(monkeypatch):
    calls: list[str] = []

    def slow_start(*_a, **_k):
        calls.append("start")
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while the replicas load
        raise AssertionError("the signal should have ended the deployment")

    monkeypatch.setattr(ray_app, "connect", lambda *a, **k: None)
    monkeypatch.setattr(ray_app, "start", slow_start)
    monkeypatch.setattr(ray_app, "stop", lambda: calls.append("stop"))
    assert ray_app.serve_forever({}, ServerSettings(model_name="m"), 2, "127.0.0.1", 1, None, None) == 130
    assert calls == ["start", "stop"]
