"""The user's prompts for `advise`, from files in any format `specdecode train` reads (training/data.py).

A JSONL record becomes the prompt a model would have answered: `messages` up to the first assistant turn (the
last user message its turn, the earlier ones its history), `prompt` (with `response` or `completion` beside it)
as a chat turn, `text` as a raw completion prompt of its first half. Any other file is one raw prompt: its text's
first half. The answers in the files are never read: each candidate writes its own.
"""

from __future__ import annotations

from specdecode.bench.data import Prompt
from specdecode.errors import SpecdecodeError
from specdecode.jsonl import read_jsonl
from specdecode.training.data import expand

MAX_RAW_CHARS = 4000  # a raw prompt's length: enough context for copying drafters, quick to prefill


def prompts_from_data(patterns: list[str]) -> list[Prompt]:
    prompts = []
    for path in expand(patterns):
        if path.suffix == ".jsonl":
            prompts += [p for number, record in read_jsonl(path)
                        if (p := from_record(record, path.stem, f"{path}:{number}")) is not None]
        else:
            prompts.append(raw(path.read_text(errors="replace"), path.stem, path.name))
    prompts = [p for p in prompts if p is not None and any(t.strip() for t in p.turns)]
    if not prompts:
        raise SpecdecodeError(f"no prompts in {', '.join(patterns)}: give records with messages, prompt or text")
    return prompts


def from_record(record: object, dataset: str, where: str) -> Prompt | None:
    if not isinstance(record, dict):
        raise SpecdecodeError(f"{where}: expected a JSON object, got {type(record).__name__}")
    ident = where.rsplit(":", 1)[-1]
    if isinstance(record.get("messages"), list):
        messages = record["messages"]
        if not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages):
            raise SpecdecodeError(f"{where}: every message needs a string 'role' and 'content'")
        answered = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
        asked = messages[:answered]
        if not asked or asked[-1].get("role") != "user":
            return None  # nothing asked before the first answer
        return Prompt(ident, dataset, dataset, [asked[-1]["content"]], True, list(asked[:-1]))
    if isinstance(record.get("prompt"), str):
        return Prompt(ident, dataset, dataset, [record["prompt"]], True)
    if isinstance(record.get("text"), str):
        return raw(record["text"], dataset, ident)
    raise SpecdecodeError(f"{where}: a record needs 'messages', 'prompt' or 'text' "
                          f"(found keys: {', '.join(sorted(record)) or 'none'})")


def raw(text: str, dataset: str, ident: str) -> Prompt:
    """A raw completion prompt: the first half of the text, the rest left for the model to write."""
    return Prompt(ident, dataset, dataset, [text[: min(len(text) // 2, MAX_RAW_CHARS)]], False)
