"""The float-weight linear kernels alone, by rows: bfloat16 tiles (AMX) against the float kernel (vector units).

    python scripts/float_linears.py --rows 1,2,4,8,16,32,64

Times the four linear shapes of the 1.5B target (q/o 1536x1536, k/v 256x1536, gate/up 8960x1536, down 1536x8960),
`--copies` of each so the weights (~60 MB a copy in 16 bits) do not stay in the caches, and prints each kernel's
best of `--repeats` passes in ms and the GB/s of weights it streamed. The same random weights and inputs for every
kernel; the tiles' layout is repacked once before timing, as the model does at load.
"""

from __future__ import annotations

import argparse
import time

import torch

from specdecode.kernels import cpu_kernels, cpu_model, simd_flags
from specdecode.weights.quantize import bf16_tiles

SHAPES = [(1536, 1536), (256, 1536), (8960, 1536), (1536, 8960)]  # (outputs, inputs)


def best_seconds(run, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - began)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="1,2,4,8,16,32,64", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--copies", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("the native CPU kernels are not available here")
    print(f"{cpu_model()} ({', '.join(simd_flags())}), {torch.get_num_threads()} threads, torch {torch.__version__}")
    torch.manual_seed(0)
    weights = [torch.randn(n, k).to(torch.bfloat16) for n, k in SHAPES for _ in range(args.copies)]
    halves = [w.to(torch.float16) for w in weights]
    tiles = [bf16_tiles(w) for w in weights] if kernels.bf16_tiles_on() else []
    gb = sum(w.numel() * 2 for w in weights) / 1e9
    none = torch.empty(0)
    kinds = {"bfloat16 tiles (AMX)": lambda x: [kernels.linear_bf16_tiles(x[t.shape[1] * 32], t, none) for t in tiles],
             "bfloat16, vector units": lambda x: [kernels.linear_bf16(x[w.shape[1]], w) for w in weights],
             "float16, vector units": lambda x: [kernels.linear_f16(x[w.shape[1]], w) for w in halves]}
    if not tiles:
        del kinds["bfloat16 tiles (AMX)"]
    print(f"\n{len(weights)} layers, {gb * 1e3:.0f} MB of 16-bit weights; ms per pass (GB/s)\n")
    print("| rows | " + " | ".join(kinds) + " |")
    print("|---:|" + "---:|" * len(kinds))
    for rows in args.rows:
        x = {k: torch.randn(rows, k) for k in {k for _, k in SHAPES}}
        cells = []
        for run in kinds.values():
            seconds = best_seconds(lambda run=run, x=x: run(x), args.repeats)
            cells.append(f"{seconds * 1e3:.1f} ({gb / seconds:.1f})")
        print(f"| {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
