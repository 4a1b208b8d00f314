"""Measuring candidates on the user's prompts within a time budget: a warm-up each, then prompt after prompt with
every candidate in turn (the order rotated, as the benchmark does), until the next prompt would not fit.

Every candidate sees the same prompts: a prompt's round is kept only when every candidate finished it, so an
interrupt (Ctrl-C) or the budget running out never leaves one candidate measured on more than another.
"""

from __future__ import annotations

import dataclasses
import sys
import time

import torch
from tqdm import tqdm

from specdecode.bench.data import Prompt
from specdecode.bench.harness import Decode, Encode, Run, run_prompt, warm_up
from specdecode.bench.runners import Runner
from specdecode.config import SamplingParams

WARMUP_TOKENS = 8


@dataclasses.dataclass
class Measured:
    runs: list[Run]
    seconds: float
    interrupted: bool
    prompts_left: int  # prompts the budget had no time for


def measure(prompts: list[Prompt], runners: dict[str, Runner], encode: Encode, decode: Decode,
            params: SamplingParams, budget_s: float, device: torch.device, progress: bool = True) -> Measured:
    started = time.monotonic()
    runs: list[Run] = []
    methods = list(runners)
    bar = tqdm(total=round(budget_s), unit="s", desc="advise", file=sys.stderr, disable=not progress,
               bar_format="{l_bar}{bar}| {n:.0f}/{total:.0f} s {postfix}")
    done = 0
    try:
        for method in methods:
            bar.set_postfix_str(f"warm-up {method}")
            warm_up(runners[method], prompts[0], encode, decode,
                    dataclasses.replace(params, max_new_tokens=WARMUP_TOKENS), device)
            _tick(bar, started)
        rounds: list[float] = []  # seconds each prompt's round took
        for index, prompt in enumerate(prompts):
            elapsed = time.monotonic() - started
            if rounds and elapsed + sum(rounds) / len(rounds) > budget_s:
                break
            shift = index % len(methods)
            this_round = []
            for method in methods[shift:] + methods[:shift]:
                bar.set_postfix_str(f"prompt {index + 1} {method}")
                turns = run_prompt(runners[method], prompt, encode, decode, params, device)
                this_round.append(Run(method, prompt, 0, turns))
                _tick(bar, started)
            runs += this_round
            done = index + 1
            rounds.append(time.monotonic() - started - elapsed)
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True  # keep the complete rounds
    bar.close()
    return Measured(runs, time.monotonic() - started, interrupted, len(prompts) - done)


def _tick(bar: tqdm, started: float) -> None:
    bar.n = min(bar.total, time.monotonic() - started)
    bar.refresh()
