"""What a frequent-token LM head saves the draft model: ms per one-token forward, full head vs a subset.

Loads the draft as the library does (`plan_load` with the default target, weights as stored, float32
activations), times the decode step (best of several runs, each a mean over steps at a fixed position after a
prompt) with the full head, then restricts the head (vocab_subset.py) and times it again.

    python scripts/head_subset.py --size 32768 --threads 2
    python scripts/head_subset.py --corpus ../shared/data/train/*.jsonl   # subset counted on a corpus

With `--corpus` it also prints how much of the corpus's tokens each subset covers (merge rank and counted):
a draft can only propose tokens inside its subset.
"""

from __future__ import annotations

import argparse
import time

import torch

from specdecode.api import DEFAULT_DRAFT, DEFAULT_TARGET
from specdecode.weights.loading import load_model, plan_load
from specdecode.models.masks import chain_mask
from specdecode.weights.quantize import QuantLinear
from specdecode.weights.vocab_subset import (by_merge_rank, count_tokens, frequent_tokens, load_or_build, restrict_lm_head,
                                     stored_head, subset_path, texts_from_jsonl)  # fmt: skip
from specdecode.weights.files import resolve_source

PROMPT = 200  # cached positions before the timed step, as in verify_cost.py


def step_ms(model, cache, runs: int, steps: int) -> float:
    """Best over `runs` of the mean time of `steps` one-token decode forwards at position PROMPT."""
    token, pos, mask = torch.tensor([[1000]]), torch.tensor([[PROMPT]]), chain_mask(PROMPT, 1)
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(steps):
            cache.truncate(PROMPT)
            model(token, pos, cache, mask, decode=True)
        best = min(best, (time.perf_counter() - start) / steps)
    return best * 1000


def head_ms(model, runs: int, steps: int) -> float:
    hidden = torch.randn(1, 1, model.config.hidden_size)
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        for _ in range(steps):
            model.lm_head(hidden)
        best = min(best, (time.perf_counter() - start) / steps)
    return best * 1000


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--target", default=DEFAULT_TARGET, help="decides the load plan, as in SpecDecoder.load")
    ap.add_argument("--size", type=int, default=32768)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--corpus", nargs="*", default=[], help="jsonl files: count the subset on them")
    ap.add_argument("--limit", type=int, default=None, help="records of the corpus to read")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    plan = plan_load(args.target, args.draft)
    model, tokenizer = load_model(args.draft, plan.dtype, "cpu", plan.draft_quantize, plan.draft_weights)
    vocab, source = model.config.vocab_size, resolve_source(args.draft)
    always = sorted({*tokenizer.added_tokens_decoder, *tokenizer.all_special_ids})  # EOS, chat markers, FIM
    subset = load_or_build(subset_path(source, args.size, "merge-rank"),
                           lambda: by_merge_rank(vocab, args.size, always))  # fmt: skip
    if args.corpus:
        counts = count_tokens(tokenizer, texts_from_jsonl(args.corpus, args.limit), vocab)  # seconds: not cached
        counted = frequent_tokens(counts, args.size, always)
        total = counts.sum().item()
        for name, ids in (("merge rank", subset), ("corpus counts", counted)):
            print(f"{name}: {ids.numel()} ids cover {counts[ids].sum().item() / total:.2%} of {total} corpus tokens")
        subset = counted

    print(f"{args.draft}: {plan.describe()}, {torch.get_num_threads()} threads, best of {args.runs} x {args.steps}")
    cache = model.new_cache(1, PROMPT + 8)
    with torch.inference_mode():
        model(torch.randint(0, 1000, (1, PROMPT)), torch.arange(PROMPT)[None], cache, chain_mask(0, PROMPT))
        rows = []
        for label in (f"full head ({vocab})", f"subset head ({subset.numel()})"):
            if rows:  # the second row: the same model, head restricted
                head = model.lm_head
                stored = stored_head(source) if isinstance(head, QuantLinear) and head.packed is None else None
                restrict_lm_head(model, subset, stored)
            step_ms(model, cache, 1, args.steps)  # warm-up
            rows.append((label, step_ms(model, cache, args.runs, args.steps), head_ms(model, args.runs, args.steps)))
    for label, step, head in rows:
        print(f"{label:>22}: {step:6.2f} ms per token (head alone {head:5.2f} ms)")
    print(f"speedup of the draft step: {rows[0][1] / rows[1][1]:.2f}x")


if __name__ == "__main__":
    main()
