"""`--regenerate`: the target writes each example's answer itself (self-distillation). A drafter trained on the
target's own words learns what it will be asked to guess, not what the data's author wrote.

The answers are greedy, so prompt lookup drafts them (lossless: the same tokens as plain decoding, ~1.4x sooner on
a CPU; no draft model to load). Each answer is appended to a JSONL log as soon as it is written, keyed by what it
depends on: the prompt's tokens and how many tokens it may have (one log per target, as it runs, and length cap).
An interrupted run resumes after the last answer; a run with a larger --max-tokens, another seed, more files, or
the same files moved or copied writes only the answers the log lacks."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from specdecode.config import SamplingParams
from specdecode.drafters.ngram import NgramDrafter
from specdecode.engine.engine import Engine
from specdecode.planner.budget import CostCurve
from specdecode.training.data import Example
from specdecode.training.features import settings_key

MIN_ANSWER = 64  # new tokens allowed even where the data's answer was shorter
# The settings an answer depends on besides its prompt: the target as it runs and the length cap. Not the data
# files, the token budget or the seed, which only choose the prompts.
ANSWER_SETTINGS = ("max_len", "target", "form", "device")


def answers_log(root: Path, settings: dict) -> Path:
    return root / f"answers-{settings_key({k: settings[k] for k in ANSWER_SETTINGS})}.jsonl"


@torch.inference_mode()
def regenerate(target: torch.nn.Module, train: list[Example], held: list[Example], max_len: int, log: Path,
               costs: CostCurve) -> tuple[list[Example], list[Example]]:
    """Each example's prompt (everything before its first loss token) + the target's greedy answer, up to the
    data answer's length (at least MIN_ANSWER) -> (train, held back), the same examples. `costs`: the target's
    verify cost curve, which sizes the drafts."""
    log.parent.mkdir(parents=True, exist_ok=True)
    done = _read_log(log)
    examples = held + train
    asks = [_ask(ex, max_len) for ex in examples]
    keys = [None if ask is None else _key(*ask) for ask in asks]
    todo = {key: (ask, ex.where) for key, ask, ex in zip(keys, asks, examples)  # each prompt once
            if key is not None and key not in done}
    engine = Engine(target, NgramDrafter(), num_draft_tokens=None, max_len=max_len + 1, costs=costs)
    with open(log, "a") as out, tqdm(total=len(examples), initial=len(examples) - len(todo), dynamic_ncols=True,
                                      desc="target writes the answers", unit="example") as bar:
        for key, ((prompt, budget), where) in todo.items():
            done[key] = [t for step in engine.generate(prompt, SamplingParams(max_new_tokens=budget))
                         for t in step.tokens]
            out.write(json.dumps({"key": key, "answer": done[key], "where": where}) + "\n")
            out.flush()
            bar.update(1)
    answered = [ex if ask is None else _answered(ex, ask[0], done[key])
                for ex, ask, key in zip(examples, asks, keys)]
    return answered[len(held) :], answered[: len(held)]


def _ask(ex: Example, max_len: int) -> tuple[list[int], int] | None:
    """-> (the prompt, how many tokens its answer may have), None when the data's text stays: nothing to prompt
    with (plain text) or no room left."""
    first = ex.loss.index(True) if True in ex.loss else len(ex.ids)
    if first == 0 or first >= max_len - 1:
        return None
    return ex.ids[:first], min(max(len(ex.ids) - first, MIN_ANSWER), max_len - first - 1)


def _key(prompt: list[int], budget: int) -> str:
    return hashlib.sha256(json.dumps([prompt, budget]).encode()).hexdigest()[:24]


def _answered(ex: Example, prompt: list[int], answer: list[int]) -> Example:
    return Example(prompt + answer, [False] * len(prompt) + [True] * len(answer), ex.where)


def _read_log(log: Path) -> dict[str, list[int]]:
    """The answers written so far, by prompt and budget. A line cut short by an interrupt is cut off the file (a
    truncation: the answers before it stay where they are, whatever interrupts this), so the next answer starts on
    a line of its own; a line that does not parse is skipped with a warning."""
    if not log.is_file():
        return {}
    data = log.read_bytes()
    end = data.rfind(b"\n") + 1
    if end != len(data):
        os.truncate(log, end)
    answers = {}
    for number, line in enumerate(data[:end].decode(errors="replace").splitlines(), start=1):
        try:
            record = json.loads(line)
            answers[record["key"]] = record["answer"]
        except (ValueError, KeyError, TypeError):
            print(f"warning: {log}:{number} is not an answer record; skipped", file=sys.stderr)
    return answers
