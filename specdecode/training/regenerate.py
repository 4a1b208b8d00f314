"""`--regenerate`: the target writes each example's answer itself (self-distillation). A drafter trained on the
target's own words learns what it will be asked to guess, not what the data's author wrote.

The answers are greedy, so prompt lookup drafts them (lossless: the same tokens as plain decoding, ~1.4x sooner on
a CPU; no draft model to load). Each answer is appended to a JSONL log as soon as it is written, keyed by the
example's place in the data: an interrupted run resumes after the last one, and a run with a larger --max-tokens
or another seed writes only the answers it lacks (the log is shared by runs over the same data and target)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

from specdecode.budget import CostCurve
from specdecode.config import SamplingParams
from specdecode.drafters.ngram import NgramDrafter
from specdecode.engine import Engine
from specdecode.training.data import Example
from specdecode.training.features import settings_key

MIN_ANSWER = 64  # new tokens allowed even where the data's answer was shorter
# What an answer depends on: the example (its data file and place in it), how long it may be, and the target as
# it runs. Not the token budget or the seed, which only choose the examples.
ANSWER_SETTINGS = ("data", "max_len", "target", "form", "device")


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
    todo = [ex for ex in held + train if ex.where not in done]
    engine = Engine(target, NgramDrafter(), num_draft_tokens=None, max_len=max_len + 1, costs=costs)
    with open(log, "a") as out, tqdm(total=len(held) + len(train), initial=len(held) + len(train) - len(todo),
                                      desc="target writes the answers", unit="example", dynamic_ncols=True) as bar:
        for ex in todo:
            done[ex.where] = answer = _answer(engine, ex, max_len)
            out.write(json.dumps({"ids": answer.ids, "loss": answer.loss, "where": ex.where}) + "\n")
            out.flush()
            bar.update(1)
    return [done[ex.where] for ex in train], [done[ex.where] for ex in held]


def _read_log(log: Path) -> dict[str, Example]:
    """The answers written so far, by example; a line cut short by an interrupt is dropped (and cut off the file,
    so the next answer starts on a line of its own)."""
    if not log.is_file():
        return {}
    text = log.read_text()
    whole = text[: text.rfind("\n") + 1]
    if whole != text:
        log.write_text(whole)
    records = (json.loads(line) for line in whole.splitlines())
    return {r["where"]: Example(r["ids"], r["loss"], r["where"]) for r in records}


def _answer(engine: Engine, ex: Example, max_len: int) -> Example:
    first = ex.loss.index(True) if True in ex.loss else len(ex.ids)
    prompt = ex.ids[:first]
    if not prompt or first >= max_len - 1:
        return ex  # nothing to prompt with (plain text), or no room: keep the data's text
    budget = min(max(len(ex.ids) - first, MIN_ANSWER), max_len - first - 1)
    answer = [t for step in engine.generate(prompt, SamplingParams(max_new_tokens=budget)) for t in step.tokens]
    return Example(prompt + answer, [False] * len(prompt) + [True] * len(answer), ex.where)
