"""Guided against fixed shares of a linear layer's units, A/B in one process (kernels.h, run_units).

Both models are loaded once; each round times decode forwards of the draft model and the target at 1, 4 and 8
rows after a 300-token context, with the thread team taking a layer's 16-channel units in guided chunks and then
in one fixed share per thread (the order alternating by round), best of three forwards each. The two models
alternate as in speculation, so each reads its weights from memory, not from a cache the other left warm. Printed
per model and size: the median time each way and the median (and quartiles) of the per-round ratios.

    python scripts/ab_guided_units.py --rounds 12
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode import SpecDecoder
from specdecode.kernels import cpu_kernels
from specdecode.model import chain_part

CONTEXT = 300


def timed_forward(model, cache, rows: int) -> float:
    began = time.perf_counter()
    model.forward_parts([chain_part(torch.arange(500, 500 + rows), cache, rows - 1, True)])
    took = time.perf_counter() - began
    cache.truncate(CONTEXT)  # the rows' keys and values are dropped: every forward sees the same context
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--rows", default="1,4,8")
    args = ap.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("no native CPU kernels on this machine: nothing to compare")
    sd = SpecDecoder.load(args.target, draft=args.draft, method="draft")
    models = {"draft": sd.engine.drafter.forward_model, "target": sd.engine.target}
    sizes = [int(r) for r in args.rows.split(",")]
    times: dict[tuple[str, int, bool], list[float]] = {}
    with torch.inference_mode():
        caches = {}
        for name, model in models.items():
            cache = model.new_cache(1, CONTEXT + max(sizes) + 8)
            model.forward_parts([chain_part(torch.arange(100, 100 + CONTEXT), cache, CONTEXT - 1, True)])
            cache.truncate(CONTEXT)
            caches[name] = cache
        try:
            for r in range(args.rounds):
                for rows in sizes:
                    for name, model in models.items():
                        for guided in (True, False) if r % 2 == 0 else (False, True):
                            kernels.set_guided_units(guided)
                            best = min(timed_forward(model, caches[name], rows) for _ in range(3))
                            times.setdefault((name, rows, guided), []).append(best)
        finally:
            kernels.set_guided_units(True)
    for name in models:
        for rows in sizes:
            guided, fixed = times[(name, rows, True)], times[(name, rows, False)]
            ratios = sorted(a / b for a, b in zip(guided, fixed))
            print(f"{name:6s} {rows} rows: guided {1e3 * statistics.median(guided):6.2f} ms, fixed "
                  f"{1e3 * statistics.median(fixed):6.2f} ms, guided / fixed {statistics.median(ratios):.3f} "
                  f"(quartiles {ratios[len(ratios) // 4]:.3f}-{ratios[3 * len(ratios) // 4]:.3f})")


if __name__ == "__main__":
    main()
