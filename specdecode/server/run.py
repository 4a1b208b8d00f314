"""Running the app under uvicorn the way an operator expects.

- SIGTERM or Ctrl-C drains: no new requests (503, /ready says so), the ones in flight finish for up to
  `drain_timeout` seconds, the rest end with an error their clients see (an SSE error event and `[DONE]`, or a
  JSON error), and only then does uvicorn close its connections; the process then exits 0, through atexit, where
  the suffix pool is saved (a drain cut short by `drain_timeout` exits 0 too: the stop was asked for, and each
  client cut off saw its error). A second signal stops at once.
- A dead engine stops the process with a non-zero status, after failing what it could, so that a supervisor
  (systemd, Kubernetes, Ray Serve) restarts it instead of leaving a server that accepts and never answers.
"""

from __future__ import annotations

import logging
import threading
from types import FrameType

import uvicorn
from fastapi import FastAPI

from specdecode.server.connections import ConnectionLimits, uvicorn_options
from specdecode.server.scheduler import Scheduler

EXIT_ENGINE_DIED = 3  # the status `specdecode serve` exits with when its engine loop died
log = logging.getLogger("specdecode.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, drain_timeout: float) -> None:
        super().__init__(config)
        self.scheduler = scheduler
        self.drain_timeout = drain_timeout
        self.draining = False

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not uvicorn's handle_exit: it keeps the signal to raise it again once stopped, and a process killed by
        # SIGTERM exits 143 and skips atexit, where what the drafters learned (the suffix pool) is saved.
        if self.draining or not self.scheduler.alive:  # a second signal, or nothing left to drain: stop now
            self.force_exit = self.should_exit  # a third: not even the open connections are waited for
            self.should_exit = True
            return
        self.draining = True
        threading.Thread(target=self._drain, name="specdecode-drain", daemon=True).start()

    def _drain(self) -> None:
        cut = self.scheduler.drain(self.drain_timeout)
        if cut:
            log.warning("specdecode: the drain timeout (%g s) ended %d requests unfinished", self.drain_timeout, cut)
        self.should_exit = True


def build_server(app: FastAPI, host: str, port: int, log_level: str = "info", drain_timeout: float = 30.0,
                 options: dict | None = None, limits: ConnectionLimits | None = None) -> DrainingServer:
    """The uvicorn server for `app` (from create_app), draining on signals and stopping if the engine dies.
    `options`: more of uvicorn.Config's (TLS files); `limits`: what one connection may cost (connections.py)."""
    # proxy_headers off: uvicorn would take X-Forwarded-For from any loopback peer, so a local client could pose
    # as anyone; which proxies to believe is --trust-forwarded-for's to say (server/access.py).
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5,
                            proxy_headers=False, **uvicorn_options(limits or ConnectionLimits()), **(options or {}))
    server = DrainingServer(config, app.state.scheduler, drain_timeout)
    # Not handle_exit: this stop must read as a failure to a supervisor (EXIT_ENGINE_DIED), not as a drain (0).
    app.state.on_fatal.append(lambda: setattr(server, "should_exit", True))
    return server


def serve(app: FastAPI, host: str, port: int, log_level: str, drain_timeout: float, options: dict | None = None,
          limits: ConnectionLimits | None = None) -> int:
    """Serve until a signal (drained) or the engine's death -> the process's exit status."""
    server = build_server(app, host, port, log_level, drain_timeout, options, limits)
    server.run()
    return EXIT_ENGINE_DIED if server.scheduler.failed else 0
