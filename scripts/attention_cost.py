"""What decode attention costs per layer: the native kernel over 1 to 8 query rows and a few context lengths, with
the cache read from memory (as in a forward, where every layer's weights pass through the caches between two
uses of a layer's keys and values) and hot.

A one-row step's attention is bound by reading the cache (its keys and values, float32); a verify forward's
extra rows by the multiply-adds, which the cache rows read once serve. Each call here is one layer's: every KV
head of it, the query heads that read it, the threads the kernels use. `cold` walks `--layers` layers' caches
in turn after reading a buffer larger than the last-level cache; `hot` repeats one layer.

    python scripts/attention_cost.py                                  # the 1.5B target's heads (12 / 2 of 128)
    python scripts/attention_cost.py --heads 14 --kv-heads 2 --dim 64 # the 0.5B draft's
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specdecode.kernels import cpu_kernels, cpu_model, simd_flags


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--rows", default="1,2,4,8", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--contexts", default="300,1000", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("the native CPU kernels need AVX2, FMA and a C++ compiler")
    flush = torch.ones(64 << 20)  # 256 MB: more than a last-level cache
    print(f"{cpu_model()} ({', '.join(simd_flags())}), {torch.get_num_threads()} threads; {args.heads} query heads, "
          f"{args.kv_heads} KV heads of {args.dim}; us per layer, medians of {args.repeats}")
    print("| context | rows | cold | hot |")
    print("|---:|---:|---:|---:|")
    for context in args.contexts:
        slots = context + max(args.rows)
        caches = [(torch.randn(1, args.kv_heads, slots, args.dim), torch.randn(1, args.kv_heads, slots, args.dim))
                  for _ in range(args.layers)]
        for rows in args.rows:
            q = torch.randn(1, args.heads, rows, args.dim)
            spans = [context + t + 1 for t in range(rows)]  # a chain of `rows` new tokens after the context
            cold, hot = [], []
            for _ in range(args.repeats):
                flush.add_(1.0)
                began = time.perf_counter()
                for k, v in caches:
                    kernels.decode_attention(q, k, v, spans, [])
                cold.append((time.perf_counter() - began) / args.layers)
                k, v = caches[0]
                began = time.perf_counter()
                for _ in range(args.layers):
                    kernels.decode_attention(q, k, v, spans, [])
                hot.append((time.perf_counter() - began) / args.layers)
            print(f"| {context} | {rows} | {statistics.median(cold) * 1e6:.1f} | {statistics.median(hot) * 1e6:.1f} |")


if __name__ == "__main__":
    main()
