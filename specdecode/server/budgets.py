"""Per-client budgets of prompt tokens per minute (`--client-prompt-tokens-per-minute`).

Counting requests (`--max-per-client`) does not bound what a client costs: the engine's time grows with the
prompt, and one ~7,400-token prompt took ~80 s of a 2-core machine's engine. So each client has a bucket of
prompt tokens that refills at the budget's rate, holding at most a minute's worth. A request may start while the
bucket is not empty and takes its prompt's tokens from it, going into debt if the prompt is larger: a long prompt
is served once, never refused for ever, and its client then waits until the debt is repaid. An empty bucket is
a 429 with the seconds until it holds a token again (Retry-After).
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable

WINDOW_S = 60.0  # the budget is per minute
FORGET_AFTER = 4096  # clients remembered before full buckets (nothing owed) are forgotten


class OverBudget(Exception):
    def __init__(self, retry_after_s: float) -> None:
        super().__init__(f"retry in {retry_after_s:.0f} s")
        self.retry_after_s = retry_after_s


class PromptTokenBudget:
    def __init__(self, tokens_per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.capacity = tokens_per_minute
        self.rate = tokens_per_minute / WINDOW_S  # tokens per second
        self.clock = clock
        self._level: dict[str, tuple[float, float]] = {}  # client -> (tokens in its bucket, when last counted)
        self._lock = threading.Lock()

    def charge(self, client: str, tokens: int) -> None:
        """Take `tokens` from `client`'s bucket, or raise OverBudget (nothing taken) while it is empty."""
        with self._lock:
            now = self.clock()
            level = self._refilled(client, now)
            if level <= 0:
                raise OverBudget(max(1.0, math.ceil((1 - level) / self.rate)))
            self._level[client] = (level - tokens, now)
            if len(self._level) > FORGET_AFTER:
                self._forget_full(now)

    def _refilled(self, client: str, now: float) -> float:
        level, then = self._level.get(client, (self.capacity, now))
        return min(self.capacity, level + (now - then) * self.rate)

    def _forget_full(self, now: float) -> None:
        """Drop the clients whose bucket has refilled: a new entry for them starts full, the same."""
        for client in [c for c in self._level if self._refilled(c, now) >= self.capacity]:
            del self._level[client]
