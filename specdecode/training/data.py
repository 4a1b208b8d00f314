"""Training text for drafters: files -> token ids with a loss mask, a held-back split, a token budget.

Accepted inputs (files or globs):
- JSONL, one record a line, in one of three shapes:
  `{"messages": [{"role", "content"}, ...]}` rendered with the target's chat template (loss on assistant turns),
  `{"prompt": ..., "response": ...}` (a one-turn chat; loss on the response), `{"text": ...}` (loss everywhere);
- any other file (plain text, source code): its text, loss everywhere.
The loss mask marks the tokens a drafter should learn to guess: what the target itself would write (assistant
turns), not what a user typed. A problem names the file and line, in one line.
"""

from __future__ import annotations

import glob
import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specdecode.errors import SpecdecodeError
from specdecode.jsonl import read_jsonl

MIN_TOKENS = 8  # shorter examples teach nothing about continuing text
EVAL_SHARE = 0.05  # of the examples held back from training, for the report


@dataclass(slots=True)
class Example:
    ids: list[int]
    loss: list[bool]  # per token: learn to predict this token (it is the target's to write)
    where: str  # "file:line", for messages


def expand(patterns: list[str]) -> list[Path]:
    """Files named or matched by `patterns`, in order, each once."""
    files: list[Path] = []
    for pattern in patterns:
        matched = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        matched = [m for m in matched if Path(m).is_file()] if glob.has_magic(pattern) else matched
        if not matched:
            raise SpecdecodeError(f"--data {pattern}: no file matches")
        for m in matched:
            path = Path(m)
            if not path.is_file():
                raise SpecdecodeError(f"--data {m}: no such file")
            if path not in files:
                files.append(path)
    return files


def data_key(files: list[Path]) -> str:
    """Names, sizes and modification times of the data: a cache built from other data is never reused."""
    h = hashlib.sha256()
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{int(st.st_mtime)}\n".encode())
    return h.hexdigest()[:16]


def read_examples(files: list[Path], tokenizer: Any, max_len: int) -> Iterator[Example]:
    """Every example of every file, tokenized (long ones cut to `max_len` tokens; text files in windows)."""
    for path in files:
        found = 0
        if path.suffix == ".jsonl":
            for line_no, record in _records(path):
                ids, loss = encode_record(record, tokenizer, f"{path}:{line_no}")
                if len(ids) >= MIN_TOKENS and any(loss):
                    found += 1
                    yield Example(ids[:max_len], loss[:max_len], f"{path}:{line_no}")
        else:
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise SpecdecodeError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            ids = tokenizer.encode(text, add_special_tokens=False)
            for start in range(0, len(ids), max_len):
                window = ids[start : start + max_len]
                if len(window) >= MIN_TOKENS:
                    found += 1
                    yield Example(window, [True] * len(window), f"{path}:token {start}")
        if found == 0:
            raise SpecdecodeError(f"{path}: no training examples in it (empty, or every record shorter than "
                                  f"{MIN_TOKENS} tokens)")


def _records(path: Path) -> Iterator[tuple[int, dict]]:
    for line_no, record in read_jsonl(path):
        if not isinstance(record, dict):
            raise SpecdecodeError(f"{path}:{line_no}: expected a JSON object, got {type(record).__name__}")
        yield line_no, record


def encode_record(record: dict, tokenizer: Any, where: str) -> tuple[list[int], list[bool]]:
    """One JSONL record -> (ids, loss mask)."""
    if "messages" in record:
        return encode_chat(_messages(record["messages"], where), tokenizer, where)
    if "prompt" in record and ("response" in record or "completion" in record):
        answer = record.get("response", record.get("completion"))
        if not isinstance(record["prompt"], str) or not isinstance(answer, str):
            raise SpecdecodeError(f"{where}: 'prompt' and 'response' must be strings")
        if getattr(tokenizer, "chat_template", None):
            chat = [{"role": "user", "content": record["prompt"]}, {"role": "assistant", "content": answer}]
            return encode_chat(chat, tokenizer, where)
        head = tokenizer.encode(record["prompt"], add_special_tokens=False)
        tail = tokenizer.encode(answer, add_special_tokens=False)
        return head + tail, [False] * len(head) + [True] * len(tail)
    if "text" in record:
        if not isinstance(record["text"], str):
            raise SpecdecodeError(f"{where}: 'text' must be a string")
        ids = tokenizer.encode(record["text"], add_special_tokens=False)
        return ids, [True] * len(ids)
    raise SpecdecodeError(f"{where}: a record needs 'messages', 'prompt' + 'response', or 'text' "
                          f"(found keys: {', '.join(sorted(record)) or 'none'})")


def _messages(messages: Any, where: str) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise SpecdecodeError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise SpecdecodeError(f"{where}: every message needs a string 'role' and 'content'")
    if not any(m["role"] == "assistant" for m in messages):
        raise SpecdecodeError(f"{where}: no assistant message to learn from")
    return messages


def encode_chat(messages: list[dict], tokenizer: Any, where: str) -> tuple[list[int], list[bool]]:
    """Render a conversation with the chat template; the loss covers each assistant turn's text and its end
    marker. Each assistant turn's span is found by rendering the conversation up to it (with and without it)."""
    if not getattr(tokenizer, "chat_template", None):
        raise SpecdecodeError(f"{where}: chat 'messages' need a target with a chat template; use 'text' records")
    render = lambda msgs, prompt: tokenizer.apply_chat_template(msgs, tokenize=False,  # noqa: E731
                                                               add_generation_prompt=prompt)
    text = render(messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before, through = render(messages[:i], True), render(messages[: i + 1], False)
        if text.startswith(through) and through.startswith(before):
            spans.append((len(before), len(through)))
    if not spans:  # a template that rewrites earlier turns: learn the whole text rather than nothing
        spans = [(0, len(text))]
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    loss = [any(a <= start < b for a, b in spans) for start, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), loss


def sample(examples: Iterator[Example], max_tokens: int, seed: int = 0,
           eval_share: float = EVAL_SHARE) -> tuple[list[Example], list[Example]]:
    """A shuffled sample of at most `max_tokens` tokens -> (train, held back). Every example is read first so
    the sample mixes all files; the held-back share is at least one example."""
    pool = list(examples)
    random.Random(seed).shuffle(pool)
    picked, total = [], 0
    for ex in pool:
        if total >= max_tokens:
            break
        picked.append(ex)
        total += len(ex.ids)
    if len(picked) < 2:
        raise SpecdecodeError(f"the data gave {len(picked)} example(s): at least 2 are needed (one is held back "
                              "to measure acceptance); add data")
    held = max(1, round(len(picked) * eval_share))
    return picked[held:], picked[:held]
