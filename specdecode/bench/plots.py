"""PNG plots of a benchmark report: speedup by method and category, and acceptance by draft position.

Drawn from the report dict alone (like the markdown table), with matplotlib's Agg backend: no display needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_plots(report: dict[str, Any], json_path: Path) -> list[Path]:
    """Write `<stem>-speedup.png` and `<stem>-acceptance.png` next to the JSON file; -> the paths written."""
    import matplotlib

    matplotlib.use("Agg")  # a file backend; plots are written by batch runs and tests without a display
    import matplotlib.pyplot as plt

    stem = json_path.with_suffix("")
    paths = [Path(f"{stem}-speedup.png"), Path(f"{stem}-acceptance.png")]
    for path, draw in zip(paths, (_speedup, _acceptance)):
        figure = draw(plt, report)
        figure.savefig(path, dpi=120, bbox_inches="tight")
        plt.close(figure)
    return paths


def _speedup(plt, report: dict[str, Any]):
    methods = report["methods"]
    bases = [b for b in ("none", "hf", "llamacpp") if b in methods]
    groups = report["categories"] + ["overall"]
    width_in = max(6.0, 0.35 * len(groups) * len(methods))
    figure, axes = plt.subplots(len(bases), 1, figsize=(width_in, 3.6 * len(bases)), squeeze=False)
    width = 0.8 / len(methods)
    for ax, base in zip(axes[:, 0], bases):
        for i, (name, m) in enumerate(methods.items()):
            key = f"speedup_vs_{base}"
            values = [m["by_category"][g][key] for g in report["categories"]] + [m[key]]
            xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(groups))]
            ax.bar(xs, [v or 0.0 for v in values], width, label=name)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(groups)), groups, rotation=30, ha="right")
        ax.set_ylabel(f"speedup vs {base}")
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the bars, not on them
    s = report["settings"]
    axes[0, 0].set_title(f"{s['target']}: tokens/s relative to the baseline ({s['dtype']}, {s['device']})")
    figure.tight_layout()
    return figure


def _acceptance(plt, report: dict[str, Any]):
    figure, ax = plt.subplots(figsize=(6.0, 3.6))
    drawn = 0
    for name, m in report["methods"].items():
        rates = m["acceptance_per_position"]
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=f"{name} (k={m['num_draft_tokens']})")
            drawn += 1
    longest = max((len(m["acceptance_per_position"] or []) for m in report["methods"].values()), default=0)
    ax.set_xticks(range(1, longest + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("P(accepted | drafted)")
    ax.set_ylim(0, 1.05)
    ax.set_title("Acceptance by draft position")
    if drawn:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no method reported draft acceptance", ha="center", va="center", transform=ax.transAxes)
    figure.tight_layout()
    return figure
