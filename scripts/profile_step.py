"""Where a speculative step's time goes, measured against what the machine's memory allows.

Decoding is bound by the bytes read per token: a forward's floor is its weight bytes (and the KV cache it reads)
over the machine's read bandwidth. This script measures that bandwidth, then, in the same process:

1. **Forwards.** The target and the draft model (as it drafts: its LM head cut to frequent tokens) over 1, 4 and
   8 decode rows after a `--context`-token prompt: wall time per forward, split into the native decoder layer's
   stages (norms, q/k/v, rotary + cache writes, attention, o, gate/up, silu, down, residual adds; with the layers
   in one team region, kernels.set_team, SiLU runs inside gate/up and the residual adds inside o and down), the LM
   head and the rest (embedding, rotary tables, Python around the layers), with the bytes read and the share of
   the bandwidth floor reached. Also what one empty fork-join of the thread team costs, and how many a forward starts.
2. **Steps.** Whole generations with `--methods` (default draft, hybrid), each engine step's record as the engine
   hands it out (`Engine.on_step`, a StepInfo): its time up to the target forward (prompt chunks, the planner,
   drafting), the target forward, and after it (verification, caches kept, drafters' commits, finished requests);
   plus the text layer around the engine (the generations' wall time less their steps'), and the draft model's
   seconds per forward as its drafter keeps them (`Drafter.forward_s`, a running mean weighted to its latest
   draft forwards, read after each measured generation). No engine, planner or drafter method is wrapped for
   this, so a step's finer split (the draft model's forwards against the drafter's own code, the planner,
   bookkeeping) is not measured here.

    python scripts/profile_step.py                       # the default pair, 3 prompts, 128 new tokens each
    python scripts/profile_step.py --rows 1,4,8 --json bench-results/profile.json

Numbers are medians (forwards) or sums over the run (steps); the machine's bandwidth drifts by tens of percent
between minutes, which is why it is read beside every row of the forward table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

import torch

from specdecode import SamplingParams, SpecDecoder
from specdecode.kernels import cpu_kernels, cpu_model, prefetch_hint, simd_flags
from specdecode.models.kv_cache import bytes_per_token
from specdecode.models.masks import chain_mask
from specdecode.models.parts import Part  # not chain_part: the script also profiles checkouts from before it
from specdecode.weights.loading import load_model

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"


# --- the machine ---------------------------------------------------------------------------------------------


def read_bandwidth(gib: float = 0.5, repeats: int = 5) -> list[float]:
    """GB/s of reading `gib` GiB of float32 with the thread team, once per repeat: the kernels' own streaming read
    (kernels.read_seconds) where it exists, else a torch sum."""
    data = torch.ones(int(gib * 2**30) // 4)
    kernels = cpu_kernels()
    read = kernels.read_seconds if hasattr(kernels, "read_seconds") else _sum_seconds
    read(data)  # pages touched before timing
    return [data.numel() * 4 / read(data) / 1e9 for _ in range(repeats)]


def _sum_seconds(data: torch.Tensor) -> float:
    began = time.perf_counter()
    data.sum()
    return time.perf_counter() - began


# --- forwards ------------------------------------------------------------------------------------------------


def linear_bytes(module: torch.nn.Module) -> int:
    """Bytes a linear layer reads per forward: its weight as it runs (blocks, or float)."""
    if hasattr(module, "weight_bytes"):
        return int(module.weight_bytes)
    weight = getattr(module, "weight", None)
    return 0 if weight is None else weight.numel() * weight.element_size()


def linear_macs(module: torch.nn.Module) -> int:
    """Multiply-adds a linear layer does per row: its outputs times its inputs."""
    if hasattr(module, "out_features"):  # the kernels' layers say their shape (a weight may be in blocks or tiles)
        return int(module.out_features * module.in_features)
    weight = getattr(module, "weight", None)
    return 0 if weight is None else weight.numel()


def model_macs(model: torch.nn.Module) -> int:
    """Multiply-adds of the linear layers and the LM head per row (attention aside)."""
    layers = sum(linear_macs(m) for m in model.model.layers.modules() if m is not model.model.layers
                 and hasattr(m, "op"))
    return layers + linear_macs(model.lm_head)


def model_bytes(model: torch.nn.Module, context: int, rows: int) -> dict[str, int]:
    """Bytes one forward over `rows` tokens after `context` reads: layers' weights, LM head, KV cache."""
    layers = sum(linear_bytes(m) for m in model.model.layers.modules() if m is not model.model.layers
                 and hasattr(m, "op"))
    kv = bytes_per_token(model) * (context + rows)  # in the cache's dtype
    return {"layers": layers, "lm_head": linear_bytes(model.lm_head), "kv_cache": kv}


def time_forward(model: torch.nn.Module, context: int, rows: int, repeats: int) -> tuple[list[float], dict]:
    """-> (seconds per forward, repeats of it; the native layers' stage seconds per forward, LM head included)."""
    kernels = cpu_kernels()
    cache = model.new_cache(1, context + rows + 8)
    prompt = torch.randint(0, 1000, (context,))
    model.forward_parts([Part(prompt, torch.arange(context), cache, chain_mask(0, context), context - 1)])
    ids = torch.randint(0, 1000, (rows,))
    part = Part(ids, torch.arange(context, context + rows), cache, chain_mask(context, rows))
    lm_head = model.lm_head

    def forward() -> float:
        cache.truncate(context)
        began = time.perf_counter()
        model.forward_parts([part])
        return time.perf_counter() - began

    for _ in range(3):
        forward()
    times = [forward() for _ in range(repeats)]
    # The LM head timed where it runs, after the layers (alone, a draft's 31 MB head stays in the L3 cache)
    head: list[float] = []
    plain_forward = lm_head.forward

    def timed_head(x: torch.Tensor) -> torch.Tensor:
        began = time.perf_counter()
        out = plain_forward(x)
        head.append(time.perf_counter() - began)
        return out

    lm_head.forward = timed_head
    profiling = hasattr(kernels, "set_layer_profiling")  # kernels of this version or later: the layers' stages
    if profiling:
        kernels.set_layer_profiling(True)
    try:
        for _ in range(repeats):
            forward()
    finally:
        del lm_head.forward
    split = {}
    if profiling:
        stages = dict(kernels.layer_profile())
        kernels.set_layer_profiling(False)
        calls = stages.pop("calls") / model.config.num_layers  # forwards profiled
        split = {name: seconds / calls for name, seconds in stages.items()}
    split["lm head"] = statistics.median(head)
    return times, split


def parallel_regions(model: torch.nn.Module, rows: int) -> int:
    """Fork-joins of the thread team one forward starts at least. With the layers in one team region
    (kernels.set_team, on by default): that region and the LM head's. Before it: one per group of linear layers
    that read one input, one per attention call with more than one unit of work, and the LM head's (more rows
    add the activations' quantization)."""
    if hasattr(cpu_kernels(), "set_team"):
        return 2
    c = model.config
    attention = 1 if c.num_kv_heads * rows > 1 else 0
    return c.num_layers * (4 + attention) + 1  # q k v together, o, gate up together, down


def forward_table(name: str, model: torch.nn.Module, args, region_s: float, sizes: list[int]) -> list[dict]:
    rows_out = []
    for rows in sizes:
        # the bandwidth read right before and right after these forwards: a shared machine's spells last minutes
        adjacent = read_bandwidth(repeats=3)
        times, split = time_forward(model, args.context, rows, args.repeats)
        adjacent += read_bandwidth(repeats=3)
        wall = statistics.median(times)
        layers = sum(v for k, v in split.items() if k != "lm head")
        split["rest" if layers else "all but the LM head"] = max(0.0, wall - layers - split["lm head"])
        nbytes = model_bytes(model, args.context, rows)
        regions = parallel_regions(model, rows)
        rows_out.append({"model": name, "rows": rows, "ms": wall * 1e3, "ms_min": min(times) * 1e3,
                         "ms_max": max(times) * 1e3, "mb_read": {k: v / 1e6 for k, v in nbytes.items()},
                         "bytes": sum(nbytes.values()), "regions": regions, "bandwidth_gbs": adjacent,
                         "gflops": 2 * model_macs(model) * rows / wall / 1e9,
                         "regions_ms": regions * region_s * 1e3, "split_ms": {k: v * 1e3 for k, v in split.items()}})
    return rows_out


def llamacpp_one_token(args) -> dict[str, float]:
    """llama.cpp's one-token forward of the same files (its whole LM head) after a 200-token context: ms, best of
    the repeats (scripts/verify_cost.py times it so)."""
    from verify_cost import llamacpp_row  # beside this script

    return {name: llamacpp_row(model, [1], args.repeats, 0)[0][0]
            for name, model in (("target", args.target), ("draft (plain decoder)", args.draft))}


def in_blocks(model) -> bool:
    """Whether a model's linear layers run on the integer kernels (weights in blocks)."""
    from specdecode.weights.quantize import QuantLinear

    return any(isinstance(m, QuantLinear) for m in model.modules())


def _share(gflops: float, peak: float) -> str:
    return f" ({100 * gflops / peak:.0f}%)" if peak else ""


def print_forwards(rows: list[dict], llamacpp: dict[str, float] | None = None, peak: float = 0.0) -> None:
    """`peak`: the peak of the target's weights' kernels in G(FL)OP/s: int8 dot products for blocks, bfloat16
    tiles for bfloat16 weights (0: none here)."""
    print("\n### Forwards (median of the repeats; floor = bytes read / the best bandwidth read beside the row)\n")
    stages = list(dict.fromkeys(stage for r in rows for stage in r["split_ms"]))
    print("| model | rows | ms (min-max) | MB read (layers + head + KV) | GB/s beside | floor ms | share of floor | "
          "linear GFLOP/s (share of the kernels' peak) | " + " | ".join(stages) + " | fork-joins (ms if empty) |")
    print("|---|---:|---|---|---:|---:|---:|---:|" + "---:|" * len(stages) + "---:|")
    for r in rows:
        mb = r["mb_read"]
        print(f"| {r['model']} | {r['rows']} | {r['ms']:.2f} ({r['ms_min']:.2f}-{r['ms_max']:.2f}) | "
              f"{mb['layers']:.0f} + {mb['lm_head']:.0f} + {mb['kv_cache']:.0f} | {max(r['bandwidth_gbs']):.0f} | "
              f"{r['floor_ms']:.2f} | "
              f"{100 * r['share_of_floor']:.0f}% | {r['gflops']:.0f}{_share(r['gflops'], peak)} | " + " | ".join(f"{r['split_ms'][s]:.2f}" if s in r["split_ms"] else "-" for s in stages)
              + f" | {r['regions']} ({r['regions_ms']:.2f}) |")
    for name, ms in (llamacpp or {}).items():
        ours = next((r for r in rows if r["model"] == name and r["rows"] == 1), None)
        if ours is None:  # that model was not profiled (no drafter in the methods run)
            print(f"\nllama.cpp, {name}, one token: {ms:.2f} ms best of the repeats")
            continue
        print(f"\nllama.cpp, {name}, one token: {ms:.2f} ms best of the repeats, {100 * ours['floor_ms'] / ms:.0f}% "
              f"of the floor (ours best {ours['ms_min']:.2f} ms: {ms / ours['ms_min']:.2f}x llama.cpp's speed)")


# --- steps ---------------------------------------------------------------------------------------------------


def prompts(limit: int, data: Path = DATA, skip: int = 0) -> list[tuple[str, str]]:
    """(set, text) of `limit` prompts of each dev set under `data` after its first `skip` (MT-Bench: the first
    turn)."""
    out = []
    for name in ("humaneval_dev.jsonl", "mt_bench.jsonl", "gsm8k_dev.jsonl"):
        path = data / name
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[skip : skip + limit]:
            row = json.loads(line)
            text = row.get("prompt") or row.get("question") or (row.get("turns") or [""])[0]
            out.append((name.split("_")[0].split(".")[0], text))
    return out or [("builtin", "Write a Python function that checks whether a string is a palindrome.")]


def step_profile(sd: SpecDecoder, args) -> dict:
    """Other prompts of the same sets to warm up (kernels, draft cache sizes), then these measured: warmed up on the
    measured prompts, the suffix drafter would copy their whole answers. Each engine step's record comes through
    `Engine.on_step`; the draft model's seconds per forward are the drafter's own running figure, read after each
    measured generation."""
    engine = sd.engine
    if not hasattr(engine, "on_step"):
        raise SystemExit("this checkout's engine reports no step records (Engine.on_step): no step profile")
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    texts = [text for _, text in prompts(args.prompts)]
    for _, text in prompts(args.prompts, skip=args.prompts):
        sd.generate(text, params, chat=True)
    records: list = []  # the StepInfo of each step
    tokens, wall, accepted, draft_forward = 0, 0.0, [], []
    before, engine.on_step = engine.on_step, records.append
    try:
        for text in texts:
            began = time.perf_counter()
            result = sd.generate(text, params, chat=True)
            wall += time.perf_counter() - began
            tokens += len(result.token_ids)
            accepted.append(result.stats.mean_accepted_length)
            draft_forward.append(engine.drafter.forward_s)  # a wrapper (hybrid) answers with its draft model's
    finally:
        engine.on_step = before
    seconds = {"drafting": sum(r.draft_s for r in records), "target forward": sum(r.forward_s for r in records),
               "verify + rest": sum(r.verify_s for r in records)}
    seconds["text + API"] = max(0.0, wall - sum(seconds.values()))
    draft_forward = [s for s in draft_forward if s > 0.0]  # none: a drafter without forwards of its own
    return {"wall_s": wall, "tokens": tokens, "steps": len(records),
            "prefill_steps": sum(r.prefill_rows > 0 for r in records),
            "draft_tokens": sum(sum(r.draft_tokens) for r in records),
            "mean_accepted_length": statistics.mean(accepted), "seconds": seconds,
            "draft_forward_ms": 1e3 * statistics.mean(draft_forward) if draft_forward else None,
            "records": [asdict(r) for r in records]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--rows", default="1,4,8", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--methods", default="draft,hybrid")
    ap.add_argument("--prompts", type=int, default=1, help="prompts per dev set for the step profile")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--llamacpp", action="store_true", help="also time llama.cpp's one-token forward of the same "
                    "files (needs llama-cpp-python: pip install -e '.[llamacpp]')")
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()

    flags = simd_flags()
    print(f"{cpu_model()} ({', '.join(flags)}), {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"kernel prefetch {prefetch_hint()}")
    bw = read_bandwidth()
    kernels = cpu_kernels()
    region_s = kernels.parallel_region_seconds(2000) if hasattr(kernels, "parallel_region_seconds") else 0.0
    print(f"one empty fork-join of the thread team {region_s * 1e6:.1f} us")
    # What a prompt's chunk (--rows 512) is measured against: the int8 dot-product peak for weights in blocks (the
    # integer kernels), the bfloat16 tile peak for bfloat16 weights where AMX runs them
    tiles = kernels.bf16_tile_peak_flops() / 1e9 if hasattr(kernels, "bf16_tile_peak_flops") else 0.0
    if tiles:
        print(f"bfloat16 AMX tile peak {tiles:.0f} GFLOP/s (back-to-back tile products, every thread)")
    int8 = kernels.int8_dot_peak_ops() / 1e9 if hasattr(kernels, "int8_dot_peak_ops") else 0.0
    if int8:
        print(f"int8 dot-product peak {int8:.0f} GOP/s (back-to-back u8 x s8 dot products, every thread)")
    report: dict = {"cpu": cpu_model(), "flags": flags, "threads": torch.get_num_threads(), "bandwidth_gbs": bw,
                    "fork_join_us": region_s * 1e6, "bf16_tile_peak_gflops": tiles, "int8_dot_peak_gops": int8,
                    "forwards": [], "steps": {}}
    peak = 0.0

    sd = None
    for method in args.methods.split(","):
        sd = SpecDecoder.load(args.target, draft=args.draft, method=method) if sd is None else sd.__class__(
            sd.engine.target, sd.tokenizer, _drafter(sd, method), method, None, costs=sd.engine.costs)
        if not report["forwards"]:
            models = [("target", sd.engine.target, args.rows)]
            draft_model = sd.engine.drafter.needs.forward_model
            if draft_model is not None:
                models.append(("draft (as drafter)", draft_model, args.rows))
                plain, _ = load_model(args.draft, torch.float32, weights="stored")  # its whole LM head
                models.append(("draft (plain decoder)", plain, [1]))
            for name, model, sizes in models:
                report["forwards"] += forward_table(name, model, args, region_s, sizes)
            peak = int8 if in_blocks(sd.engine.target) else tiles  # the target's weights' peak
            if args.llamacpp:
                report["llamacpp_ms"] = llamacpp_one_token(args)
            bw += read_bandwidth()
            for row in report["forwards"]:  # each row's floor at the best read beside it
                row["floor_ms"] = row["bytes"] / (max(row["bandwidth_gbs"]) * 1e9) * 1e3
                row["share_of_floor"] = row["floor_ms"] / row["ms"]
                bw += row["bandwidth_gbs"]
            print(f"read bandwidth {min(bw):.1f}-{max(bw):.1f} GB/s over the run ({len(bw)} reads of 0.5 GiB, "
                  "six beside each row of the table)")
            print_forwards(report["forwards"], report.get("llamacpp_ms"), peak)
        report["steps"][method] = step_profile(sd, args)
    print_steps(report["steps"])
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))


def _drafter(sd: SpecDecoder, method: str):
    """The same loaded draft model behind another method's drafter (no second load)."""
    from specdecode.drafters.hybrid import HybridDrafter

    drafter = sd.engine.drafter
    base = drafter.draft if isinstance(drafter, HybridDrafter) else drafter
    return HybridDrafter(base.fork()) if method == "hybrid" else base.fork()


def print_steps(steps: dict) -> None:
    print("\n### Steps (ms per step, summed over the run: each step's record from Engine.on_step)\n")
    categories = ["drafting", "target forward", "verify + rest", "text + API"]
    print("| method | steps | tokens | tok/s | " + " | ".join(categories) + " | all | draft model ms / forward |")
    print("|---|---:|---:|---:|" + "---:|" * (len(categories) + 2))
    for method, s in steps.items():
        seconds, n = s["seconds"], max(s["steps"], 1)
        draft = "-" if s["draft_forward_ms"] is None else f"{s['draft_forward_ms']:.2f}"
        print(f"| {method} | {s['steps']} | {s['tokens']} | {s['tokens'] / s['wall_s']:.1f} | "
              + " | ".join(f"{1e3 * seconds[c] / n:.2f}" for c in categories)
              + f" | {1e3 * s['wall_s'] / n:.2f} | {draft} |")


if __name__ == "__main__":
    main()
