"""Aggregate benchmark runs into the numbers Spec-Bench reports, and check losslessness token by token.

Definitions (the JSON schema in docs/bench.md repeats them):
- tokens_per_s: total new tokens / total generation time over the group;
  tokens_per_s_mean: Spec-Bench's figure, the mean over runs (prompt x repeat, all turns) of tokens / time.
- speedup_vs_<base>: tokens_per_s / the base method's tokens_per_s on the same prompts. When the outputs are
  token-identical (lossless) this is exactly the walltime ratio.
- mean_accepted_length: tokens emitted per target forward after the first (prefill) forward, bonus token included;
  plain decoding scores 1.0. acceptance_rate and acceptance_per_position (by depth) count draft tokens, ours only;
  nodes_per_step: draft tokens verified per step that drafted (a tree's nodes); the step's accepted path is
  mean_accepted_length - 1 tokens long. draft_ms_per_step: time proposing, over every decode step.
- itl_s_p50/p95: over every token after the first of every generation (a step's time split over its tokens).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from specdecode.bench.harness import Run


@dataclass
class Mismatch:
    method: str
    reference: str
    dataset: str
    prompt_id: str
    repeat: int
    turn: int
    position: int  # index of the first differing new token
    expected: int | None  # the reference's token there (None: the reference ended first)
    got: int | None
    expected_length: int
    got_length: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def first_difference(expected: list[int], got: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            return i
    return None if len(expected) == len(got) else min(len(expected), len(got))


def find_mismatches(runs: list[Run], method: str, reference: str) -> list[Mismatch]:
    """Every turn where `method`'s tokens differ from `reference`'s on the same prompt and repeat."""
    expected = {_key(r): r for r in runs if r.method == reference}
    found = []
    for run in runs:
        base = expected.get(_key(run)) if run.method == method else None
        if base is None:
            continue
        for turn, (a, b) in enumerate(zip(base.turns, run.turns)):
            pos = first_difference(a.token_ids, b.token_ids)
            if pos is not None:
                found.append(Mismatch(
                    method, reference, run.prompt.dataset, run.prompt.id, run.repeat, turn, pos,
                    _at(a.token_ids, pos), _at(b.token_ids, pos), len(a.token_ids), len(b.token_ids),
                ))  # fmt: skip
    return found


def summarize(runs: list[Run]) -> dict[str, Any]:
    """The numbers for one method over one group of runs (all, one category or one dataset)."""
    turns = [t for r in runs for t in r.turns]
    new_tokens = sum(len(t.token_ids) for t in turns)
    wall = sum(t.wall_s for t in turns)
    forwards = sum(t.decode_forwards for t in turns)
    reported = [t for t in turns if t.drafted_tokens is not None]
    drafted = sum(t.drafted_tokens for t in reported)
    ttfts = [t.ttft_s for t in turns if t.ttft_s is not None]
    latencies = [x for t in turns for x in t.token_latencies_s]
    memory = [t.peak_memory_bytes for t in turns if t.peak_memory_bytes is not None]
    return {
        "prompts": len({_key(r)[:2] for r in runs}),
        "generations": len(turns),
        "new_tokens": new_tokens,
        "wall_s": wall,
        "tokens_per_s": new_tokens / wall if wall > 0 else None,
        "tokens_per_s_mean": _mean(r.new_tokens / r.wall_s for r in runs if r.wall_s > 0),
        "mean_accepted_length": sum(t.decode_tokens for t in turns) / forwards if forwards else None,
        "acceptance_rate": sum(t.accepted_tokens for t in reported) / drafted if drafted else None,
        "acceptance_per_position": per_position(reported) if drafted else None,
        "nodes_per_step": drafted / drafts if (drafts := sum(t.drafts or 0 for t in reported)) else None,
        "draft_ms_per_step": _draft_ms_per_step(turns),
        "ttft_s_mean": _mean(ttfts),
        "ttft_s_p50": _percentile(ttfts, 50),
        "itl_s_p50": _percentile(latencies, 50),
        "itl_s_p95": _percentile(latencies, 95),
        "peak_memory_bytes": max(memory) if memory else None,
        "accepted_by_drafter": by_drafter(turns),
    }


def _draft_ms_per_step(turns: list) -> float | None:
    """Milliseconds spent proposing a draft, per decode step (steps without one count, at their cost)."""
    timed = [t for t in turns if t.draft_s is not None]
    steps = sum(t.decode_forwards for t in timed)
    return 1000 * sum(t.draft_s for t in timed) / steps if steps else None


def by_drafter(turns: Iterable) -> dict[str, int]:
    """Accepted draft tokens by the drafter that proposed them (hybrid chooses one per step), most first."""
    accepted: dict[str, int] = {}
    for t in turns:
        for name, (_, a) in getattr(t, "by_drafter", {}).items():
            accepted[name] = accepted.get(name, 0) + a
    return dict(sorted(accepted.items(), key=lambda item: -item[1]))


def per_position(turns: Iterable) -> list[float]:
    drafted: list[int] = []
    accepted: list[int] = []
    for t in turns:
        for i, (d, a) in enumerate(zip(t.drafted_at, t.accepted_at)):
            if i == len(drafted):
                drafted.append(0)
                accepted.append(0)
            drafted[i] += d
            accepted[i] += a
    return [a / d if d else 0.0 for a, d in zip(accepted, drafted)]


def add_speedups(groups: dict[str, dict[str, Any]], bases: tuple[str, ...]) -> None:
    """groups: method -> summary of the same prompts; adds speedup_vs_<base> (None when the base did not run)."""
    for summary in groups.values():
        for base in bases:
            base_rate = groups[base]["tokens_per_s"] if base in groups else None
            rate = summary["tokens_per_s"]
            summary[f"speedup_vs_{base}"] = rate / base_rate if rate and base_rate else None


def _key(run: Run) -> tuple[str, str, int]:
    return run.prompt.dataset, run.prompt.id, run.repeat


def _at(tokens: list[int], pos: int) -> int | None:
    return tokens[pos] if pos < len(tokens) else None


def _mean(values: Iterable[float]) -> float | None:
    values = list(values)
    return float(np.mean(values)) if values else None


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None
