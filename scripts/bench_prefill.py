"""How fast the target reads a prompt (prefill, the time to the first token): our kernels with AMX tile products and
without, beside llama.cpp on the same file, prompts of several lengths, interleaved in one process.

    python scripts/bench_prefill.py --lengths 128,512,1024 --rounds 3 --llamacpp

A prompt goes in as the engine feeds it on the CPU: chunks of PREFILL_ROWS_IDLE decode rows, the logits of its
last token only. AMX runs the Q4_K and Q6_K layers' products on forwards of 48 rows or more where the CPU has it; the rows are
bit-identical either way (tests/test_blocks.py), so only the time differs. Prints tokens/s (median, min-max) per
length and setting, and the ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from verify_cost import prompt_ids  # noqa: E402  (beside this script)

from specdecode.engine.engine import PREFILL_ROWS_IDLE  # noqa: E402
from specdecode.kernels import cpu_kernels, cpu_model, prefetch_hint, simd_flags  # noqa: E402
from specdecode.weights.loading import load_model  # noqa: E402
from specdecode.models.parts import chain_part  # noqa: E402


def ours_seconds(model, ids: list[int]) -> float:
    """One prefill of `ids` from an empty cache, in the engine's chunks."""
    n = len(ids)
    cache = model.new_cache(1, n + 8)
    tokens = torch.tensor(ids)
    began = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, n, PREFILL_ROWS_IDLE):
            end = min(n, start + PREFILL_ROWS_IDLE)
            model.forward_parts([chain_part(tokens[start:end], cache, end - start - 1)])
            cache.length = end
    return time.perf_counter() - began


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--lengths", default="128,512,1024", help="prompt tokens, comma-separated")
    ap.add_argument("--rounds", type=int, default=3, help="times each setting reads each length")
    ap.add_argument("--llamacpp", action="store_true", help="also llama.cpp (pip install -e '.[llamacpp]')")
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]

    kernels = cpu_kernels()
    if kernels is None or not hasattr(kernels, "set_amx"):
        sys.exit("the native CPU kernels are not available here: nothing to compare")
    amx = kernels.amx_min_rows() > 0
    model, _ = load_model(args.model, torch.float32, weights="stored")
    settings = ["ours, AMX", "ours, VNNI"] if amx else ["ours"]
    llm = None
    if args.llamacpp:
        import llama_cpp

        from specdecode.weights.files import resolve_source

        llm = llama_cpp.Llama(str(resolve_source(args.model)), n_ctx=max(lengths) + 16,
                              n_threads=torch.get_num_threads(), n_threads_batch=torch.get_num_threads(),
                              verbose=False)  # fmt: skip
        settings.append("llama.cpp")

    def run(setting: str, ids: list[int]) -> float:
        if setting == "llama.cpp":
            llm.reset()
            began = time.perf_counter()
            llm.eval(ids)
            return time.perf_counter() - began
        kernels.set_amx(setting == "ours, AMX")
        return ours_seconds(model, ids)

    print(f"{cpu_model()} ({', '.join(simd_flags())}), {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"prefetch {prefetch_hint()}; {args.model}, {args.rounds} rounds, settings interleaved")
    prompts = {n: prompt_ids(args.model, n) for n in lengths}
    for setting in settings:  # warm-up: kernels built, pages touched
        run(setting, prompts[lengths[0]])
    seconds: dict[tuple[str, int], list[float]] = {}
    for r in range(args.rounds):
        for n in lengths:
            order = settings[r % len(settings):] + settings[: r % len(settings)]
            for setting in order:
                seconds.setdefault((setting, n), []).append(run(setting, prompts[n]))
    kernels.set_amx(True)

    def rate(setting: str, n: int) -> float:
        return n / statistics.median(seconds[setting, n])

    print("\n| prompt tokens | " + " | ".join(f"{s} tok/s (min-max)" for s in settings) + " | "
          + " | ".join(f"{settings[0]} / {s}" for s in settings[1:]) + " |")
    print("|---:|" + "---|" * len(settings) + "---:|" * (len(settings) - 1))
    for n in lengths:
        cells = [f"{rate(s, n):.0f} ({n / max(seconds[s, n]):.0f}-{n / min(seconds[s, n]):.0f})" for s in settings]
        ratios = [f"{rate(settings[0], n) / rate(s, n):.2f}x" for s in settings[1:]]
        print(f"| {n} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()
