"""`specdecode advise`: which drafter pays on your prompts and this machine, measured, as the command to run.

    specdecode advise --data my_prompts.jsonl --time-budget 300
    specdecode advise --dataset ../shared/data/mt_bench.jsonl --draft smollm2-135m-instruct

Candidates by default: plain decoding (the baseline), prompt lookup, suffix decoding, and for every draft model
(each pulled packaged model of the target's family, and each --draft, any tokenizer) `draft` and `hybrid`
over it; each --head folder (`specdecode train`) as its kind. They run on a shuffled sample of the prompts, one
prompt at a time, every candidate in turn, until the time budget is spent (advise/measure.py); the table, the
advice and the exact `generate` / `serve` lines follow (advise/recommend.py), and a JSON file keeps it all.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

from specdecode.advise.measure import measure
from specdecode.advise.prompts import prompts_from_data
from specdecode.advise.recommend import advice, summaries, table
from specdecode.drafters.mtp import ships_mtp
from specdecode.errors import SpecdecodeError
from specdecode.methods import METHODS, heads

MIN_BUDGET_S = 30  # a warm-up per candidate and one prompt each: less measures nothing


def add_parser(sub: argparse._SubParsersAction) -> None:
    from specdecode.api import DEFAULT_TARGET
    from specdecode.cli_args import add_sampling_args, add_weight_args

    p = sub.add_parser("advise", help="measure which drafter pays on your prompts, and print the command to run",
                       description="Measure candidate drafters on your own prompts on this machine, within a time "
                                   "budget, and recommend one (or plain decoding) as generate/serve command lines. "
                                   "See docs/which-drafter.md.")
    data = p.add_mutually_exclusive_group(required=True)
    data.add_argument("--data", nargs="+", metavar="FILE_OR_GLOB",
                      help="your prompts, in any format `specdecode train` reads (JSONL messages, prompt/response "
                           "or text; other files as raw text)")
    data.add_argument("--dataset", action="append", metavar="FILE",
                      help="JSONL prompts as `specdecode bench` reads them (repeatable)")
    p.add_argument("--target", default=DEFAULT_TARGET, help="packaged name, HF hub id, HF folder or .gguf file")
    p.add_argument("--draft", action="append", default=[], metavar="MODEL",
                   help="a draft model to try, any tokenizer (repeatable; pulled packaged drafts of the target's "
                        "family are tried anyway)")
    p.add_argument("--head", action="append", default=[], metavar="DIR",
                   help="a trained EAGLE or Medusa folder (`specdecode train`) to try (repeatable)")
    p.add_argument("--candidates", default=None, metavar="LIST",
                   help="exactly these, comma-separated, as `specdecode bench --methods` names them (e.g. "
                        "none,ngram,draft@smollm2-135m-instruct)")
    p.add_argument("--time-budget", type=float, default=300, metavar="SECONDS",
                   help="measuring stops before the next prompt would pass it (default 300; models load first)")
    p.add_argument("--json", default="advice.json", metavar="FILE", help="where the measurements go")
    p.add_argument("--seed-prompts", type=int, default=0, metavar="N", help="shuffle of the prompts sampled")
    p.add_argument("--max-len", type=int, default=8192, help="context window to allocate (tokens)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    add_weight_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_advise)


def cmd_advise(args: argparse.Namespace) -> int:
    from specdecode.bench.data import load_prompts
    from specdecode.cli_args import sampling_params

    params = sampling_params(args)
    if args.time_budget < MIN_BUDGET_S:
        raise SpecdecodeError(f"--time-budget {args.time_budget:g} s is too short to measure anything: give at "
                              f"least {MIN_BUDGET_S} (a warm-up per candidate and one prompt each)")
    prompts = prompts_from_data(args.data) if args.data else load_prompts(args.dataset)
    random.Random(args.seed_prompts).shuffle(prompts)
    candidates = candidate_list(args)
    print(f"advise: {len(prompts)} prompts, candidates {', '.join(candidates)}; loading models...", file=sys.stderr)
    models, runners = load_candidates(args, candidates)
    facts = {name: dict(facts, **extra_memory(name, models, runners)) for name, facts in candidates.items()}
    encode = encoder(models.target, models.tokenizer, args.max_len)

    def decode(ids: list[int]) -> str:
        return models.tokenizer.decode(ids, skip_special_tokens=True)

    measured = measure(prompts, runners, encode, decode, params, args.time_budget, models.target.device,
                       progress=not args.no_progress)
    if not measured.runs:
        raise SpecdecodeError("stopped before every candidate finished one prompt: nothing measured")
    results = summaries(measured.runs, facts)
    advised = advice(results, args.target)
    report(results, advised, measured, args)
    if note := float_weights_note(models.target):
        print(note)
    return 130 if measured.interrupted else 0


def candidate_list(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Candidate name (as `bench --methods` spells it) -> {"method", "draft"}: what its command line runs."""
    from specdecode.bench.loaders import parse_methods, with_draft

    if args.candidates:
        names = parse_methods(args.candidates)
        return {n: {"method": with_draft(n)[0], "draft": with_draft(n)[1]} for n in names}
    advised = [m for m in METHODS.values() if m.advised]
    out: dict[str, dict[str, Any]] = {m.name: {"method": m.name, "draft": None} for m in advised
                                      if not m.needs_draft_model}
    for draft in dict.fromkeys(same_family_drafts(args.target) + args.draft):
        for method in advised:
            if method.needs_draft_model:
                out[f"{method.name}@{draft}"] = {"method": method.name, "draft": draft}
    for folder in args.head:
        kind = _head_kind(folder)
        out[kind] = {"method": kind, "draft": folder}
    if (mtp := ships_mtp(args.target)) is True:  # the checkpoint's own drafter
        out["mtp"] = {"method": "mtp", "draft": None}
    elif mtp is False:
        print(f"specdecode advise: {args.target} was saved without its multi-token-prediction layers (no `mtp.*` "
              "tensors or `nextn` block), so --method mtp is not tried", file=sys.stderr)
    return out


def _head_kind(folder: str) -> str:
    from specdecode.weights.store import read_meta

    kind = read_meta(folder).get("kind")
    if kind not in heads():
        raise SpecdecodeError(f"--head {folder}: holds a '{kind}' drafter, not a head a method runs "
                              f"({', '.join(sorted(heads()))})")
    return kind


def same_family_drafts(target: str) -> list[str]:
    """Pulled packaged models of a packaged target's family (one vocabulary), smaller than it."""
    from specdecode.weights import hub
    if target not in hub.REGISTRY:
        return []  # another model: its drafts are the ones given with --draft
    entry = hub.REGISTRY[target]
    return [info.name for info in hub.list_models() if info.pulled and info.size < entry.size
            and hub.REGISTRY[info.name].family == entry.family]


def load_candidates(args: argparse.Namespace, candidates: dict[str, dict[str, Any]]):
    from specdecode.api import DEFAULT_DRAFT, verify_costs
    from specdecode.bench.loaders import build_runners, head_of, load_models, needs_draft_model
    from specdecode.weights.loading import plan_load

    drafts = [c["draft"] or DEFAULT_DRAFT for c in candidates.values() if needs_draft_model(c["method"])]
    plan = plan_load(args.target, drafts[0] if drafts else None, args.dtype, args.device, args.quantize,
                     args.draft_quantize, args.weights, args.kv_dtype)
    trained = {c["method"]: c["draft"] for c in candidates.values() if head_of(c["method"]) is not None}
    models = load_models(args.target, DEFAULT_DRAFT, list(candidates), plan, args.device, args.draft_vocab,
                         args.draft_vocab_corpus, trained)
    costs = verify_costs(models.target, args.target, plan, args.device)
    return models, build_runners(list(candidates), models, None, args.max_len, 3, costs)


def extra_memory(name: str, models, runners) -> dict[str, int]:
    """What a candidate holds beyond the target: a draft's (or head's) weights, and its cache per token."""
    from specdecode.bench.loaders import weights_bytes

    drafter = runners[name].decoder.engine.drafter
    return {"extra_weights_bytes": weights_bytes(name, models) - weights_bytes("none", models),
            "extra_cache_bytes_per_token": drafter.needs.cache_bytes_per_token}


# Bytes a weight takes in the blocks --quantize writes (GGUF's: Q8_0 34 bytes per 32 weights, Q4_K 144 per 256)
BLOCK_BYTES_PER_WEIGHT = {"q8_0": 34 / 32, "q4_k": 144 / 256}


def float_weights_note(target) -> str | None:
    """What the same model in blocks would read a token, where the target's linear layers run in float: `--quantize`
    as an honest choice (fewer bytes a token, and the output is then the quantized model's)."""
    from specdecode.weights.quantize import KernelLinear

    layers = [m for m in target.modules() if isinstance(m, KernelLinear)]
    if not layers:
        return None
    read = sum(m.weight_bytes for m in layers)
    weights = sum(m.out_features * m.in_features for m in layers)
    first = layers[0]  # its tiles' dtype where it has them: `weight` would unpack them
    dtype = str(first.tiles.dtype if first.tiles is not None else first.weight.dtype).removeprefix("torch.")
    other = ", ".join(f"~{weights * b / 1e9:.2f} GB in {mode} (--quantize {mode}, ~{read / (weights * b):.1f}x the "
                      "plain decoding speed where memory bounds it)" for mode, b in BLOCK_BYTES_PER_WEIGHT.items())
    return (f"The target's linear layers read {read / 1e9:.2f} GB of {dtype} weights a token. The same model in "
            f"blocks reads {other}; its output is then the quantized model's, not this one's.")


def encoder(target, tokenizer, max_len: int):
    from specdecode.api import SpecDecoder
    from specdecode.drafters import NoDrafter

    return SpecDecoder(target, tokenizer, NoDrafter(), "none", 0, max_len).encode


def report(results: dict[str, dict[str, Any]], advised: dict[str, Any], measured, args: argparse.Namespace) -> None:
    from specdecode.bench.machine import command_line, machine_info

    prompts = results["none"]["prompts"]
    print(f"Measured on {prompts} prompts in {measured.seconds:.0f} s"
          + (" (interrupted: what was measured so far)" if measured.interrupted else "")
          + (f"; {measured.prompts_left} prompts left out by the time budget" if measured.prompts_left else "")
          + "\n")
    print(table(results) + "\n")
    verdict = "Use" if advised["pays"] else "No drafter pays here; use plain decoding"
    print(f"{verdict}: {advised['method']} ({advised['reason']})")
    print(f"  {advised['generate']}\n  {advised['serve']}")
    if advised.get("within_noise"):
        close = ", ".join(f"{m} ({results[m]['speedup_vs_none']:.2f}x)" for m in advised["within_noise"])
        print(f"  Within noise of it: {close}; a larger --time-budget separates them.")
    if prompts < 5:
        print(f"  (from {prompts} prompts only: a larger --time-budget gives a surer answer)")
    document = {"advice": advised, "candidates": results, "prompts_measured": prompts,
                "seconds": measured.seconds, "interrupted": measured.interrupted,
                "machine": machine_info(args.device, command_line())}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(document, indent=1) + "\n")
    print(f"wrote {args.json}", file=sys.stderr)
