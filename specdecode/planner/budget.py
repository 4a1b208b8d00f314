"""What a target forward costs on this machine: the verify cost curve C(m), for a forward over m tokens.

Measured once per model, weights, dtype and machine and cached (~15 s on 2 cores), then replaced size by size by the
median of the times the engine sees in use (`InUseCurve`): what a forward costs while the machine does everything
else a step does, not in a quiet moment. The cache keeps the measured shape; what use teaches the next process is
the level (how much dearer or cheaper forwards run than measured). The planner (planner.py) makes every
draft-size decision from it. On a GPU C is flat; on a CPU, where C(8) is 1.1-2.3x C(1), it is not. The engine
also needs C at batch sizes (many requests' rows, prompt chunks): a few are measured up to 128 rows, and the curve
is linear between measured sizes. What a long cache adds to a forward is modelled beside it (context_cost.py):
`CostCurve.at` prices a step at its requests' context.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdecode.planner.context_cost import ContextCost, measure_slopes

MAX_MEASURED = 16  # every size up to this is measured (a request's verify forward)
# Sizes of a batch's forward (many requests, prompt chunks) measured beyond that; between them the curve is
# linear. A CPU's cost per row grows past the first few dozen rows, so extrapolating from 16 would flatter them.
BATCH_SIZES = (32, 64, 128)
# Repeats of those: each is a forward of 0.3-1.5 s on a 2-core CPU, where five repeats made a first measurement
# take ~24 s instead of ~12, and a long forward's fastest of two is already within a few percent of its fifth.
BATCH_REPEATS = 2


@dataclass(frozen=True)
class CostCurve:
    seconds: tuple[float, ...]  # [m - 1]: one target forward over m tokens (after a short cached prefix)
    tail: tuple[tuple[int, float], ...] = ()  # (m, seconds) for batch-sized forwards, m ascending
    # the cache file it came from: the level of the in-use prices is written back there for the next process
    source: Path | None = field(default=None, compare=False, repr=False)
    context: ContextCost | None = None  # what cached tokens add (None: nothing, as measured)

    def at(self, cached: int, requests: int = 1) -> CostCurve:
        """The curve for a forward of `requests` requests with about `cached` tokens each in their caches."""
        context = self.context
        if context is None or cached <= context.base:
            return self
        add = context.seconds
        return CostCurve(tuple(s + add(m, cached, requests) for m, s in enumerate(self.seconds, start=1)),
                         tuple((m, s + add(m, cached, requests)) for m, s in self.tail))

    def cost(self, m: int) -> float:
        if m <= len(self.seconds):
            return self.seconds[max(m, 1) - 1]
        return self._beyond(m)

    def span(self, first: int, count: int) -> tuple[float, ...] | list[float]:
        """cost(m) for m in [first, first + count): a slice where they were measured (the planner's loops)."""
        if first >= 1 and first + count - 1 <= len(self.seconds):
            return self.seconds[first - 1 : first - 1 + count]
        return [self.cost(m) for m in range(first, first + count)]

    def _beyond(self, m: int) -> float:
        """The cost of a forward larger than every size measured one by one."""
        points = [(len(self.seconds), self.seconds[-1]), *self.tail]
        if len(points) == 1 and len(self.seconds) > 1:
            points.insert(0, (len(self.seconds) - 1, self.seconds[-2]))
        for (m0, s0), (m1, s1) in zip(points, points[1:]):
            if m <= m1:
                return s0 + (s1 - s0) * (m - m0) / (m1 - m0)
        if len(points) == 1:  # one measured size: proportional
            return self.seconds[-1] * m
        (m0, s0), (m1, s1) = points[-2], points[-1]
        return s1 + (s1 - s0) / (m1 - m0) * (m - m1)

    def ratios(self) -> list[float]:
        """Cost relative to a one-token forward, for reports."""
        return [s / self.seconds[0] for s in self.seconds]

    def to_dict(self) -> dict:
        saved = {"seconds": list(self.seconds), "ratio_to_one_token": [round(r, 3) for r in self.ratios()],
                 "batch_sizes": [[m, s] for m, s in self.tail]}
        if self.context is not None:
            saved["context"] = self.context.to_dict()
        return saved


IN_USE_WINDOW = 24  # a size's most recent in-use times whose median stands for it
IN_USE_MIN = 4  # in-use times a size needs before its median replaces the measured value
SAVE_EVERY = 32  # median updates between write-backs of the in-use curve (and whenever a size is first priced)
# A size's median is taken again every this many of its times (and when it is first priced), not after every
# forward: a median of 24 barely moves with one more time, and rebuilding the curve every step cost ~0.15 ms of a
# step on a 2-core Xeon (its code and data read back into caches the forward had just flushed).
IN_USE_REFRESH = 4
# A size not timed in this many forwards is forgotten and priced from its neighbours again. A stall of a few seconds
# (seen in the first generation of a bench run on a 2-core Xeon: its forwards at ~2.5x) priced 3-6 rows so dear that
# `draft` verified 2 rows from then on, and the sizes never verified were never timed again: 1.11x `none` over the
# whole run where the next run gave 1.55x. A `draft` step is one forward: this is about one 128-token answer.
IN_USE_STALE = 96
# Until two rows are timed in use, they are priced at most this many one-row forwards. A measurement taken while
# the machine was busy priced them at 1.6-2.4x one row (cached curves of this project's tests), where quiet
# measurements give 1.0-1.2x on every CPU measured: no draft then paid, none was verified, and two rows were never
# timed to correct it. At 1.25x, a first draft token the drafter rates above one in four gets verified and timed.
SECOND_ROW_PRIOR = 1.25


class InUseCurve:
    """The verify cost curve as forwards run in use: each size's median over its last IN_USE_WINDOW times, and the
    measured curve, scaled to the machine's speed now, for sizes not seen often enough yet.

    Keeping each size's fastest time instead (as this engine did before) drifted the curve to a quiet moment's
    shape: on a 2-core AVX2 machine it came to price 8 rows at 1.21x one row, while that run's own 8-row forwards
    took 1.8x its 2-row ones, and the planner verified far more nodes than paid. A median follows the machine both ways and lets no lucky
    forward of one size talk the planner into or out of drafting."""

    def __init__(self, measured: CostCurve, window: int = IN_USE_WINDOW, min_times: int = IN_USE_MIN,
                 refresh: int = IN_USE_REFRESH, stale: int = IN_USE_STALE) -> None:
        self.measured, self.window, self.min_times, self.refresh = measured, window, min_times, refresh
        self.stale = stale
        self.times: dict[int, deque[float]] = {}
        self.fresh: dict[int, int] = {}  # per size, its times since its median was last taken
        self.clock = 0  # forwards observed
        self.last: dict[int, int] = {}  # per size, the clock when it was last timed
        self.medians: dict[int, float] = {}  # sizes with at least min_times in-use times
        self.curve = measured
        self.updates = 0  # median updates since the last write-back
        self.label: dict | None = None  # the cache file's model and machine lines (read at the first write-back)

    def observe(self, m: int, seconds: float) -> CostCurve:
        """The curve after a forward over m rows took `seconds` (sizes past the measured run: scaled, not kept)."""
        if not 1 <= m <= len(self.measured.seconds) or not math.isfinite(seconds) or seconds <= 0:
            return self.curve
        self.clock += 1
        self.last[m] = self.clock
        times = self.times.get(m)
        if times is None:  # not setdefault: its default would be built every forward
            times = self.times[m] = deque(maxlen=self.window)
        times.append(seconds)
        first = m not in self.medians
        self.fresh[m] = self.fresh.get(m, 0) + 1
        if len(times) >= self.min_times and (first or self.fresh[m] >= self.refresh):
            self.fresh[m] = 0
            self._forget_stale()
            self.medians[m] = statistics.median(times)
            self.curve = self._curve(explore=True)
            self.updates += 1
            if self.measured.source is not None and (first or self.updates >= SAVE_EVERY):
                # the next process starts at the level this one saw, not at one quiet (or busy) measurement's
                if self.label is None:  # the file's own model and machine lines, read once
                    self.label = file_label(self.measured.source)
                save(self.measured.source, self.leveled(), self.label)
                self.updates = 0
        return self.curve

    def _forget_stale(self) -> None:
        """Drop the sizes not timed in the last `stale` forwards: a price from a stall must not outlive it."""
        for size in [k for k, at in self.last.items() if self.clock - at > self.stale]:
            for known in (self.times, self.fresh, self.medians, self.last):
                known.pop(size, None)

    def leveled(self) -> CostCurve:
        """The measured curve times the median in-use/measured ratio of the sizes timed: what is written back.
        Not the sizes' own medians: sizes are timed at different moments and contexts (a method that always
        drafts never times one row; long prompts' forwards are dearer at every size), so their ratios drift
        from one process to the next. Written back size by size, one row came to be priced at 0.64x three rows
        on the 2-core AVX2 machine, where it costs 0.86x, and `hybrid` drafted too little (0.92x `none` on the
        kinds of work against 0.99x with the curve measured again)."""
        level = statistics.median(self.medians[m] / self.measured.seconds[m - 1] for m in self.medians)
        return CostCurve(tuple(s * level for s in self.measured.seconds),
                         tuple((m, s * level) for m, s in self.measured.tail), context=self.measured.context)

    def _curve(self, explore: bool) -> CostCurve:
        """Known sizes at their medians; the others at the measured time times the in-use/measured ratio of the
        nearest known sizes (interpolated between them): a request that always drafts never times one row, and
        its C(1) then follows C(2), not the far end of the curve.

        `explore`: the size just past the largest known one is priced no dearer than the row before it added
        (two rows, after one: no dearer than SECOND_ROW_PRIOR one-row forwards). A measurement taken while the
        machine was busy can price the larger sizes far too high (seen: 3 rows at 1.8x one, where they cost
        1.3x), and a size the planner never verifies is never timed. This way the next size gets tried and
        timed, and the curve climbs to the sizes that pay. No guess is written back (`leveled`)."""
        measured = self.measured.seconds
        known = sorted(self.medians)
        ratio = {m: self.medians[m] / measured[m - 1] for m in known}
        next_try = known[-1] + 1 if explore and known else 0
        seconds, floor = [], 0.0
        below, up = None, 0  # the largest known size below m, and the index in `known` of the smallest >= m
        for m, measured_s in enumerate(measured, start=1):
            while up < len(known) and known[up] < m:
                below, up = known[up], up + 1
            if m in ratio:
                at = self.medians[m]
            else:
                above = known[up] if up < len(known) else None
                if below is None or above is None:
                    r = ratio[below if above is None else above]
                else:
                    r = ratio[below] + (ratio[above] - ratio[below]) * (m - below) / (above - below)
                at = measured_s * r
                if m == next_try == 2:
                    at = min(at, SECOND_ROW_PRIOR * seconds[0])
                elif m == next_try:  # the last row's price again
                    at = min(at, 2 * seconds[-1] - seconds[-2])
            floor = max(floor, at)  # more rows never cost less
            seconds.append(floor)
        tail, floor = [], seconds[-1]
        for size, measured_s in self.measured.tail:
            floor = max(floor, measured_s * ratio[known[-1]])
            tail.append((size, floor))
        return CostCurve(tuple(seconds), tuple(tail), context=self.measured.context)


def machine_key() -> str:
    """What makes a timing comparable: CPU model and flags (or GPU name), threads, torch and kernel versions."""
    from specdecode.kernels import build_key, cpu_flags, cpu_model

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    return (f"{platform.machine()} {cpu_model()} {' '.join(cpu_flags())} {gpu} threads={torch.get_num_threads()} "
            f"torch={torch.__version__} kernels={build_key()[0]}")


def curve_path(model_key: str, cache: Path | None = None) -> Path:
    from specdecode.settings import cache_dir

    # v5: with what cached tokens add (context_cost.py); v4: written back with the measured shape (leveled)
    digest = hashlib.sha256(f"v5\n{model_key}\n{machine_key()}".encode()).hexdigest()[:16]
    return (cache or cache_dir()) / "cost-curves" / f"{digest}.json"


@torch.inference_mode()
def measure(target: torch.nn.Module, max_tokens: int = MAX_MEASURED, prefix: int = 128,
            repeats: int = 5, batch_sizes: tuple[int, ...] = BATCH_SIZES) -> CostCurve:
    """Seconds of a decode-mode target forward over 1..max_tokens tokens, then over each of `batch_sizes`, after
    `prefix` cached tokens (the verify forward the engine runs; attention over a short prefix is a small share).
    Sizes take turns, so a slow spell of a shared machine hits them all; each keeps its fastest run (the batch
    sizes of the first BATCH_REPEATS turns), and a larger forward is never recorded as cheaper than a smaller one.
    Then what a long cache adds (context_cost.measure_slopes)."""
    from specdecode.models.masks import chain_mask

    device = target.device
    vocab = target.config.vocab_size
    sizes = [*range(1, max_tokens + 1), *(m for m in batch_sizes if m > max_tokens)]
    cache = target.new_cache(1, prefix + sizes[-1])
    # Distinct tokens, spread over the vocabulary: a dense model's cost is data-blind, but a mixture of experts
    # reads the union of the experts its rows route to, and rows of one repeated token would all route alike
    ids = torch.arange(prefix + sizes[-1], device=device)[None] * 7919 % vocab
    target(ids[:, :prefix], torch.arange(prefix, device=device)[None], cache, chain_mask(0, prefix, device),
           logits_from=prefix - 1)
    best = [float("inf")] * len(sizes)
    for turn in range(repeats):
        for j, m in enumerate(sizes):
            if m > max_tokens and turn >= BATCH_REPEATS:
                continue
            cache.truncate(prefix)
            start = time.perf_counter()
            target(ids[:, prefix : prefix + m], torch.arange(prefix, prefix + m, device=device)[None], cache,
                   chain_mask(prefix, m, device), decode=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            best[j] = min(best[j], time.perf_counter() - start)
    for j in range(1, len(sizes)):
        best[j] = max(best[j], best[j - 1])
    del cache
    context = measure_slopes(target, dict(zip(sizes, best)), prefix, repeats)
    return CostCurve(tuple(best[:max_tokens]), tuple(zip(sizes[max_tokens:], best[max_tokens:])), context=context)


def valid(seconds: tuple[float, ...], tail: tuple[tuple[int, float], ...]) -> bool:
    """A curve every decision can use: some sizes, every time finite and positive, never cheaper for more rows (a
    file holding 0 or NaN would otherwise make every step's choice fail)."""
    times = [*seconds, *(s for _, s in tail)]
    sizes = [*range(1, len(seconds) + 1), *(m for m, _ in tail)]
    return (bool(seconds) and all(math.isfinite(t) and t > 0 for t in times)
            and all(a <= b for a, b in zip(times, times[1:])) and sizes == sorted(set(sizes)))


def load_cached(model_key: str, cache: Path | None = None) -> CostCurve | None:
    """The cached curve for this model on this machine, or None when there is none (or it is damaged)."""
    path = curve_path(model_key, cache)
    if not path.exists():
        return None
    try:
        saved = json.loads(path.read_text())
        seconds = tuple(float(x) for x in saved["seconds"])
        tail = tuple((int(m), float(s)) for m, s in saved["batch_sizes"])
        context = ContextCost.from_dict(saved["context"]) if "context" in saved else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # a damaged file is measured again
    return CostCurve(seconds, tail, source=path, context=context) if valid(seconds, tail) else None


def load_or_measure(target: torch.nn.Module, model_key: str, cache: Path | None = None) -> CostCurve:
    """The cached curve for this model on this machine, measured (and saved) on first use; the engine writes the
    level of its in-use prices back to the same file (InUseCurve.leveled)."""
    cached = load_cached(model_key, cache)
    if cached is not None:
        return cached
    print("specdecode: measuring what a verify forward costs on this machine (once, ~15 s on 2 cores)...",
          file=sys.stderr)
    curve = measure(target)
    path = curve_path(model_key, cache)
    save(path, curve, {"model": model_key, "machine": machine_key()[:200]})
    return CostCurve(curve.seconds, curve.tail, source=path, context=curve.context)


def save(path: Path, curve: CostCurve, label: dict | None = None) -> None:
    """Write `curve` to `path` (with `label`, else the file's own model and machine lines). Written whole under a
    name no other process or thread uses, then renamed: readers never see half a file. A cache that cannot be
    written costs nothing but the next process's start from the older curve."""
    try:
        if label is None:
            label = file_label(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(json.dumps({**label, **curve.to_dict()}))
        tmp.replace(path)
    except OSError:
        pass


def file_label(path: Path) -> dict:
    """A curve file's model and machine lines ({} when it cannot be read)."""
    try:
        old = json.loads(path.read_text())
        return {k: old[k] for k in ("model", "machine") if k in old}
    except (OSError, ValueError, TypeError, AttributeError):
        return {}
