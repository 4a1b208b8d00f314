"""One of the native kernels' run-time switches on against off, A/B in one process. The switches give the same
bits either way; only speed changes:

- `team` (kernels.set_team): a decode forward's layers in one parallel region, helpers reading the next weights
  ahead (team_cpu.h), against one parallel region per group of linear layers;
- `guided_units` (kernels.set_guided_units): a linear layer's units in guided chunks against one fixed share per
  thread (kernels.h, run_units);
- `amx` (kernels.set_amx): AMX tile products for Q4_K and Q6_K rows where the CPU has them, against VNNI.

Both models are loaded once; each round times decode forwards of the draft model and the target at 1, 4 and 8
rows after a 300-token context, with the switch on and then off (the order alternating by round), best of three
forwards each. The two models alternate as in speculation, so each reads its weights from memory, not from a
cache the other left warm. Printed per model and size: the median time each way and the median (and quartiles)
of the per-round ratios.

    python scripts/ab_kernel_switch.py --switch team --rounds 12
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode import SpecDecoder
from specdecode.kernels import cpu_kernels
from specdecode.models.parts import chain_part

CONTEXT = 300
SWITCHES = ("team", "guided_units", "amx")


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
    ap.add_argument("--switch", default="team", choices=SWITCHES)
    args = ap.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("no native CPU kernels on this machine: nothing to compare")
    switch = getattr(kernels, f"set_{args.switch}")
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
                        for on in (True, False) if r % 2 == 0 else (False, True):
                            switch(on)
                            best = min(timed_forward(model, caches[name], rows) for _ in range(3))
                            times.setdefault((name, rows, on), []).append(best)
        finally:
            switch(True)
    for name in models:
        for rows in sizes:
            on, off = times[(name, rows, True)], times[(name, rows, False)]
            ratios = sorted(a / b for a, b in zip(on, off))
            print(f"{name:6s} {rows} rows: {args.switch} on {1e3 * statistics.median(on):6.2f} ms, off "
                  f"{1e3 * statistics.median(off):6.2f} ms, on / off {statistics.median(ratios):.3f} "
                  f"(quartiles {ratios[len(ratios) // 4]:.3f}-{ratios[3 * len(ratios) // 4]:.3f})")


if __name__ == "__main__":
    main()
