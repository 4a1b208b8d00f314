"""One thread for every model computation: loading, the cost curve's measurement and the engine's steps.

specdecode's kernels and torch's run on several cores through OpenMP, which keeps a team of threads for each
thread that starts a parallel region. Once a process holds more team threads than it has cores, libgomp stops
spinning between parallel regions and puts its threads to sleep, so every region (a dozen per decoder layer) pays
a wake-up. A server that loaded its models on the main thread and stepped the engine on a worker held two teams:
on a 2-core machine its target forwards ran ~35% slower than the CLI's and speculative steps ~2x slower
(BENCHMARKS.md, "Served as fast as it runs"). The server therefore loads and steps on one `ComputeThread`; a
Python caller should generate on the thread that loaded the models.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


class ComputeThread:
    def __init__(self, name: str = "specdecode-compute") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # A daemon: a server that exits without stopping its engine loop is not kept alive by it.
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:
        """Run fn(*args, **kwargs) on this thread, after the jobs before it -> its Future."""
        future: Future = Future()
        self._jobs.put((future, fn, args, kwargs))
        return future

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`submit`, then wait for the result (its exception is raised here)."""
        return self.submit(fn, *args, **kwargs).result()

    def _serve(self) -> None:
        while True:
            future, fn, args, kwargs = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(e)
