"""What the cached tokens add to a forward: attention reads every cached key and value, so a verify forward over m
rows after L cached tokens costs C(m) + (L - base) (alpha + beta (m - 1)) for one request, where C is the cost curve
measured after `base` tokens (budget.py). alpha: seconds per cached token for a request's first row (its cache read
once); beta: for each more row of that request (the same keys scored again, mostly arithmetic once they are read).
In a batch each request reads its own cache: r requests' first rows cost alpha each, the rest beta.

Why it matters: the curve measured after a short prefix priced 8 verify rows at 8k tokens on a 2-core Zen 4 as if
each extra row added ~2% of a forward, where each added ~3.7 ms of attention to a ~38 ms forward: the planner kept
drafting on document questions and decoded at 0.81x plain decoding ("Long prompts on a CPU without AMX").

Both numbers are measured once per machine beside the curve (`measure_slopes`: the same forwards after a long
cached prefix, the cache's contents left as zeros, since cost does not depend on them) and fitted to the slopes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

LONG_PREFIX = 2048  # cached tokens of the second measurement: its attention is well above the timing noise
SLOPE_ROWS = (1, 2, 4, 8, 16)  # the row counts measured at both lengths


@dataclass(frozen=True)
class ContextCost:
    alpha: float  # seconds per cached token, a request's first row
    beta: float  # seconds per cached token, each more row of the same request
    base: int  # cached tokens where the cost curve was measured (nothing is added up to there)

    def seconds(self, rows: int, cached: int, requests: int = 1) -> float:
        """What `cached` tokens add to a forward over `rows` rows of `requests` requests, each with that many."""
        extra = cached - self.base
        if extra <= 0 or rows <= 0:
            return 0.0
        first = min(rows, requests)
        return extra * (self.alpha * first + self.beta * (rows - first))

    def to_dict(self) -> dict:
        return {"alpha": self.alpha, "beta": self.beta, "base": self.base}

    @staticmethod
    def from_dict(saved: dict) -> ContextCost | None:
        """The saved model, or None when it is missing or damaged (then it is measured again)."""
        try:
            alpha, beta, base = float(saved["alpha"]), float(saved["beta"]), int(saved["base"])
        except (KeyError, TypeError, ValueError):
            return None
        ok = all(x == x and 0.0 <= x < 1.0 for x in (alpha, beta)) and base >= 0  # x == x: not NaN
        return ContextCost(alpha, beta, base) if ok else None


def fit(slopes: dict[int, float], base: int) -> ContextCost:
    """alpha + beta (m - 1) through the measured seconds per cached token at each row count m (least squares, both
    kept >= 0: a noisy measurement must not make more context look free or cheaper)."""
    ms = sorted(slopes)
    if len(ms) == 1:
        return ContextCost(max(slopes[ms[0]], 0.0), 0.0, base)
    xs, ys = [m - 1 for m in ms], [slopes[m] for m in ms]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    beta = max(sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread, 0.0)
    alpha = mean_y - beta * mean_x
    if alpha < 0.0:  # the line through the origin instead
        alpha, beta = 0.0, max(sum(x * y for x, y in zip(xs, ys)) / max(sum(x * x for x in xs), 1e-12), 0.0)
    return ContextCost(alpha, beta, base)


@torch.inference_mode()
def measure_slopes(target: torch.nn.Module, short: dict[int, float], base: int, repeats: int = 5,
                   long_prefix: int = LONG_PREFIX) -> ContextCost:
    """The same decode-mode forwards as the cost curve's (`short`: rows -> seconds after `base` cached tokens), after
    `long_prefix` cached tokens instead, each row count's fastest of `repeats` in turns -> the fitted model."""
    from specdecode.models.masks import chain_mask

    device = target.device
    rows = [m for m in SLOPE_ROWS if m in short]
    cache = target.new_cache(1, long_prefix + max(rows))
    ids = torch.arange(max(rows), device=device)[None] * 7919 % target.config.vocab_size
    best = dict.fromkeys(rows, float("inf"))
    for _ in range(repeats):
        for m in rows:
            cache.truncate(long_prefix)  # zeros stand for the prompt: a forward's cost is blind to the values
            start = time.perf_counter()
            target(ids[:, :m], torch.arange(long_prefix, long_prefix + m, device=device)[None], cache,
                   chain_mask(long_prefix, m, device), decode=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            best[m] = min(best[m], time.perf_counter() - start)
    return fit({m: (best[m] - short[m]) / (long_prefix - base) for m in rows}, base)
