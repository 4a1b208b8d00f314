"""What sampled decoding spends turning logits into probabilities and drawing tokens, per generated token: the
native kernels (sample_cpu.cpp) against torch's path, in one process, taking turns.

    python scripts/sampling_cost.py --methods none,draft,hybrid --rounds 2

Each round runs every method over the same dev prompts (2 HumanEval, 2 MT-Bench, 2 GSM8K by default), once with
the kernels and once with torch's path, and prints the seconds spent inside `to_probs` and `sample` per generated
token, beside tokens/s. The texts differ between the two paths (the draws read the uniform numbers differently), so
the tokens/s columns are noisier than the sampling times.
"""

from __future__ import annotations

import argparse
import importlib
import time
from pathlib import Path

import torch
from profile_step import DATA, prompts  # beside this script

from specdecode import SamplingParams, SpecDecoder, sampling
from specdecode.drafters import HybridDrafter, NoDrafter

CALLERS = ("specdecode.verify", "specdecode.engine.sequence", "specdecode.drafters.tree_growth")  # import to_probs, sample


class TorchPath:
    """The kernels, less the sampling ones: to_probs and sample then take torch's path."""

    def __init__(self, kernels) -> None:
        self.kernels = kernels

    def __getattr__(self, name: str):
        return getattr(self.kernels, name)

    def nucleus_probs(self, logits, temperature, top_p):
        return torch.empty(0)

    def draw_rows(self, weights, u):
        return torch.full((weights.shape[0],), -1, dtype=torch.long)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--methods", default="none,draft,hybrid")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--per-set", type=int, default=2)
    ap.add_argument("--data", type=Path, default=DATA)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--top-p", type=float, default=0.9)
    args = ap.parse_args()

    spent = [0.0]

    def timed(fn):
        def wrapper(*a, **kw):
            began = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[0] += time.perf_counter() - began
        return wrapper

    for name in CALLERS:
        module = importlib.import_module(name)
        for fn in ("to_probs", "sample"):
            if hasattr(module, fn):
                setattr(module, fn, timed(getattr(module, fn)))
    kernels = sampling.cpu_kernels
    sd = SpecDecoder.load(args.target, draft=args.draft, method="draft")
    model_drafter = sd.engine.drafter
    drafters = {"none": NoDrafter, "draft": model_drafter.fork, "hybrid": lambda: HybridDrafter(model_drafter.fork())}
    decoders = {m: sd.__class__(sd.engine.target, sd.tokenizer, drafters[m](), m, None, costs=sd.engine.costs)
                for m in args.methods.split(",")}
    texts = [text for _, text in prompts(args.per_set, args.data)]
    print("| round | path | method | ms a token sampling | tokens/s |\n|---:|---|---|---:|---:|")
    for r in range(args.rounds):
        for path in ("kernels", "torch") if r % 2 == 0 else ("torch", "kernels"):
            sampling.cpu_kernels = kernels if path == "kernels" else (lambda: TorchPath(kernels()))
            for method, decoder in decoders.items():
                spent[0], tokens, wall = 0.0, 0, 0.0
                for i, text in enumerate(texts):
                    params = SamplingParams(max_new_tokens=128, temperature=args.temperature, top_p=args.top_p,
                                            seed=i)
                    began = time.perf_counter()
                    tokens += len(decoder.generate(text, params, chat=True).token_ids)
                    wall += time.perf_counter() - began
                print(f"| {r + 1} | {path} | {method} | {spent[0] / tokens * 1e3:.2f} | {tokens / wall:.2f} |",
                      flush=True)
    sampling.cpu_kernels = kernels


if __name__ == "__main__":
    main()
