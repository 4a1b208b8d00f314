"""A model's decode forwards over 1, 2, 4 and 8 rows with the sizes taking turns: median wall time and median time
of each stage of the native layers, per size.

`profile_step.py` times each size in a block of its own, with bandwidth reads beside it; on a machine whose read
rate drifts by tens of percent between minutes, a block can land in a fast or a slow spell and the ratio between
sizes moves with it. Here every round runs every size once, so a spell hits all sizes alike: what a verify row
adds to a forward, and in which stage, is read off medians of the same minutes. Odd rounds are timed, even rounds
profiled (the stage timers cost a little of their own).

    python scripts/forward_stages.py                                  # the default target, 10 rounds
    python scripts/forward_stages.py --model qwen2.5-coder-0.5b-instruct --sizes 1,4 --rounds 16
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from specdecode.kernels import cpu_kernels
from specdecode.weights.loading import load_model
from specdecode.models.masks import chain_mask


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--sizes", default="1,2,4,8", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=10)
    args = ap.parse_args()
    kernels = cpu_kernels()
    model, _ = load_model(args.model, torch.float32, weights="stored")
    longest = max(args.sizes)
    cache = model.new_cache(1, args.context + longest)
    ids = torch.arange(args.context + longest)[None] * 7919 % model.config.vocab_size  # cost is data-blind

    def forward(rows: int, profiled: bool) -> tuple[float, dict[str, float]]:
        cache.truncate(args.context)
        if profiled:
            kernels.set_layer_profiling(True)
        began = time.perf_counter()
        model(ids[:, args.context : args.context + rows], torch.arange(args.context, args.context + rows)[None],
              cache, chain_mask(args.context, rows), decode=True)
        wall = time.perf_counter() - began
        if not profiled:
            return wall, {}
        stages = dict(kernels.layer_profile())
        kernels.set_layer_profiling(False)
        stages.pop("calls")
        return wall, stages

    walls: dict[int, list[float]] = defaultdict(list)
    stages: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    with torch.inference_mode():
        model(ids[:, : args.context], torch.arange(args.context)[None], cache, chain_mask(0, args.context),
              logits_from=args.context - 1)
        for rows in args.sizes * 2:  # warm-up
            forward(rows, False)
        for round_ in range(2 * args.rounds):
            for rows in args.sizes:
                wall, split = forward(rows, profiled=round_ % 2 == 1)
                if split:
                    for name, seconds in split.items():
                        stages[rows][name].append(seconds * 1e3)
                else:
                    walls[rows].append(wall * 1e3)
    # stages a layer no longer runs apart (SiLU and the residual adds inside the team's units) time zero: left out
    names = [n for n in stages[args.sizes[0]] if any(statistics.median(stages[r][n]) > 0 for r in args.sizes)]
    one = statistics.median(walls[args.sizes[0]])
    print(f"{args.model}, {args.rounds} rounds, sizes taking turns; ms, medians")
    print("| rows | forward | vs first size | " + " | ".join(names) + " |")
    print("|---:|---:|---:|" + "---:|" * len(names))
    for rows in args.sizes:
        ms = statistics.median(walls[rows])
        print(f"| {rows} | {ms:.1f} | {ms / one:.2f}x | "
              + " | ".join(f"{statistics.median(stages[rows][n]):.2f}" for n in names) + " |")


if __name__ == "__main__":
    main()
