"""`specdecode bench`: run methods side by side on JSONL prompts; print a table, write JSON and plots.

    specdecode bench --dataset ../shared/data/humaneval_dev.jsonl --limit 6 --methods none,draft,ngram,hf \
        --json bench-results/run.json

Prompts are read before any model is loaded, so a bad file or method name fails in a second.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import torch

from specdecode.api import DEFAULT_DRAFT, DEFAULT_TARGET, SpecDecoder, verify_costs
from specdecode.atomic_files import recover_folder
from specdecode.bench.data import load_prompts
from specdecode.bench.harness import run_bench
from specdecode.bench.loaders import (
    TUNED_DRAFT,
    BenchModels,
    all_methods,
    build_runners,
    drafter_and_shape,
    load_models,
    needs_draft_model,
    num_draft_tokens,
    parse_methods,
    runner_is_ours,
    weights_bytes,
)  # fmt: skip
from specdecode.bench.machine import command_line, machine_info
from specdecode.bench.report import build_report, markdown
from specdecode.cli_args import add_sampling_args, add_weight_args, sampling_params
from specdecode.drafters import NoDrafter
from specdecode.errors import SpecdecodeError
from specdecode.methods import METHODS
from specdecode.models.prompt_cache import DEFAULT_PROMPT_CACHE_MB, check_size
from specdecode.weights.loading import LoadPlan, plan_load


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmark methods on JSONL prompts (Spec-Bench style)",
                       description="Run every method on the same prompts, interleaved, and report speed, "
                                   "acceptance and a token-by-token losslessness check. See docs/bench.md.")
    p.add_argument("--dataset", action="append", required=True, metavar="FILE",
                   help="JSONL prompts; rows with messages, turns, question or prompt (repeatable)")
    p.add_argument("--limit", type=int, default=None, help="use the first N rows of each dataset")
    p.add_argument("--methods", default=None,
                   help=f"comma-separated, from {', '.join(all_methods())}; none is always run (the baseline). "
                        "Default: all, the trained ones (eagle, hybrid-eagle, medusa, draft-lora) where their folders "
                        "are given")
    p.add_argument("--num-draft-tokens", type=int, default=None, help="k for every speculative method "
                   "(default: ours choose per step from the verify cost curve; the reference engines run a fixed k)")
    p.add_argument("--repeats", type=int, default=1, help="runs of each prompt per method")
    p.add_argument("--json", metavar="FILE", help="write the results here, and PNG plots next to it")
    p.add_argument("--target", default=DEFAULT_TARGET, help="packaged name, HF hub id, HF folder or .gguf file")
    p.add_argument("--draft", default=DEFAULT_DRAFT, help="draft model for draft, hybrid and hf-assisted")
    p.add_argument("--eagle", metavar="DIR",
                   help="the EAGLE head for methods eagle and hybrid-eagle (`specdecode train eagle`)")
    p.add_argument("--medusa", metavar="DIR", help="the Medusa heads for method medusa (`specdecode train medusa`)")
    p.add_argument("--draft-adapter", metavar="DIR",
                   help="the LoRA adapter for method draft-lora (`specdecode train draft`): the tuned draft beside "
                        "the untuned one")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    add_weight_args(p)
    p.add_argument("--max-len", type=int, default=8192, help="context window to allocate (tokens)")
    p.add_argument("--max-ngram", type=int, default=3, help="longest n-gram for ngram and hf-pld")
    p.add_argument("--prompt-cache-mb", type=float, default=DEFAULT_PROMPT_CACHE_MB, metavar="MB",
                   help="our methods reuse recent prompts' keys and values, as served; llama.cpp then reuses its "
                        "last context's common prefix, as llama-cpp-python does by default (0: every prompt "
                        "computed in full by every engine)")
    p.add_argument("--prompt-as-chat", action="store_true",
                   help="send `prompt` rows as a chat user message (default: raw completion prompts)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_sampling_args(p)
    p.set_defaults(func=cmd_bench)


def cmd_bench(args: argparse.Namespace) -> int:
    params = sampling_params(args)  # validate everything before the slow model loads
    check_size(args.prompt_cache_mb)  # a negative size fails here too
    methods = parse_methods(args.methods or ",".join(default_methods(args)))
    for name in ("limit", "repeats"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise SpecdecodeError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.num_draft_tokens is not None and args.num_draft_tokens < 0:
        raise SpecdecodeError(f"--num-draft-tokens must be >= 0, got {args.num_draft_tokens}")
    trained = trained_folders(args, methods)
    prompts = load_prompts(args.dataset, args.limit, args.prompt_as_chat)
    draft = args.draft if any(needs_draft_model(m) for m in methods if m != "hf-assisted") else None
    plan = plan_load(args.target, draft, args.dtype, args.device, args.quantize, args.draft_quantize, args.weights,
                     args.kv_dtype)
    print(f"bench: {len(prompts)} prompts, methods {', '.join(methods)}; {plan.describe()}; loading models...",
          file=sys.stderr)
    models = load_models(args.target, args.draft, methods, plan, args.device, args.draft_vocab,
                         args.draft_vocab_corpus, trained, args.draft_adapter)
    ours_auto = args.num_draft_tokens is None and any(runner_is_ours(m) for m in methods if m != "none")
    costs = verify_costs(models.target, args.target, plan, args.device) if ours_auto else None
    if costs is not None:
        print("bench: verify cost, relative to one token, for 1..16 tokens: "
              + " ".join(f"{r:.2f}" for r in costs.ratios()), file=sys.stderr)
    runners = build_runners(methods, models, args.num_draft_tokens, args.max_len, args.max_ngram, costs,
                            args.prompt_cache_mb)
    encoder = SpecDecoder(models.target, models.tokenizer, NoDrafter(), "none", 0, args.max_len)

    def decode(ids: list[int]) -> str:  # an answer as the next turn's history sees it
        return models.tokenizer.decode(ids, skip_special_tokens=True)

    runs = run_bench(prompts, runners, encoder.encode, decode, params, args.repeats, args.device,
                     progress=not args.no_progress)
    report = build_report(runs, method_facts(methods, models, runners, args.num_draft_tokens),
                          settings(args, methods, params.greedy, plan),
                          machine_info(args.device, command_line()), params.greedy,
                          None if costs is None else costs.to_dict())
    print(markdown(report))
    if args.json:
        write_outputs(report, Path(args.json))
    return 0


def head_folders(args: argparse.Namespace) -> dict[str, str | None]:
    """Each trained method -> the folder given for its kind of head (--eagle, --medusa), None if not given."""
    return {m.name: vars(args)[m.head] for m in METHODS.values() if m.head is not None}


def default_methods(args: argparse.Namespace) -> list[str]:
    """Every method, but a trained one only when its folder was given, and one a target may lack the layers of
    (mtp) only where it has them."""
    given = {**head_folders(args), TUNED_DRAFT: args.draft_adapter}

    target = getattr(args, "target", None)

    def offered(method: str) -> bool:
        how = METHODS.get(drafter_and_shape(method)[0])
        return how is None or how.offered is None or (target is not None and how.offered(target))

    return [m for m in all_methods()
            if given.get(m if m == TUNED_DRAFT else drafter_and_shape(m)[0], True) and offered(m)]


def trained_folders(args: argparse.Namespace, methods: list[str]) -> dict[str, str]:
    """eagle / hybrid-eagle / medusa -> the folder given for its head; a trained method without one is an error
    before any load."""
    folders = {}
    for method, folder in head_folders(args).items():
        if any(m == method or m.startswith(f"{method}-") for m in methods):
            kind = METHODS[method].head
            if folder:
                recover_folder(folder)  # a replacement a kill left halfway (atomic_files.py)
            if not folder or not Path(folder).is_dir():
                raise SpecdecodeError(f"method {method} needs --{kind} DIR: the folder `specdecode train {kind}` "
                                      "wrote" + (f" ('{folder}' is not a folder)" if folder else ""))
            folders[method] = folder
    if TUNED_DRAFT in methods and not args.draft_adapter:
        raise SpecdecodeError(f"method {TUNED_DRAFT} needs --draft-adapter DIR (`specdecode train draft`)")
    return folders


def method_facts(methods: list[str], models: BenchModels, runners: dict[str, Any],
                 override_k: int | None) -> dict[str, dict[str, Any]]:
    return {m: {"family": runners[m].family, "num_draft_tokens": num_draft_tokens(m, override_k) if m == "none"
                or num_draft_tokens(m, override_k) is not None else "auto",
                "weights_bytes": weights_bytes(m, models)} for m in methods}


def settings(args: argparse.Namespace, methods: list[str], greedy: bool, plan: LoadPlan) -> dict[str, Any]:
    cpu = not args.device.startswith("cuda")
    return {
        "datasets": list(args.dataset), "limit": args.limit, "methods": methods,
        "target": args.target, "draft": args.draft, "dtype": str(plan.dtype).removeprefix("torch."), "device": args.device,
        "max_new_tokens": args.max_new_tokens, "greedy": greedy, "temperature": args.temperature,
        "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed, "repeats": args.repeats,
        "num_draft_tokens": args.num_draft_tokens, "max_ngram": args.max_ngram, "max_len": args.max_len,
        "prompt_cache_mb": args.prompt_cache_mb,
        "prompt_as_chat": args.prompt_as_chat, "weights": plan.weights, "quantize": plan.quantize,
        "draft_weights": plan.draft_weights, "draft_quantize": plan.draft_quantize, "threads": torch.get_num_threads(),
        "draft_vocab": args.draft_vocab, "draft_vocab_corpus": args.draft_vocab_corpus,
        "eagle": args.eagle, "medusa": args.medusa, "draft_adapter": args.draft_adapter,
        "peak_memory": "process RSS high-water mark (ru_maxrss): process-wide, every loaded model included"
                       if cpu else "torch.cuda.max_memory_allocated, reset before each generation",
        "hf_ttft": "time until transformers' streamer receives the first generated token",
    }  # fmt: skip


def write_outputs(report: dict[str, Any], path: Path) -> None:
    """The report as JSON at `path`, and its plots beside it where matplotlib is installed (the `plots` extra)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1) + "\n")
    if importlib.util.find_spec("matplotlib") is None:
        print(f"wrote {path} (no plots: pip install 'specdecode[plots]' draws them)", file=sys.stderr)
        return
    from specdecode.bench.plots import write_plots  # matplotlib loads only when plots are written

    plots = write_plots(report, path)
    print(f"wrote {path}, {', '.join(str(p) for p in plots)}", file=sys.stderr)
