"""From measured runs to advice: a table of every candidate and the command lines of the one to use.

A drafter pays when its tokens/s beats plain decoding's by more than this machine's noise (PAYS). Of the drafters
that pay, those within that noise of the fastest are level: the advice is the one of them that holds the least
memory beyond the target (copying before a draft model), since the measurement cannot tell them apart and a draft
model costs its weights, its cache and its read of every prompt. When none pays, the advice is plain decoding, and
the reason is read from the best drafter's numbers: guesses rarely right (acceptance), or right but dearer to
draft and verify than the forwards they save (cost).
"""

from __future__ import annotations

import shlex
from typing import Any

from specdecode.bench.harness import Run
from specdecode.bench.metrics import add_speedups, summarize

PAYS = 1.05  # speedups under this are within run-to-run noise on a busy CPU
RARELY_RIGHT = 0.35  # acceptance below this: the guesses, not their cost, are the problem


def summaries(runs: list[Run], candidates: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each candidate's numbers (bench.metrics.summarize) and what it costs in memory beyond the target."""
    out = {}
    for name, facts in candidates.items():
        out[name] = dict(summarize([r for r in runs if r.method == name]), **facts)
    add_speedups(out, ("none",))
    return out


def advice(results: dict[str, dict[str, Any]], target: str) -> dict[str, Any]:
    drafting = {m: r for m, r in results.items() if m != "none" and r["tokens_per_s"]}
    best = max(drafting, key=lambda m: drafting[m]["tokens_per_s"], default=None)
    speedup = drafting[best]["speedup_vs_none"] if best else None
    if best is None or speedup is None or speedup < PAYS:
        reason = _why_not(best, drafting.get(best))
        return {"method": "none", "pays": False, "reason": reason, **commands("none", None, target)}
    fastest = drafting[best]["tokens_per_s"]
    level = [m for m, o in drafting.items()
             if o["tokens_per_s"] * PAYS >= fastest and (o["speedup_vs_none"] or 0) >= PAYS]
    chosen = min(level, key=lambda m: (_extra_memory(drafting[m]), -drafting[m]["tokens_per_s"]))
    r = drafting[chosen]
    reason = (f"{r['speedup_vs_none']:.2f}x plain decoding: {_percent(r['acceptance_rate'])} of drafted tokens "
              f"accepted, {r['mean_accepted_length']:.2f} tokens per target forward")
    if chosen != best:
        more = (_extra_memory(drafting[best])[0] - _extra_memory(r)[0]) / 2**20
        held = f"{more:.0f} MiB more" if more >= 1 else "more memory"
        reason += f"; level with the fastest, {best} ({speedup:.2f}x), which holds {held}"
    close = [m for m in level if m != chosen]
    method, draft = results[chosen]["method"], results[chosen].get("draft")
    return {"method": chosen, "pays": True, "reason": reason, "within_noise": close, **commands(method, draft, target)}


def _extra_memory(r: dict[str, Any]) -> tuple[int, int]:
    """(weights, cache bytes per token) a candidate holds beyond the target."""
    return r.get("extra_weights_bytes") or 0, r.get("extra_cache_bytes_per_token") or 0


def _why_not(best: str | None, r: dict[str, Any] | None) -> str:
    if best is None or r is None:
        return "no drafter was measured"
    acceptance = r["acceptance_rate"] or 0.0
    head = f"the best drafter, {best}, is {r['speedup_vs_none'] or 0:.2f}x plain decoding"
    if acceptance < RARELY_RIGHT:
        return f"{head}: its guesses are rarely right on these prompts ({_percent(acceptance)} accepted)"
    return (f"{head}: {_percent(acceptance)} of its guesses are right, but drafting them "
            f"({r['draft_ms_per_step'] or 0:.1f} ms a step) and verifying them costs more than the forwards they save")


def commands(method: str, draft: str | None, target: str) -> dict[str, str]:
    args = ["--target", target, "--method", method] + (["--draft", draft] if draft else [])
    line = " ".join(shlex.quote(a) for a in args)
    return {"generate": f"specdecode generate {line} 'your prompt'", "serve": f"specdecode serve {line}"}


def table(results: dict[str, dict[str, Any]]) -> str:
    head = ("| candidate | tokens/s | vs none | acceptance | accepted/forward | per position | TTFT s | "
            "draft ms/step | extra memory |")
    rows = [head, "|" + "---|" * 9]
    for name, r in results.items():
        positions = " ".join(f"{p:.2f}" for p in (r["acceptance_per_position"] or [])[:5]) or "-"
        rows.append(f"| {name} | {_num(r['tokens_per_s'], 1)} | {_num(r['speedup_vs_none'], 2, 'x')} | "
                    f"{_percent(r['acceptance_rate'])} | {_num(r['mean_accepted_length'], 2)} | {positions} | "
                    f"{_num(r['ttft_s_mean'], 2)} | {_num(r['draft_ms_per_step'], 1)} | {_memory(r)} |")
    return "\n".join(rows)


def _memory(r: dict[str, Any]) -> str:
    weights, per_token = _extra_memory(r)
    if not weights and not per_token:
        return "-"
    return f"{weights / 2**20:.0f} MiB + {per_token * 1024 / 2**20:.1f} MiB per 1k tokens"


def _num(value: float | None, digits: int, unit: str = "") -> str:
    return "-" if value is None else f"{value:.{digits}f}{unit}"


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.0f}%"
