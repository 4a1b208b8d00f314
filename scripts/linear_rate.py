"""How fast one model's linear layers run at 1 to 64 activation rows: multiply-adds and weight bytes per second.

A verify forward's extra rows are bound either by the weights' read (their bytes, whatever the rows) or by the
integer arithmetic of the rows (multiply-adds, growing with them). This times each kind of linear layer of the
decoder (q, k, v, o, gate, up, down; one line per block format and shape) over `--rows` rows two ways: `hot`, the
first layer's weights again and again (they stay in the caches); `in turn`, the same projection of every layer
one after another (the weights of all of them, from memory where they outgrow the last-level cache). Where
the two agree at several rows, the rows' arithmetic sets the time, not the memory.

    python scripts/linear_rate.py                                   # the default target, 1/4/8/16/64 rows
    python scripts/linear_rate.py --model qwen2.5-coder-0.5b-instruct --rows 1,8 --threads 1

BENCHMARKS.md ("Where the AVX2 kernels' compute goes") has the rate of the AVX2 tile's bare instruction stream to
set the several-row figures against.
"""

from __future__ import annotations

import argparse
import time

import torch

from specdecode.kernels import cpu_model, simd_flags
from specdecode.weights.loading import load_model

PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
               "mlp.up_proj", "mlp.down_proj")


def seconds_per_call(modules: list, x: torch.Tensor, repeats: int) -> float:
    """Best of `repeats` passes over `modules` (one call each), per call."""
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        for module in modules:
            module(x)
        best = min(best, (time.perf_counter() - began) / len(modules))
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--rows", default="1,4,8,16,64", type=lambda s: [int(r) for r in s.split(",")])
    ap.add_argument("--threads", type=int, default=None, help="default: torch's")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = load_model(args.model, torch.float32, weights="stored")
    layers = model.model.layers
    print(f"{cpu_model()} ({', '.join(simd_flags())}), {torch.get_num_threads()} threads, {args.model}")
    print("| projection | format | K x N | all layers' MB | rows | hot G MAC/s | in turn G MAC/s | in turn GB/s |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    seen = set()
    with torch.inference_mode():
        for name in PROJECTIONS:
            modules = [layer.get_submodule(name) for layer in layers]
            first = modules[0]
            fmt = getattr(getattr(first, "format", None), "name", type(first).__name__)
            shape = (fmt, first.in_features, first.out_features)
            if shape in seen:  # up has gate's format and shape (and o often q's): timed once
                continue
            seen.add(shape)
            weight_bytes = first.weight_bytes
            for rows in args.rows:
                x = torch.randn(rows, first.in_features)
                macs = rows * first.in_features * first.out_features
                hot = seconds_per_call([first] * len(modules), x, args.repeats)
                in_turn = seconds_per_call(modules, x, args.repeats)
                print(f"| {name.split('.')[-1]} | {fmt} | {first.in_features} x {first.out_features} | "
                      f"{weight_bytes * len(modules) / 1e6:.0f} | {rows} | {macs / hot / 1e9:.1f} | "
                      f"{macs / in_turn / 1e9:.1f} | {weight_bytes / in_turn / 1e9:.1f} |")


if __name__ == "__main__":
    main()
