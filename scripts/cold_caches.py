"""What a forward's streamed weights cost the work after it: small calls on caches the forward has flushed.

A decode forward reads ~1 GB of weights through the caches, and whatever runs next finds its own code and data
gone. This script measures, in one process:

1. **Small calls, hot and after a 1 GB read** (the kernels' streaming read, as a forward reads its weights): the
   native argmax of one 152k-wide row of logits, and a loop of 300 dict lookups in Python.
2. **The draft model's forwards in use** (`--method draft`, the dev prompts): each draft forward's wall time by its
   place in the step (the first runs right after the target's forward) and its rows (2: the step's catching up
   feeds the last accepted token too), against the same one-row forward looped alone and after a 1 GB read.

    python scripts/cold_caches.py
    python scripts/cold_caches.py --prompts 1 --skip-engine    # the small calls only
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from profile_step import prompts

from specdecode import SamplingParams, SpecDecoder
from specdecode.kernels import cpu_kernels
from specdecode.models.parts import chain_part
from specdecode.sampling import greedy_tokens


def median_us(call, before=lambda: None, repeats: int = 30) -> float:
    """Median microseconds of `call()`, `before()` run (untimed) ahead of each."""
    times = []
    for _ in range(repeats):
        before()
        began = time.perf_counter()
        call()
        times.append(time.perf_counter() - began)
    return 1e6 * statistics.median(times)


def small_calls(flush) -> None:
    logits = torch.randn(1, 151936)
    table = {i: i for i in range(1000)}

    def lookups() -> None:
        total = 0
        for i in range(300):
            total += table[i]

    for name, call in (("argmax of a 152k row (native)", lambda: greedy_tokens(logits)),
                       ("300 dict lookups (Python)", lookups)):
        print(f"{name}: hot {median_us(call):.1f} us, after a 1 GB read {median_us(call, flush):.1f} us")


def draft_forwards(args, flush) -> None:
    sd = SpecDecoder.load(args.target, draft=args.draft, method="draft")
    target, draft = sd.engine.target, sd.engine.drafter.forward_model
    place = [0]
    times: dict[tuple[int, int], list[float]] = defaultdict(list)
    target_forward, draft_forward = target.forward_parts, draft.forward_parts

    def timed_target(parts, *a, **k):
        place[0] = 0
        return target_forward(parts, *a, **k)

    def timed_draft(parts, *a, **k):
        began = time.perf_counter()
        out = draft_forward(parts, *a, **k)
        rows = sum(getattr(p, "count", None) or p.tokens.numel() for p in parts)  # older checkouts: no count
        if rows <= 4:  # a prompt's feed is not a step's forward
            times[(place[0], rows)].append(time.perf_counter() - began)
        place[0] += 1
        return out

    target.forward_parts, draft.forward_parts = timed_target, timed_draft
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    for _, text in prompts(args.prompts, skip=args.prompts):  # warm-up on other prompts of the same sets
        sd.generate(text, params, chat=True)
    times.clear()
    for _, text in prompts(args.prompts):
        sd.generate(text, params, chat=True)
    print("draft forwards in use (method draft), ms:")
    for (at, rows), seconds in sorted(times.items()):
        if len(seconds) >= 5:
            print(f"  forward {at + 1} of its step, {rows} row(s): median {1e3 * statistics.median(seconds):.2f} "
                  f"over {len(seconds)}")
    cache = draft.new_cache(1, 512)
    with torch.inference_mode():
        draft_forward([chain_part(torch.full((300,), 100), cache, 299, True)])  # a 300-token context
        cache.truncate(300)

        def one_row() -> None:
            draft_forward([chain_part(torch.tensor([5]), cache, 0, True)])
            cache.truncate(300)

        print(f"  one row after 300 tokens, looped alone: {median_us(one_row) / 1e3:.2f}; after a 1 GB read: "
              f"{median_us(one_row, flush, repeats=15) / 1e3:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per dev set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--skip-engine", action="store_true", help="the small calls only")
    args = ap.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("cold_caches.py: specdecode's CPU kernels did not build on this machine")
    data = torch.ones(256 << 20)  # 1 GiB of float32
    kernels.read_seconds(data)  # its pages touched before any timing
    small_calls(lambda: kernels.read_seconds(data))
    if not args.skip_engine:
        draft_forwards(args, lambda: kernels.read_seconds(data))


if __name__ == "__main__":
    main()
