"""The benchmark loop: warm up each method, then for every prompt run every method, interleaved.

Interleaving (prompt-major, method order rotated from one prompt to the next) spreads machine drift (thermal
throttling, a neighbour's load, page-cache state) over all methods alike, instead of charging it to whichever
method happened to run last. A warm-up generation per method (the first prompt's first turn) runs before any
timing and is discarded: first calls pay for allocator growth, lazy initialisation and kernel selection.

Multi-turn prompts are real conversations: each method answers turn 1, its own answer is appended to the
history, then it answers turn 2 (as MT-Bench and Spec-Bench do).
"""

from __future__ import annotations

import dataclasses
import resource
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm import tqdm

from specdecode.bench.data import Prompt
from specdecode.bench.runners import Runner, TurnResult
from specdecode.config import SamplingParams

Encode = Callable[[str | list[dict], bool], list[int]]  # (text or messages, chat) -> prompt ids
Decode = Callable[[list[int]], str]

ORDER_NOTE = ("methods interleaved per prompt (prompt-major, method order rotated each prompt); "
              "one warm-up generation per method excluded from timing")


@dataclass
class Run:
    """One method on one prompt (all its turns), in one repeat."""

    method: str
    prompt: Prompt
    repeat: int
    turns: list[TurnResult]

    @property
    def new_tokens(self) -> int:
        return sum(len(t.token_ids) for t in self.turns)

    @property
    def wall_s(self) -> float:
        return sum(t.wall_s for t in self.turns)


def run_bench(prompts: list[Prompt], runners: dict[str, Runner], encode: Encode, decode: Decode,
              params: SamplingParams, repeats: int = 1, device: torch.device | str = "cpu", warmup: bool = True,
              progress: bool = True) -> list[Run]:
    device = torch.device(device)
    methods = list(runners)
    if warmup:
        for method in tqdm(methods, desc="warm-up", file=sys.stderr, disable=not progress, leave=False):
            warm_up(runners[method], prompts[0], encode, decode, params, device)
    runs: list[Run] = []
    bar = tqdm(total=len(prompts) * repeats * len(methods), desc="bench", unit="gen", file=sys.stderr,
               disable=not progress)
    for index, prompt in enumerate(prompts):
        # Drafters that learn across requests (suffix pool, recycling table) hold the earlier prompts' answers, as
        # a server would; each repeat of this prompt starts from that memory, never from its own earlier answer.
        memory = {method: snapshot(runners[method]) for method in methods}
        for repeat in range(repeats):
            shift = (index * repeats + repeat) % len(methods)
            for method in methods[shift:] + methods[:shift]:
                bar.set_postfix_str(f"{prompt.dataset}:{prompt.id} {method}", refresh=False)
                if repeat:
                    restore(runners[method], memory[method])
                turns = run_prompt(runners[method], prompt, encode, decode, params, device)
                runs.append(Run(method, prompt, repeat, turns))
                bar.update()
    bar.close()
    return runs


def warm_up(runner: Runner, prompt: Prompt, encode: Encode, decode: Decode, params: SamplingParams,
            device: torch.device) -> None:
    """One untimed generation of the prompt's first turn; a drafter that learns across requests forgets it."""
    before = snapshot(runner)
    run_prompt(runner, dataclasses.replace(prompt, turns=prompt.turns[:1]), encode, decode, params, device)
    restore(runner, before)


def snapshot(runner: Runner) -> list:
    return runner.snapshot() if hasattr(runner, "snapshot") else []


def restore(runner: Runner, snapshot: list) -> None:
    if snapshot:
        runner.restore(snapshot)


def run_prompt(runner: Runner, prompt: Prompt, encode: Encode, decode: Decode, params: SamplingParams,
               device: torch.device) -> list[TurnResult]:
    answers: list[str] = []
    results = []
    for turn in range(len(prompt.turns)):
        source = prompt.messages(turn, answers) if prompt.chat else prompt.turns[turn]
        ids = encode(source, prompt.chat)  # outside the timed region, identical for every method
        reset_peak_memory(device)
        result = runner.run(ids, params)
        result.peak_memory_bytes = peak_memory(device)
        answers.append(decode(result.token_ids))
        results.append(result)
    return results


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory(device: torch.device) -> int:
    """CUDA: peak bytes allocated by torch since the reset. CPU: the process's RSS high-water mark, which only
    grows and covers every model loaded, so on CPU it cannot separate methods."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024  # macOS reports bytes, Linux KiB
