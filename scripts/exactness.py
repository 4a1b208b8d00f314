"""Greedy exactness on real prompts: every method's tokens against plain decoding (`none`), same dtype.

For each mismatch it prints where the outputs diverge and the target's top-2 logit margin there under plain
decoding: a tiny margin means a genuine near-tie that a (k+1)-token verify forward rounded the other way; a large
one would be a bookkeeping bug.

    python scripts/exactness.py --dtype float32 --limit 4 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from specdecode import SamplingParams, SpecDecoder
from specdecode.api import DEFAULT_DRAFT, DEFAULT_NUM_DRAFT_TOKENS, DEFAULT_TARGET
from specdecode.drafters import DraftModelDrafter, NgramDrafter, NoDrafter
from specdecode.loading import load_model, resolve_dtype

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
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--limit", type=int, default=4, help="prompts per dev set")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    args = ap.parse_args()
    dtype = resolve_dtype(args.dtype)
    target, tok = load_model(args.target, dtype)
    draft, _ = load_model(args.draft, dtype)
    methods = {"draft": DraftModelDrafter(draft, vocab_size=target.config.vocab_size), "ngram": NgramDrafter()}
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    total = mismatches = 0
    print(f"target {args.target}, draft {args.draft}, dtype {args.dtype}, greedy, {args.max_new_tokens} new tokens")
    for name, prompt, chat in prompts(args.limit):
        margins: list[float] = []
        watch = record_margins(target, margins)  # only while decoding plainly
        plain = SpecDecoder(target, tok, NoDrafter(), "none", 0).generate(prompt, params, chat=chat).token_ids
        watch.remove()
        for method, drafter in methods.items():
            total += 1
            got = SpecDecoder(target, tok, drafter, method, DEFAULT_NUM_DRAFT_TOKENS[method]).generate(
                prompt, params, chat=chat).token_ids
            if got == plain:
                print(f"{name:14s} {method:6s} identical ({len(got)} tokens)")
                continue
            mismatches += 1
            pos = next((i for i, (a, b) in enumerate(zip(got, plain)) if a != b), min(len(got), len(plain)))
            print(f"{name:14s} {method:6s} DIFFERS at new token {pos}: plain top-2 margin {margins[pos]:.4f} "
                  f"(median margin {sorted(margins)[len(margins) // 2]:.2f})")
    print(f"{total - mismatches}/{total} outputs token-identical to plain decoding")


if __name__ == "__main__":
    main()
