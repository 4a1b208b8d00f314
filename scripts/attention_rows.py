"""Attention alone, as a forward of the default target runs it: 28 layers' caches of 12 query heads over 2 KV heads
of 128 (the 1.5B's shape), rows 1..8 over long contexts, each path the kernel has for the cache's dtype, in turns.

    python scripts/attention_rows.py                         # 1k, 4k and 8k cached tokens, 1/4/8 rows
    python scripts/attention_rows.py --cached 16000 --rows 1,8 --rounds 9

Every layer has its own cache (so a forward reads them from memory, as the real one does after its weights);
figures are the median milliseconds of a forward's 28 calls over the rounds, with the least and most. Paths: the
float32 cache; the bfloat16 cache on the float path (`SPECDECODE_BF16_DOTS=0`, `SPECDECODE_AMX=0`) and in BF16
dot products, or on AMX tiles, where the CPU has them. Threads: torch's (2 on the project's machines).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

LAYERS, HEADS, KV_HEADS, DIM = 28, 12, 2, 128


def forward_ms(kernels, q: torch.Tensor, caches: list[tuple[torch.Tensor, torch.Tensor]], spans: list[int]) -> float:
    began = time.perf_counter()
    for k, v in caches:
        kernels.decode_attention(q, k, v, spans)
    return (time.perf_counter() - began) * 1000


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cached", default="1000,4000,8000", help="cached tokens, comma-separated")
    p.add_argument("--rows", default="1,4,8", help="query rows a call (a verify forward's), comma-separated")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    from specdecode.kernels import cpu_flags, cpu_kernels

    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("attention_rows: the native CPU kernels are not available here (AVX2, FMA, a C++ compiler)")
    flags = set(cpu_flags())
    paths = [("float32", torch.float32, True), ("bfloat16, float path", torch.bfloat16, False)]
    if "amx_bf16" in flags:
        paths.append(("bfloat16, AMX tiles", torch.bfloat16, True))
    elif "avx512_bf16" in flags:
        paths.append(("bfloat16, BF16 dots", torch.bfloat16, True))
    print(f"threads {torch.get_num_threads()}; ms a forward's attention ({LAYERS} layers), median (least-most) of "
          f"{args.rounds} rounds", file=sys.stderr)
    print("| cached tokens | rows | " + " | ".join(name for name, _, _ in paths) + " |")
    print("|---:|---:|" + "---:|" * len(paths))
    torch.manual_seed(0)
    for cached in (int(c) for c in args.cached.split(",")):
        base = [(torch.randn(1, KV_HEADS, cached + 16, DIM), torch.randn(1, KV_HEADS, cached + 16, DIM))
                for _ in range(LAYERS)]
        by_dtype = {dtype: [(k.to(dtype), v.to(dtype)) for k, v in base] for dtype in {d for _, d, _ in paths}}
        del base
        for rows in (int(r) for r in args.rows.split(",")):
            q = torch.randn(1, HEADS, rows, DIM)
            spans = [cached + 1 + t for t in range(rows)]  # a chain of new tokens after the cached ones
            times: dict[str, list[float]] = {name: [] for name, _, _ in paths}
            for _ in range(args.rounds):  # the paths in turns, so a noisy spell falls on all of them
                for name, dtype, products in paths:  # products: bfloat16 products where the CPU has them
                    kernels.set_bf16_dots(products)
                    kernels.set_amx(products)
                    times[name].append(forward_ms(kernels, q, by_dtype[dtype], spans))
            kernels.set_bf16_dots(True)
            kernels.set_amx(True)
            cells = [f"{statistics.median(t):.2f} ({min(t):.2f}-{max(t):.2f})" for t in times.values()]
            print(f"| {cached:,} | {rows} | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
