"""How much a forward over M tokens costs, per weight format: the curve that decides which drafters pay.

Speculation pays when verifying k+1 tokens costs little more than decoding one. Prints a markdown table of the
best-of-N time of one target forward (with a 200-token cache) for M = 1, 2, 4, 6, 8, per quantization mode.

    python scripts/verify_cost.py --model qwen2.5-coder-1.5b-instruct --modes none,int8,int4
"""

from __future__ import annotations

import argparse
import time

import torch

from specdecode.loading import load_model
from specdecode.masks import chain_mask


def forward_ms(model, cache, prefix: int, m: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        cache.truncate(prefix)
        ids = torch.randint(0, 1000, (1, m))
        start = time.perf_counter()
        model(ids, torch.arange(prefix, prefix + m)[None], cache, chain_mask(prefix, m), decode=True)
        best = min(best, time.perf_counter() - start)
    return best * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--modes", default="none,int8,int4")
    ap.add_argument("--sizes", default="1,2,4,6,8,10")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    print(f"model {args.model}, bfloat16 activations, {torch.get_num_threads()} threads, best of {args.repeats}")
    print("| weights | " + " | ".join(f"M={m}" for m in sizes) + " |")
    print("|---|" + "---|" * len(sizes))
    for mode in args.modes.split(","):
        model, _ = load_model(args.model, torch.bfloat16, quantize=mode)
        cache = model.new_cache(1, 512)
        with torch.inference_mode():
            prompt = torch.randint(0, 1000, (1, 200))
            model(prompt, torch.arange(200)[None], cache, chain_mask(0, 200))
            cache.truncate(200)
            times = [forward_ms(model, cache, 200, m, args.repeats) for m in sizes]
        print(f"| {'bf16' if mode == 'none' else mode} | " + " | ".join(f"{t:.0f} ms" for t in times) + " |")
        del model, cache


if __name__ == "__main__":
    main()
