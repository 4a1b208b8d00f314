"""specdecode: lossless speculative decoding for self-hosted LLMs."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Loaded on first use, not at `import specdecode`: the command line imports this package before it can take
# Ctrl-C quietly (cli.main), and torch, which api.py brings in, is most of a start's first seconds.
_EXPORTS = {"Generation": "specdecode.api", "SpecDecoder": "specdecode.api", "TextChunk": "specdecode.api",
            "SamplingParams": "specdecode.config", "SpecdecodeError": "specdecode.errors"}

if TYPE_CHECKING:
    from specdecode.api import Generation, SpecDecoder, TextChunk
    from specdecode.config import SamplingParams
    from specdecode.errors import SpecdecodeError

__all__ = ["Generation", "SamplingParams", "SpecDecoder", "SpecdecodeError", "TextChunk"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'specdecode' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
