"""The steps of `specdecode train` (training/cli.py), in order; each kind's own training lives in its module."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdecode.errors import SpecdecodeError
from specdecode.training import features as feature_cache
from specdecode.training.data import data_key, expand, read_examples, sample
from specdecode.weights import hub, store
from specdecode.weights.loading import load_model, plan_load

MIN_TRAIN_TOKENS = 1000  # below this a head learns the examples by heart and nothing else


def run(args: argparse.Namespace) -> dict:
    """-> the held-back report (also in the output folder's config.json)."""
    files = expand(args.data)
    plan = plan_load(args.target, None, args.dtype, args.device, "none", "auto", args.weights)
    print(f"loading target {args.target} ({plan.describe()})")
    target, tokenizer = load_model(args.target, plan.dtype, args.device, plan.quantize, plan.weights)
    if tokenizer is None:
        raise SpecdecodeError(f"{args.target} ships no tokenizer: training needs one to read the data")
    train, held = sample(read_examples(files, tokenizer, args.max_len), args.max_tokens, args.seed)
    tokens = sum(len(e.ids) for e in train)
    if tokens < MIN_TRAIN_TOKENS:
        raise SpecdecodeError(f"the data gave {tokens} training tokens: too few to learn from (at least "
                              f"{MIN_TRAIN_TOKENS}); add data")
    if tokens + sum(len(e.ids) for e in held) < args.max_tokens:
        print(f"note: the data holds fewer tokens than --max-tokens {args.max_tokens}: training on all of it",
              file=sys.stderr)
    print(f"data: {len(train)} training examples ({tokens} tokens), {len(held)} held back, from {len(files)} file(s)")
    layers = feature_cache.feature_layers(target.config.num_layers)
    settings = {"data": data_key(files), "max_tokens": args.max_tokens, "max_len": args.max_len, "seed": args.seed,
                "target": store.target_fingerprint(target), "form": plan.describe(), "device": args.device,
                "feature_layers": list(layers), "top_k": feature_cache.TOP_K, "regenerate": args.regenerate}
    root = Path(args.cache) if args.cache else hub.cache_dir() / "training"
    folder = feature_cache.cache_dir(root, settings)
    if args.regenerate:
        from specdecode.api import verify_costs
        from specdecode.training.regenerate import answers_log, regenerate

        train, held = regenerate(target, train, held, args.max_len, answers_log(root, settings),
                                 verify_costs(target, args.target, plan, args.device))
        tokens = sum(len(e.ids) for e in train)
    all_tokens = tokens + sum(len(e.ids) for e in held)
    feature_cache.check_memory(
        feature_cache.estimate_bytes(all_tokens, target.config.hidden_size, 1 + len(layers)),
        f"the target's features for {all_tokens} tokens")
    feats = feature_cache.build(target, train, held, folder, settings)
    meta = {"data": [str(f) for f in files], "train_tokens": tokens, "held_examples": len(held),
            "feature_cache": str(folder), "regenerated": args.regenerate}
    out = Path(args.out)
    if args.kind == "eagle":
        from specdecode.training import eagle

        head = eagle.new_head(target, feats, layers, args.draft_vocab, args.intermediate_size).to(args.device)
        log = eagle.train(head, target, feats, args.epochs, args.steps, args.lr or 1e-3, _seconds(args), args.seed)
        report = eagle.evaluate(head, target, feats, args.steps)
        store.save(out, "eagle", head.config.to_dict(), head.state_dict(), target, args.target,
                   {"feature_layers": list(layers), "training": {**meta, **log}, "report": report})
    elif args.kind == "medusa":
        from specdecode.training import medusa

        heads = medusa.new_heads(target, feats, args.heads, args.draft_vocab).to(args.device)
        log = medusa.train(heads, feats, args.epochs, args.lr or 1e-3, _seconds(args), args.seed)
        report = medusa.evaluate(heads, feats)
        store.save(out, "medusa", heads.config.to_dict(), heads.state_dict(), target, args.target,
                   {"training": {**meta, **log}, "report": report})
    else:
        from specdecode.training import lora

        report = lora.train_and_save(args, target, tokenizer, feats, plan, meta)
    print(json.dumps(report))
    return report


def _seconds(args: argparse.Namespace) -> float | None:
    return None if args.time_budget is None else args.time_budget * 60

