"""The benchmark's outputs: one JSON document (schema in docs/bench.md) and a markdown table for stdout.

`build_report` is pure: runs + per-method facts + settings + machine info -> a dict of plain JSON types.
`markdown` reads only that dict, so a saved JSON file can be re-rendered later.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from specdecode.bench.harness import ORDER_NOTE, Run
from specdecode.bench.metrics import add_speedups, find_mismatches, summarize

SCHEMA_VERSION = 1
BASES = ("none", "hf", "llamacpp")  # speedups are reported against each that ran
REFERENCES = ("hf", "llamacpp")  # other engines: greedy outputs are compared with theirs too (expect near-equal)
MAX_LISTED = 10  # mismatches printed under the table (the JSON lists all)


def build_report(runs: list[Run], methods: dict[str, dict[str, Any]], settings: dict[str, Any],
                 machine: dict[str, Any], greedy: bool, verify_costs: dict[str, Any] | None = None) -> dict[str, Any]:
    """methods: name -> facts known before running (family, num_draft_tokens, weights_bytes), in table order;
    verify_costs: the cost curve our automatic draft sizes were chosen from (CostCurve.to_dict), if any."""
    names = list(methods)
    overall = _groups(runs, names, lambda r: True)
    by_category = {c: _groups(runs, names, lambda r, c=c: r.prompt.category == c) for c in _unique(runs, "category")}
    by_dataset = {d: _groups(runs, names, lambda r, d=d: r.prompt.dataset == d) for d in _unique(runs, "dataset")}
    report_methods = {}
    for name in names:
        entry = dict(methods[name], **overall[name], **_lossless(runs, name, names, greedy))
        entry["by_category"] = {c: groups[name] for c, groups in by_category.items()}
        entry["by_dataset"] = {d: groups[name] for d, groups in by_dataset.items()}
        report_methods[name] = entry
    return {
        "schema_version": SCHEMA_VERSION,
        "settings": dict(settings, order=ORDER_NOTE),
        "machine": machine,
        "categories": list(by_category),
        "datasets": list(by_dataset),
        "methods": report_methods,
        "verify_costs": verify_costs,
        "runs": [_run_record(r) for r in runs],
    }


def _groups(runs: list[Run], names: list[str], keep: Callable[[Run], bool]) -> dict[str, dict[str, Any]]:
    groups = {m: summarize([r for r in runs if r.method == m and keep(r)]) for m in names}
    add_speedups(groups, BASES)
    return groups


def _unique(runs: list[Run], attr: str) -> list[str]:
    return list(dict.fromkeys(getattr(r.prompt, attr) for r in runs))


def _lossless(runs: list[Run], name: str, names: list[str], greedy: bool) -> dict[str, Any]:
    # Under sampling outputs are draws from the same distribution, not equal sequences: nothing to compare.
    result: dict[str, Any] = {"lossless": None, "mismatches": []}
    for ref in REFERENCES:
        result |= {f"matches_{ref}": None, f"mismatches_vs_{ref}": []}
    if not greedy:
        return result
    result["mismatches"] = [m.to_dict() for m in find_mismatches(runs, name, "none")] if name != "none" else []
    result["lossless"] = not result["mismatches"]
    for ref in REFERENCES:
        if ref in names:
            found = find_mismatches(runs, name, ref) if name != ref else []
            result |= {f"matches_{ref}": not found, f"mismatches_vs_{ref}": [m.to_dict() for m in found]}
    return result


def _run_record(run: Run) -> dict[str, Any]:
    return {
        "method": run.method,
        "dataset": run.prompt.dataset,
        "prompt_id": run.prompt.id,
        "category": run.prompt.category,
        "repeat": run.repeat,
        "turns": [
            {
                "new_tokens": len(t.token_ids),
                "wall_s": t.wall_s,
                "ttft_s": t.ttft_s,
                "tokens_per_s": len(t.token_ids) / t.wall_s if t.wall_s > 0 else None,
                "finish_reason": t.finish_reason,
                "decode_forwards": t.decode_forwards,
                "drafted_tokens": t.drafted_tokens, "drafts": t.drafts,
                "accepted_tokens": t.accepted_tokens,
                "by_drafter": t.by_drafter, "draft_s": t.draft_s,
                "peak_memory_bytes": t.peak_memory_bytes,
                "token_ids": t.token_ids,
            }
            for t in run.turns
        ],
    }


def _machine_line(machine: dict[str, Any]) -> list[str]:
    """What the figures ran on, named beside them: the CPU, the flags that pick its kernels, threads, the GPU."""
    if not machine.get("cpu"):
        return []
    flags = ", ".join(machine.get("cpu_flags") or []) or "no SIMD flags read"
    prefetch = f"; kernel prefetch {machine['kernel_prefetch']}" if machine.get("kernel_prefetch") else ""
    gpu = f"; GPU {machine['gpu']}" if machine.get("gpu") else ""
    return [f"Machine: {machine['cpu']} ({flags}), {machine.get('torch_threads')} threads{prefetch}{gpu}; "
            f"torch {machine.get('torch')}, commit {machine.get('git_commit')}.", ""]


def markdown(report: dict[str, Any]) -> str:
    s, methods = report["settings"], report["methods"]
    mode = "greedy" if s["greedy"] else (
        f"sampling (temperature {s['temperature']}, top-p {s['top_p']}, top-k {s['top_k']}, seed {s.get('seed')})")
    quantized = "".join(f", {who} {s[key]}" for who, key in (("target", "quantize"), ("draft", "draft_quantize"))
                        if s.get(key, "none") != "none")
    stored = ", weights as stored" if s.get("weights") == "stored" else ""
    bases = [b for b in BASES if b in methods]
    lines = [
        f"## specdecode bench: {s['target']} (draft {s['draft']}), {s['dtype']} on {s['device']}{stored}{quantized}",
        "",
        *_machine_line(report.get("machine", {})),
        f"{mode}, max {s['max_new_tokens']} new tokens, {_count(report)} prompts x {s['repeats']} repeats; "
        f"{s['order']}. Speedups are tokens/s ratios on the same prompts.",
        "",
        "| method | k | tok/s | tok/s (mean) | " + " | ".join(f"vs {b}" for b in bases) + " | accepted len | "
        "nodes/step | draft ms/step | acceptance | TTFT ms | ITL p50 ms | ITL p95 ms | peak mem | lossless |",
        "|---|---:|---:|---:|" + "---:|" * len(bases) + "---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, m in methods.items():
        lines.append("| " + " | ".join([
            name, str(m["num_draft_tokens"]), _num(m["tokens_per_s"], ".2f"), _num(m["tokens_per_s_mean"], ".2f"),
            *(_x(m.get(f"speedup_vs_{b}")) for b in bases), _num(m["mean_accepted_length"], ".2f"),
            _num(m.get("nodes_per_step"), ".2f"), _num(m.get("draft_ms_per_step"), ".2f"), _num(m["acceptance_rate"], ".1%"), _ms(m["ttft_s_mean"]), _ms(m["itl_s_p50"]), _ms(m["itl_s_p95"]),
            _mib(m["peak_memory_bytes"]), _verdict(m),
        ]) + " |")  # fmt: skip
    if len(report["categories"]) > 1:
        lines += ["", "Speedup vs none by category:", "",
                  "| method | " + " | ".join(report["categories"]) + " | overall |",
                  "|---|" + "---:|" * (len(report["categories"]) + 1)]
        for name, m in methods.items():
            cells = [_x(m["by_category"][c]["speedup_vs_none"]) for c in report["categories"]]
            lines.append(f"| {name} | " + " | ".join(cells) + f" | {_x(m['speedup_vs_none'])} |")
    mixed = {name: m["accepted_by_drafter"] for name, m in methods.items() if len(m.get("accepted_by_drafter") or {}) > 1}
    if mixed:
        lines += ["", "Accepted draft tokens by the drafter that proposed them:", ""]
        for name, counts in mixed.items():
            total = sum(counts.values()) or 1
            lines.append(f"- {name}: " + ", ".join(f"{who} {n / total:.0%}" for who, n in counts.items()))
    if report.get("verify_costs"):
        ratios = report["verify_costs"]["ratio_to_one_token"]
        lines += ["", f"Verify cost curve the automatic draft size was chosen from (forward over m tokens / one token, "
                  f"m = 1..{len(ratios)}; one token = {report['verify_costs']['seconds'][0] * 1000:.1f} ms): "
                  + " ".join(f"{r:.2f}" for r in ratios)]
    listed = [x for m in methods.values() for x in m["mismatches"] + m.get("mismatches_vs_hf", [])]
    if listed:
        lines += ["", f"Greedy mismatches ({len(listed)}; first {min(len(listed), MAX_LISTED)}):", ""]
        for x in listed[:MAX_LISTED]:
            lines.append(f"- {x['method']} vs {x['reference']}: {x['dataset']}:{x['prompt_id']} turn {x['turn'] + 1} "
                         f"repeat {x['repeat']}, first difference at new token {x['position']} "
                         f"(expected {x['expected']}, got {x['got']}; "
                         f"lengths {x['expected_length']}/{x['got_length']})")
    return "\n".join(lines)


def _count(report: dict[str, Any]) -> int:
    return len({(r["dataset"], r["prompt_id"]) for r in report["runs"]})


def _verdict(m: dict[str, Any]) -> str:
    if m["lossless"] is None:
        return "n/a (sampling)"
    if m.get("family", "ours") != "ours":  # another engine: equal to ours only up to its own rounding
        verdict = "other engine: " + ("same as none" if m["lossless"] else f"differs from none on {len(m['mismatches'])} turns")
    else:
        verdict = "yes" if m["lossless"] else f"NO ({len(m['mismatches'])} turns differ)"
    for ref in REFERENCES:
        if m.get(f"matches_{ref}") is False:
            verdict += f"; differs from {ref} on {len(m[f'mismatches_vs_{ref}'])} turns"
    return verdict


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else f"{value:{spec}}"


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f}"


def _mib(size: int | None) -> str:
    return "-" if size is None else f"{size / 2**20:,.0f} MiB"
