"""Reading JSONL files (bench datasets, training data): each non-blank line one JSON value, a bad line named by
file and line number in one clear error."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from specdecode.errors import SpecdecodeError


def read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, value) for every non-blank line of `path`."""
    with open(path, encoding="utf-8") as file:
        for line_no, line in enumerate(file, 1):
            if not line.strip():
                continue
            try:
                yield line_no, json.loads(line)
            except json.JSONDecodeError as e:
                raise SpecdecodeError(f"{path}:{line_no}: not valid JSON ({e.msg} at column {e.colno})") from None
