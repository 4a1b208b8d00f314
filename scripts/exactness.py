"""Greedy exactness on real prompts: every method's tokens against plain decoding (`none`), same dtype.

For each mismatch it prints where the outputs diverge and the target's top-2 logit margin there under plain
decoding: a tiny margin means a genuine near-tie that a (k+1)-token verify forward rounded the other way; a large
one would be a bookkeeping bug.

    python scripts/exactness.py --weights stored --limit 4 --max-new-tokens 64
    python scripts/exactness.py --weights float --dtype bfloat16 --methods draft-tree,ngram-tree

Each method runs its default (automatic) draft size, chosen from this machine's verify cost curve.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from specdecode import SamplingParams, SpecDecoder
from specdecode.api import DEFAULT_DRAFT, DEFAULT_TARGET, verify_costs
from specdecode.bench.loaders import drafter_and_shape
from specdecode.drafters import NoDrafter
from specdecode.methods import build_drafter
from specdecode.weights.loading import load_models, plan_load

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def prompts(limit: int) -> list[tuple[str, object, bool]]:
    """(name, prompt, chat) from the dev sets: raw HumanEval completions and chat questions."""
    out = []
    for path, key, chat in [("humaneval_dev.jsonl", "prompt", False), ("mt_bench.jsonl", "turns", True),
                            ("gsm8k_dev.jsonl", "question", True)]:
        rows = [json.loads(line) for line in (DATA / path).read_text().splitlines()[:limit]]
        for i, row in enumerate(rows):
            text = row[key][0] if key == "turns" else row[key]
            out.append((f"{path.split('_')[0]}#{i}", text, chat))
    return out


def record_margins(model: torch.nn.Module, margins: list[float]):
    """Append the top-2 logit margin of the last row of every forward of `model` to `margins`; -> hook handle."""

    def hook(module, inputs, output) -> None:
        top = output[0][0, -1].topk(2).values
        margins.append(float(top[0] - top[1]))

    return model.register_forward_hook(hook)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--weights", default="auto", choices=["auto", "stored", "float"])
    ap.add_argument("--methods", default="draft-chain,draft-tree,ngram-chain,ngram-tree")
    ap.add_argument("--limit", type=int, default=4, help="prompts per dev set")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    plan = plan_load(args.target, args.draft, args.dtype, "cpu", weights=args.weights)
    models = load_models(args.target, args.draft, plan, "cpu")
    target, tok = models.target, models.tokenizer
    costs = verify_costs(target, args.target, plan, "cpu")
    methods = {}
    for method in args.methods.split(","):
        name, shape = drafter_and_shape(method)
        methods[method] = SpecDecoder(target, tok, build_drafter(name, models, shape), method, None, costs=costs)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    total = mismatches = 0
    seconds = {m: 0.0 for m in ["none", *methods]}
    tokens = {m: 0 for m in seconds}
    print(f"target {args.target}, draft {args.draft}, {plan.describe()}, greedy, {args.max_new_tokens} new tokens")
    print("verify cost / one token, m = 1..16: " + " ".join(f"{r:.2f}" for r in costs.ratios()))
    for name, prompt, chat in prompts(args.limit):
        margins: list[float] = []
        watch = record_margins(target, margins)  # only while decoding plainly
        start = time.perf_counter()
        plain = SpecDecoder(target, tok, NoDrafter(), "none", 0).generate(prompt, params, chat=chat).token_ids
        seconds["none"] += time.perf_counter() - start
        tokens["none"] += len(plain)
        watch.remove()
        for method, decoder in methods.items():
            total += 1
            start = time.perf_counter()
            out = decoder.generate(prompt, params, chat=chat)
            seconds[method] += time.perf_counter() - start
            tokens[method] += len(out.token_ids)
            got, s = out.token_ids, out.stats
            facts = f"accepted len {s.mean_accepted_length:.2f}, nodes/step {s.nodes_per_step:.1f}"
            if got == plain:
                print(f"{name:14s} {method:12s} identical ({len(got)} tokens; {facts})")
                continue
            mismatches += 1
            pos = next((i for i, (a, b) in enumerate(zip(got, plain)) if a != b), min(len(got), len(plain)))
            print(f"{name:14s} {method:12s} DIFFERS at new token {pos}: plain top-2 margin {margins[pos]:.4f} "
                  f"(median margin {sorted(margins)[len(margins) // 2]:.2f})")
    print(f"{total - mismatches}/{total} outputs token-identical to plain decoding")
    base = tokens["none"] / seconds["none"]
    print("tok/s: " + ", ".join(f"{m} {tokens[m] / seconds[m]:.1f} ({tokens[m] / seconds[m] / base:.2f}x)"
                                for m in seconds))


if __name__ == "__main__":
    main()
