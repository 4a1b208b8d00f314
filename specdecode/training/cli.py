"""`specdecode train eagle | medusa | draft`: one data pipeline, one feature cache, three kinds of drafter.

    data files -> examples (loss on what the target writes) -> sample within --max-tokens, a split held back
    -> [--regenerate: the target writes the answers] -> the target's features and top-k, cached on disk
    -> train the head (or the LoRA draft) -> a folder: config.json (names its target) + weights, and a report
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from specdecode.errors import SpecdecodeError

KINDS = {
    "eagle": "an EAGLE head: one layer over the target's features, drafts trees (--method eagle --draft DIR)",
    "medusa": "Medusa heads on the target's last hidden state (--method medusa --draft DIR)",
    "draft": "a LoRA adapter distilling the draft model toward the target (--method draft --draft-adapter DIR)",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    from specdecode.api import DEFAULT_DRAFT, DEFAULT_TARGET

    train = sub.add_parser("train", help="train a drafter on your own data (EAGLE head, Medusa heads, LoRA draft)")
    kinds = train.add_subparsers(dest="kind", required=True)
    for kind, help_text in KINDS.items():
        p = kinds.add_parser(kind, help=help_text, description=help_text)
        p.add_argument("--target", default=DEFAULT_TARGET, help="the model the drafter will serve")
        if kind == "draft":
            p.add_argument("--draft", default=DEFAULT_DRAFT, help="the draft model to fine-tune (same tokenizer)")
        p.add_argument("--data", nargs="+", required=True, metavar="FILE_OR_GLOB",
                       help="JSONL (messages / prompt+response / text), or text and source files")
        p.add_argument("--out", required=True, help="folder to write the trained drafter to")
        p.add_argument("--max-tokens", type=int, default=200_000, help="training tokens to sample from the data")
        p.add_argument("--max-len", type=int, default=1024, help="longest example (tokens); longer ones are cut")
        p.add_argument("--time-budget", type=float, default=None, metavar="MINUTES",
                       help="stop training after this long (the drafter is saved as it is then)")
        p.add_argument("--epochs", type=float, default=2.0 if kind != "draft" else 1.0)
        p.add_argument("--lr", type=float, default=None, help="learning rate (default: the kind's)")
        p.add_argument("--regenerate", action="store_true",
                       help="let the target write the answers itself (best acceptance; slow on a CPU)")
        p.add_argument("--cache", default=None,
                       help="feature cache folder (default: under ~/.cache/specdecode/training; shared by kinds)")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--device", default="cpu", help="cpu or cuda")
        p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
        p.add_argument("--weights", default="auto", choices=["auto", "stored", "float"],
                       help="the target's form, as it will run: the features are computed in it")
        if kind == "eagle":
            p.add_argument("--steps", type=int, default=3, help="draft steps unrolled in training")
            p.add_argument("--intermediate-size", type=int, default=2048, help="the head's MLP width")
        if kind == "medusa":
            p.add_argument("--heads", type=int, default=4, help="tokens ahead, one head each")
        if kind in ("eagle", "medusa"):
            p.add_argument("--draft-vocab", type=int, default=16384, help="tokens the head can propose")
        if kind == "draft":
            p.add_argument("--rank", type=int, default=16, help="LoRA rank")
            p.add_argument("--merge", default=None, metavar="DIR",
                           help="also write the draft with the adapter merged in, as an HF folder")
        p.set_defaults(func=cmd_train)


def cmd_train(args: argparse.Namespace) -> int:
    from specdecode.training import pipeline

    for name in ("max_tokens", "max_len"):
        if getattr(args, name) <= 0:
            raise SpecdecodeError(f"--{name.replace('_', '-')} must be positive")
    if args.time_budget is not None and args.time_budget <= 0:
        raise SpecdecodeError("--time-budget must be positive (minutes)")
    if args.epochs <= 0:
        raise SpecdecodeError("--epochs must be positive")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise SpecdecodeError(f"--out {out} is a file; give a folder")
    started = time.perf_counter()
    report = pipeline.run(args)
    minutes = (time.perf_counter() - started) / 60
    positions = " ".join(f"{p:.2f}" for p in report.get("acceptance_per_position", []))
    print(f"\n{args.kind} drafter written to {out} in {minutes:.1f} min")
    print(f"held-back split: acceptance per draft position {positions}; expected mean accepted length "
          f"{report.get('mean_accepted_length', 0):.2f} ({report.get('rows', 0)} positions)")
    return 0
