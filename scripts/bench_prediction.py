"""Predicted Outputs on code edits: the original function as the prediction, side by side with plain decoding,
the default method without the prediction, and llama.cpp plain on the same GGUF file, in one run.

    python scripts/bench_prediction.py                      # 12 edits, Qwen2.5-Coder-1.5B, 2 rounds
    python scripts/bench_prediction.py --edits 6 --rounds 1 --json bench-results/prediction.json

The edit set is built here from the functions of Python's own standard library on this machine (ast, 8 to 30
lines each, a fixed choice): rename a parameter, add a keyword parameter, add type hints. Each is asked as a chat
message ("reply with the whole updated function in one code block"); the prediction is the original function in
such a block, as an editor plugin would send it. Systems run interleaved per edit, each round in a new order;
greedy, so every one of ours must give the same answer (checked): the prediction changes only the speed.
"""

from __future__ import annotations

import argparse
import ast
import json
import random
import statistics
import sys
import sysconfig
import time
from pathlib import Path

MODULES = ("textwrap", "shlex", "difflib", "fractions", "statistics", "calendar", "string", "heapq", "glob",
           "fnmatch", "colorsys", "base64", "quopri", "netrc", "gettext", "tabnanny", "filecmp", "sched")
KINDS = {
    "rename": "Rename the parameter `{param}` of this function to `{param}_value`, everywhere it is used.",
    "parameter": "Add a keyword parameter `verbose=False` to this function; when it is true, print the function's "
                 "name when it is called. Change nothing else.",
    "hints": "Add type hints to this function's parameters and return value. Change nothing else.",
}
ASK = "\n\nReply with the whole updated function in one ```python code block and nothing else.\n\n```python\n{src}\n```"


def edit_set(count: int) -> list[dict]:
    """`count` edits, spread over the kinds, from stdlib functions of 8-30 lines with a parameter."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    functions = []
    for name in MODULES:
        path = stdlib / f"{name}.py"
        if not path.is_file():
            continue
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        for node in ast.parse(source).body:
            if isinstance(node, ast.FunctionDef) and 8 <= node.end_lineno - node.lineno + 1 <= 30:
                params = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
                if params and not node.decorator_list:
                    functions.append((f"{name}.{node.name}", "\n".join(lines[node.lineno - 1 : node.end_lineno]),
                                      params[0]))
    random.Random(0).shuffle(functions)
    kinds = list(KINDS)
    edits = []
    for i, (where, src, param) in enumerate(functions[:count]):
        kind = kinds[i % len(kinds)]
        edits.append({"where": where, "kind": kind, "prompt": KINDS[kind].format(param=param) + ASK.format(src=src),
                      "prediction": f"```python\n{src}\n```"})
    return edits


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--edits", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-llamacpp", dest="llamacpp", action="store_false")
    p.add_argument("--systems", default=None, help="a comma-separated subset of: llama.cpp, none, hybrid, "
                   "none + prediction, hybrid + prediction (default: all; none is always run, as the baseline)")
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from specdecode import SamplingParams, SpecDecoder
    from specdecode.bench.llamacpp import LlamaCppRunner
    from specdecode.bench.machine import machine_info
    from specdecode.kernels import cpu_flags
    from specdecode.weights.files import resolve_source

    edits = edit_set(args.edits)
    none = SpecDecoder.load(args.target, method="none")
    hybrid = SpecDecoder.load(args.target, method="hybrid")
    ids = [none.encode(e["prompt"], chat=True) for e in edits]
    budgets = [len(none.encode_prediction(e["prediction"])) + 48 for e in edits]

    def ours(decoder, prediction: bool):
        def run(i: int) -> dict:
            params = SamplingParams(max_new_tokens=budgets[i])
            began = time.perf_counter()
            out = decoder.generate(ids[i], params, prediction=edits[i]["prediction"] if prediction else None)
            s = out.stats
            return {"tokens": len(out.token_ids), "seconds": time.perf_counter() - began, "ids": out.token_ids,
                    "ttft": s.ttft_s, "forwards": s.target_forwards,
                    "accepted_prediction": s.accepted_prediction_tokens,
                    "mean_accepted_length": s.mean_accepted_length}
        return run

    systems = {"none": ours(none, False), "hybrid": ours(hybrid, False), "none + prediction": ours(none, True),
               "hybrid + prediction": ours(hybrid, True)}
    if args.llamacpp and (not args.systems or "llama.cpp" in args.systems):
        llama = LlamaCppRunner(resolve_source(args.target), list(none.engine.eos), n_ctx=4096, threads=2)

        def plain_llama(i: int) -> dict:
            began = time.perf_counter()
            r = llama.run(ids[i], SamplingParams(max_new_tokens=budgets[i]))
            return {"tokens": len(r.token_ids), "seconds": time.perf_counter() - began, "ids": r.token_ids,
                    "ttft": r.ttft_s}

        systems = {"llama.cpp": plain_llama, **systems}
    if args.systems:
        chosen = {name.strip() for name in args.systems.split(",")} | {"none"}
        unknown = chosen - set(systems)
        if unknown:
            p.error(f"unknown systems {sorted(unknown)}: choose from {list(systems)}")
        systems = {name: run for name, run in systems.items() if name in chosen}
    for system in systems.values():  # warm-up: kernels, caches, cost curves
        system(0)
    rows: dict[str, list[list[dict]]] = {s: [[] for _ in edits] for s in systems}
    for r in range(args.rounds):
        for i in range(len(edits)):
            order = list(systems)
            random.Random(r * 1000 + i).shuffle(order)
            for s in order:
                rows[s][i].append(systems[s](i))
                print(f"bench_prediction: round {r + 1} edit {i + 1}/{len(edits)} {s}: "
                      f"{rows[s][i][-1]['tokens'] / rows[s][i][-1]['seconds']:.1f} tok/s", file=sys.stderr)
    ours_names = [s for s in systems if s != "llama.cpp"]
    same = all(rows[s][i][0]["ids"] == rows["none"][i][0]["ids"] for s in ours_names for i in range(len(edits)))
    rate = {s: [statistics.median(x["tokens"] / x["seconds"] for x in rows[s][i]) for i in range(len(edits))]
            for s in systems}
    total = {s: sum(x["tokens"] for i in range(len(edits)) for x in rows[s][i])
             / sum(x["seconds"] for i in range(len(edits)) for x in rows[s][i]) for s in systems}
    # after the first token: what the drafting changes (the prompt's prefill is the same for every system of ours)
    decode = {s: sum(x["tokens"] - 1 for i in range(len(edits)) for x in rows[s][i])
              / sum(x["seconds"] - x["ttft"] for i in range(len(edits)) for x in rows[s][i]) for s in systems}
    cpu = machine_info("cpu", sys.argv)["cpu"]
    flags = " ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile") if f in cpu_flags())
    lines = [f"CPU: {cpu} ({flags}); {len(edits)} edits x {args.rounds} rounds, greedy; answers identical across "
             f"our systems: {'yes' if same else 'NO'}", "",
             "| system | tokens/s (all) | vs none | vs llama.cpp | per-edit ratio vs none (median, min-max) "
             "| after the first token: tokens/s | vs none | mean accepted length | prediction tokens accepted |",
             "|---|---:|---:|---:|---|---:|---:|---:|---:|"]
    for s in systems:
        per = [a / b for a, b in zip(rate[s], rate["none"])]
        mal = [x.get("mean_accepted_length") for i in range(len(edits)) for x in rows[s][i]]
        acc = [x.get("accepted_prediction") for i in range(len(edits)) for x in rows[s][i]]
        lines.append(f"| {s} | {total[s]:.1f} | {total[s] / total['none']:.2f}x | "
                     + (f"{total[s] / total['llama.cpp']:.2f}x" if "llama.cpp" in total else "-")
                     + f" | {statistics.median(per):.2f}x ({min(per):.2f}-{max(per):.2f}) | "
                     + f"{decode[s]:.1f} | {decode[s] / decode['none']:.2f}x | "
                     + (f"{statistics.mean(mal):.2f}" if mal[0] is not None else "-") + " | "
                     + (f"{statistics.mean(acc):.0f}" if acc[0] is not None and "prediction" in s else "-") + " |")
    table = "\n".join(lines)
    print(table)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"edits": [{k: e[k] for k in ("where", "kind")} for e in edits],
                                               "tokens_per_s": rate, "total": total, "decode": decode,
                                               "identical": same,
                                               "table": table}, indent=1) + "\n")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
