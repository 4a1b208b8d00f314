"""Sweep the draft model's length cap k and confidence cut-off on dev prompts outside the bench set.

    python scripts/sweep_draft_length.py [--settings 4:0,8:0.5,...]   (k:min_confidence pairs)

Prompts: HumanEval/3-4 (raw), MT-Bench 91-92 turn 1 and GSM8K 3 (chat); 96 new tokens, greedy, default models.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specdecode import SamplingParams, SpecDecoder
from specdecode.drafters import DraftModelDrafter

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"
SETTINGS = [(4, 0.0), (6, 0.0), (6, 0.3), (5, 0.2), (8, 0.4), (8, 0.5), (8, 0.7), (10, 0.5), (12, 0.6)]


def rows(name: str, start: int, stop: int) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()[start:stop]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", default=",".join(f"{k}:{c}" for k, c in SETTINGS), help="k:min_confidence,...")
    settings = [(int(k), float(c)) for k, c in (pair.split(":") for pair in ap.parse_args().settings.split(","))]
    prompts = ([(r["prompt"], False) for r in rows("humaneval_dev.jsonl", 3, 5)]
               + [(r["turns"][0], True) for r in rows("mt_bench.jsonl", 10, 12)]
               + [(r["question"], True) for r in rows("gsm8k_dev.jsonl", 3, 4)])
    decoder = SpecDecoder.load(method="draft")
    drafter, vocab = decoder.engine.drafter, decoder.engine.target.config.vocab_size
    params = SamplingParams(max_new_tokens=96)
    decoder.generate(prompts[0][0], SamplingParams(max_new_tokens=8))  # warm-up
    for k, confidence in settings:
        decoder.engine.drafter = DraftModelDrafter(drafter.model, vocab_size=vocab, min_confidence=confidence,
                                                   head_tokens=drafter.head_tokens)
        tokens = seconds = 0.0
        lengths = []
        for text, chat in prompts:
            result = decoder.generate(text, params, chat=chat, num_draft_tokens=k)
            tokens += result.stats.new_tokens
            seconds += result.stats.wall_s
            lengths.append(result.stats.mean_accepted_length)
        print(f"k={k:2d} min_confidence={confidence:.1f}: {tokens / seconds:.2f} tok/s, "
              f"mean accepted length {sum(lengths) / len(lengths):.2f}", flush=True)


if __name__ == "__main__":
    main()
