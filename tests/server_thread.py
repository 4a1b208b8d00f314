"""Run the server on a loopback port in a background thread, for the tests.

    with BackgroundServer(create_app(decoder, settings)) as url:
        OpenAI(base_url=url + "/v1", api_key="x").completions.create(...)
"""

from __future__ import annotations

import threading
import time

import uvicorn
from fastapi import FastAPI


class BackgroundServer:
    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0) -> None:
        # port 0: the OS picks a free port, read back once the socket is bound.
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=5, proxy_headers=False)  # as `specdecode serve` runs it
        self.server = uvicorn.Server(config)
        self.host = host
        self._thread = threading.Thread(target=self.server.run, name="specdecode-http", daemon=True)
        self.url = ""

    def start(self, timeout: float = 30.0) -> str:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start (see the log above)")
            time.sleep(0.02)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{self.host}:{port}"
        return self.url

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self._thread.join(timeout)

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
