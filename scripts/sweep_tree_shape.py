"""Compare draft-model tree shapes side by side: children per node (width) and nodes fed per depth (expand).

    python scripts/sweep_tree_shape.py --shapes 1:1,3:1,4:1,3:3 --per-set 5

Prompts: the first --per-set rows of GSM8K dev and MT-Bench (chat) and HumanEval dev (raw), 128 new tokens,
greedy, the default models with the draft head cut as `SpecDecoder.load` cuts it, every shape on every prompt in
turn (interleaved, so a slow spell of the machine hits them all). Draft size: automatic (the cost curve).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from specdecode import SamplingParams, SpecDecoder
from specdecode.drafters import DraftModelDrafter

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def prompts(per_set: int) -> list[tuple[str, bool]]:
    def rows(name: str) -> list[dict]:
        return [json.loads(line) for line in (DATA / name).read_text().splitlines()[:per_set]]

    return ([(r["question"], True) for r in rows("gsm8k_dev.jsonl")] + [(r["turns"][0], True) for r in rows("mt_bench.jsonl")]
            + [(r["prompt"], False) for r in rows("humaneval_dev.jsonl")])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="1:1,3:1,4:1,3:3", help="width:expand pairs; 1:1 is a chain")
    ap.add_argument("--per-set", type=int, default=5)
    args = ap.parse_args()
    shapes = [tuple(int(x) for x in pair.split(":")) for pair in args.shapes.split(",")]
    base = SpecDecoder.load(method="draft")
    engine = base.engine
    decoders = {}
    for width, expand in shapes:
        drafter = DraftModelDrafter(engine.drafter.model, vocab_size=engine.target.config.vocab_size,
                                    width=width, expand=expand, head_tokens=engine.drafter.head_tokens)
        decoders[width, expand] = SpecDecoder(engine.target, base.tokenizer, drafter, "draft", None,
                                              costs=engine.costs)
    totals = {shape: [0, 0.0, 0, 0] for shape in shapes}  # tokens, seconds, target forwards, drafted tokens
    for text, chat in prompts(args.per_set):
        for shape, decoder in decoders.items():
            start = time.perf_counter()
            out = decoder.generate(text, SamplingParams(max_new_tokens=128), chat=chat)
            total = totals[shape]
            total[0] += len(out.token_ids)
            total[1] += time.perf_counter() - start
            total[2] += out.stats.target_forwards
            total[3] += out.stats.drafted_tokens
    count = 3 * args.per_set
    for (width, expand), (tokens, seconds, forwards, drafted) in totals.items():
        print(f"width {width} expand {expand}: {tokens / seconds:.1f} tok/s, mean accepted length "
              f"{(tokens - count) / forwards:.2f}, draft tokens verified per step {drafted / forwards:.2f}")


if __name__ == "__main__":
    main()
