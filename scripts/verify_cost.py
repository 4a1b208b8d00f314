"""How much a forward over M tokens costs, per weight form: the curve that decides which drafters pay.

Speculation pays when verifying k+1 tokens costs little more than decoding one. Prints a markdown table of the
best-of-N time of one target forward (decode path, after a 200-token prompt) for each M, per weight form, with
its ratio to M=1, and the prefill rate over a `--prefill`-token prompt.

    python scripts/verify_cost.py --model qwen2.5-coder-1.5b-instruct --forms stored,bf16 --sizes 1-16

Forms: `stored` (a GGUF file's blocks as they are, float32 activations), `bf16` / `float32` (de-quantized),
`q8_0` / `q4_k` (float weights written in blocks by --quantize), `llamacpp` (llama.cpp on the same GGUF file,
through llama-cpp-python: its own forward over M tokens, `Llama.eval`, after the same 200-token prompt).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from specdecode.models.masks import chain_mask
from specdecode.models.model import prompt_as_decode_rows
from specdecode.weights.loading import load_model

FORMS = {  # form -> (dtype, quantize, weights)
    "stored": (torch.float32, "none", "stored"),
    "bf16": (torch.bfloat16, "none", "float"),
    "float32": (torch.float32, "none", "float"),
    "q8_0": (torch.float32, "q8_0", "float"),
    "q4_k": (torch.float32, "q4_k", "float"),
}


def forward_ms(model, cache, prefix: int, m: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        cache.truncate(prefix)
        ids = torch.randint(0, 1000, (1, m))
        start = time.perf_counter()
        model(ids, torch.arange(prefix, prefix + m)[None], cache, chain_mask(prefix, m), decode=True)
        best = min(best, time.perf_counter() - start)
    return best * 1000


def prompt_ids(model: str, n: int) -> list[int]:
    """A real text of n tokens for the prefill rate (this script's own source, repeated): the same ids for both
    engines."""
    from specdecode.weights.loading import load_tokenizer

    text = Path(__file__).read_text()
    ids = load_tokenizer(model).encode(text)
    return (ids * (n // len(ids) + 1))[:n]


def prefill_tokens_per_s(model, ids: list[int], repeats: int) -> float:
    n = len(ids)
    cache = model.new_cache(1, n + 8)
    best = float("inf")
    for _ in range(repeats):
        cache.truncate(0)
        ids = torch.tensor([ids]) if isinstance(ids, list) else ids
        start = time.perf_counter()
        model(ids, torch.arange(n)[None], cache, chain_mask(0, n), logits_from=n - 1,
              decode=prompt_as_decode_rows(model))  # as the engines feed a prompt
        best = min(best, time.perf_counter() - start)
    return n / best


def llamacpp_row(model: str, sizes: list[int], repeats: int, prefill: int) -> tuple[list[float], float | None]:
    import llama_cpp

    from specdecode.weights.files import resolve_source

    llm = llama_cpp.Llama(str(resolve_source(model)), n_ctx=max(1024, prefill + 16), n_threads=torch.get_num_threads(),
                          n_threads_batch=torch.get_num_threads(), verbose=False)
    ids = torch.randint(0, 1000, (max(prefill, 200 + max(sizes)),)).tolist()
    times = []
    for m in sizes:
        best = float("inf")
        for _ in range(repeats):
            llm.reset()
            llm.eval(ids[:200])
            start = time.perf_counter()
            llm.eval(ids[200 : 200 + m])
            best = min(best, time.perf_counter() - start)
        times.append(best * 1000)
    rate = None
    if prefill:
        text = prompt_ids(model, prefill)
        best = float("inf")
        for _ in range(2):
            llm.reset()
            start = time.perf_counter()
            llm.eval(text)
            best = min(best, time.perf_counter() - start)
        rate = prefill / best
    return times, rate


def parse_sizes(text: str) -> list[int]:
    if "-" in text:
        low, high = text.split("-")
        return list(range(int(low), int(high) + 1))
    return [int(s) for s in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--forms", default="stored,bf16", help=f"comma-separated, from {', '.join(FORMS)}")
    ap.add_argument("--sizes", default="1-16", help="M values: '1,2,4,8' or a range '1-16'")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prefill", type=int, default=1000, help="prompt tokens for the prefill rate (0: skip)")
    args = ap.parse_args()
    sizes = parse_sizes(args.sizes)
    print(f"model {args.model}, {torch.get_num_threads()} threads, best of {args.repeats}; ms per forward "
          "(ratio to M=1)")
    print("| weights | " + " | ".join(f"M={m}" for m in sizes) + " | prefill tok/s |")
    print("|---|" + "---|" * (len(sizes) + 1))
    for form in args.forms.split(","):
        if form == "llamacpp":
            times, prefill = llamacpp_row(args.model, sizes, args.repeats, args.prefill)
            cells = [f"{t:.0f} ({t / times[0]:.2f}x)" for t in times]
            print(f"| {form} | " + " | ".join(cells) + (f" | {prefill:.0f} |" if prefill else " | - |"), flush=True)
            continue
        dtype, quantize, weights = FORMS[form]
        model, _ = load_model(args.model, dtype, quantize=quantize, weights=weights)
        cache = model.new_cache(1, 512)
        with torch.inference_mode():
            prompt = torch.randint(0, 1000, (1, 200))
            model(prompt, torch.arange(200)[None], cache, chain_mask(0, 200))
            cache.truncate(200)
            times = [forward_ms(model, cache, 200, m, args.repeats) for m in sizes]
            prefill = prefill_tokens_per_s(model, prompt_ids(args.model, args.prefill), 2) if args.prefill else None
        cells = [f"{t:.0f} ({t / times[0]:.2f}x)" for t in times]
        print(f"| {form} | " + " | ".join(cells) + (f" | {prefill:.0f} |" if prefill else " | - |"), flush=True)
        del model, cache


if __name__ == "__main__":
    main()
