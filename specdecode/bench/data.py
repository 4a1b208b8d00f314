"""Benchmark prompts from JSONL files, in the spirit of Spec-Bench (Xia et al. 2024, arXiv:2401.07851).

Each line is one JSON object; the first of these fields that is present decides how it is sent:
  messages  list of {"role", "content"} dicts ending with a user message: chat, one generation
  turns     list of user messages: a multi-turn chat (MT-Bench); turn i sees the model's own earlier answers
  question  one user message (GSM8K): chat
  prompt    a raw completion prompt (HumanEval): sent as is, no chat template (`prompt_as_chat` wraps it)
The category is the row's `category` when it has one, else the file's stem; `--limit` counts rows per file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specdecode.errors import SpecdecodeError
from specdecode.jsonl import read_jsonl

ID_FIELDS = ("question_id", "task_id", "id")


@dataclass
class Prompt:
    id: str
    dataset: str  # the file's stem
    category: str
    turns: list[str]  # user messages, or the one raw prompt
    chat: bool  # False: a raw prompt, encoded without a chat template
    history: list[dict[str, str]] = field(default_factory=list)  # messages before the first turn

    def messages(self, turn: int, answers: list[str]) -> list[dict[str, str]]:
        """The conversation for `turn`: history, then each earlier user turn followed by the model's answer."""
        messages = list(self.history)
        for i in range(turn):
            messages += [{"role": "user", "content": self.turns[i]}, {"role": "assistant", "content": answers[i]}]
        return messages + [{"role": "user", "content": self.turns[turn]}]


def load_prompts(paths: list[str], limit: int | None = None, prompt_as_chat: bool = False) -> list[Prompt]:
    prompts: list[Prompt] = []
    for path in paths:
        prompts += load_file(Path(path), limit, prompt_as_chat)
    if not prompts:
        raise SpecdecodeError("the datasets hold no prompts: give a JSONL file with at least one row")
    return prompts


def load_file(path: Path, limit: int | None = None, prompt_as_chat: bool = False) -> list[Prompt]:
    if not path.is_file():
        raise SpecdecodeError(f"dataset {path} not found: give a JSONL file (one JSON object per line)")
    prompts = []
    for number, row in read_jsonl(path):
        if limit is not None and len(prompts) >= limit:
            break
        prompts.append(parse_row(row, path.stem, f"{path}:{number}", prompt_as_chat))
    return prompts


def parse_row(row: Any, dataset: str, where: str, prompt_as_chat: bool = False) -> Prompt:
    if not isinstance(row, dict):
        raise SpecdecodeError(f"{where}: expected a JSON object, got {type(row).__name__}")
    ident = next((str(row[k]) for k in ID_FIELDS if k in row), where.rsplit(":", 1)[-1])
    category = str(row.get("category") or dataset)
    if "messages" in row:
        messages = row["messages"]
        if not _is_messages(messages) or messages[-1]["role"] != "user":
            raise SpecdecodeError(f"{where}: `messages` must be a list of {{role, content}} ending with a user message")
        return Prompt(ident, dataset, category, [messages[-1]["content"]], True, list(messages[:-1]))
    if "turns" in row:
        turns = row["turns"]
        if not turns or not all(isinstance(t, str) for t in turns):
            raise SpecdecodeError(f"{where}: `turns` must be a non-empty list of strings")
        return Prompt(ident, dataset, category, list(turns), True)
    if "question" in row:
        return Prompt(ident, dataset, category, [_text(row, "question", where)], True)
    if "prompt" in row:
        return Prompt(ident, dataset, category, [_text(row, "prompt", where)], prompt_as_chat)
    raise SpecdecodeError(f"{where}: a row needs one of the fields messages, turns, question or prompt")


def _is_messages(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value
    )


def _text(row: dict, key: str, where: str) -> str:
    if not isinstance(row[key], str) or not row[key]:
        raise SpecdecodeError(f"{where}: `{key}` must be a non-empty string")
    return row[key]
