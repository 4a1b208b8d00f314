"""Running the app under uvicorn the way an operator expects.

- SIGTERM or Ctrl-C drains: no new requests (503, /ready says so), the ones in flight finish for up to
  `drain_timeout` seconds, the rest end with an error their clients see (an SSE error event and `[DONE]`, or a
  JSON error), and only then does uvicorn close its connections and stop the process as that signal does. A
  second signal stops at once.
- A dead engine stops the process with a non-zero status, after failing what it could, so that a supervisor
  (systemd, Kubernetes, Ray Serve) restarts it instead of leaving a server that accepts and never answers.
"""

from __future__ import annotations

import threading
from types import FrameType

import uvicorn
from fastapi import FastAPI

from specdecode.server.scheduler import Scheduler

EXIT_ENGINE_DIED = 3  # the status `specdecode serve` exits with when its engine loop died


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, drain_timeout: float) -> None:
        super().__init__(config)
        self.scheduler = scheduler
        self.drain_timeout = drain_timeout
        self.draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.draining or not self.scheduler.alive:  # a second signal, or nothing left to drain: stop now
            super().handle_exit(sig, frame)
            return
        self.draining = True
        threading.Thread(target=self._drain, args=(sig,), name="specdecode-drain", daemon=True).start()

    def _drain(self, sig: int) -> None:
        self.scheduler.drain(self.drain_timeout)
        super().handle_exit(sig, None)


def build_server(app: FastAPI, host: str, port: int, log_level: str = "info", drain_timeout: float = 30.0,
                 options: dict | None = None) -> DrainingServer:
    """The uvicorn server for `app` (from create_app), draining on signals and stopping if the engine dies.
    `options`: more of uvicorn.Config's (TLS files, the connection cap)."""
    # proxy_headers off: uvicorn would take X-Forwarded-For from any loopback peer, so a local client could pose
    # as anyone; which proxies to believe is --trust-forwarded-for's to say (server/access.py).
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                            proxy_headers=False, **(options or {}))
    server = DrainingServer(config, app.state.scheduler, drain_timeout)
    # Not handle_exit: uvicorn re-raises the signals it handled when it stops, and a process killed by SIGTERM
    # reads as a clean stop to a supervisor; this one must read as a failure (EXIT_ENGINE_DIED).
    app.state.on_fatal.append(lambda: setattr(server, "should_exit", True))
    return server


def serve(app: FastAPI, host: str, port: int, log_level: str, drain_timeout: float, options: dict | None = None) -> int:
    """Serve until a signal (drained) or the engine's death -> the process's exit status."""
    server = build_server(app, host, port, log_level, drain_timeout, options)
    server.run()
    return EXIT_ENGINE_DIED if server.scheduler.failed else 0
