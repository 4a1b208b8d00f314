"""Count token frequencies on instruction data and write the packaged list a draft's LM head is cut to.

    python scripts/count_frequent_tokens.py --tokenizer qwen2.5-coder-0.5b-instruct \
        --corpus ../shared/data/train/*.jsonl --out specdecode/resources/frequent-tokens-qwen2.npz

The file holds the most frequent ids, most frequent first, and a fingerprint of the vocabulary they belong to
(vocab_subset.vocab_fingerprint), so a tokenizer with another vocabulary never uses them. Count on training data
only, never on an evaluation set.
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

from specdecode.weights import vocab_subset
from specdecode.weights.loading import load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", required=True, help="packaged name, HF id or folder whose tokenizer to use")
    ap.add_argument("--corpus", nargs="+", required=True, help="jsonl files of instruction data")
    ap.add_argument("--keep", type=int, default=49152, help="ids to keep, most frequent first")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tokenizer = load_tokenizer(args.tokenizer)
    vocab = len(tokenizer)
    counts = vocab_subset.count_tokens(tokenizer, vocab_subset.texts_from_jsonl(args.corpus), vocab)
    ranked = torch.sort(counts, descending=True, stable=True).indices[: args.keep]
    seen = int((counts > 0).sum())
    np.savez_compressed(args.out, ids=ranked.numpy().astype(np.uint32),
                        fingerprint=np.array(vocab_subset.vocab_fingerprint(tokenizer)),
                        tokens_counted=np.array(int(counts.sum())))
    print(f"{int(counts.sum()):,} tokens counted, {seen:,} distinct; kept {args.keep:,} ids -> {args.out}")


if __name__ == "__main__":
    main()
