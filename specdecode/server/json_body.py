"""A request body's bytes -> its JSON object, refused with a 400 for what the JSON parser lets through but nothing
after it can use.

- Lone UTF-16 surrogates: JSON allows the escape `"\\ud800"` alone, Python keeps it in the string, and then no
  UTF-8 encoder (the tokenizer, the JSON error response itself) can write it.
- Integers of more digits than Python converts to int (sys.get_int_max_str_digits(), 4300 by default): the parser
  would raise in the middle of the body.
- NaN, Infinity and -Infinity: not JSON, though the parser takes them; a bounded field would refuse them with a
  message about its bounds, and one without bounds (a tool's schema) would pass them on.
All three are looked for in the whole body, ignored fields included, and the error names the field where it is.
"""

from __future__ import annotations

import json
import re
from typing import Any

from specdecode.server.errors import ApiError

# A surrogate can only arrive as a \uD800-\uDFFF escape or as its raw UTF-8-style bytes (json.loads decodes bytes
# with 'surrogatepass'); a body with neither skips the walk.
MAYBE_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


class HugeInteger:
    """Stands in for an integer the parser could not convert, so that the walk can say where it was."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


class NonFinite:
    """Stands in for NaN or an infinity, so that the walk can say where it was."""

    def __init__(self, name: str) -> None:
        self.name = name


def load_json(raw: bytes) -> Any:
    """The parsed body; ApiError(400) for malformed JSON, lone surrogates, oversized integers, NaN and infinities."""
    unusable: list[HugeInteger | NonFinite] = []

    def parse_int(digits: str) -> int | HugeInteger:
        try:
            return int(digits)
        except ValueError:  # more digits than int() takes
            unusable.append(HugeInteger(len(digits.lstrip("-"))))
            return unusable[-1]

    def parse_constant(name: str) -> NonFinite:
        unusable.append(NonFinite(name))
        return unusable[-1]

    try:
        body = json.loads(raw, parse_int=parse_int, parse_constant=parse_constant)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None
    except RecursionError:
        raise ApiError(400, "the request body is JSON nested too deeply") from None
    if unusable or MAYBE_SURROGATE.search(raw) or json.detect_encoding(raw) != "utf-8":  # UTF-16/32: walk every time
        check_values(body)
    return body


def check_values(body: Any) -> None:
    """ApiError(400) at the first lone surrogate (in a string or a key), HugeInteger or NonFinite, naming its path.
    Walked with a stack, not recursion: the body may be nested as deeply as the parser allowed."""
    stack: list[tuple[tuple, Any]] = [((), body)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                if (at := _surrogate_at(key)) is not None:
                    _refuse_surrogate((*path, key), key, at, "key")
                stack.append(((*path, key), item))
        elif isinstance(value, list):
            stack.extend(((*path, i), item) for i, item in enumerate(value))
        elif isinstance(value, str):
            if (at := _surrogate_at(value)) is not None:
                _refuse_surrogate(path, value, at, "text")
        elif isinstance(value, HugeInteger):
            raise ApiError(400, f"{_dotted(path)}: an integer of {value.digits} digits is more than any field takes",
                           _param(path))
        elif isinstance(value, NonFinite):
            raise ApiError(400, f"{_dotted(path)}: {value.name} is not a JSON number: send a finite number",
                           _param(path))


def _surrogate_at(text: str) -> int | None:
    try:
        text.encode("utf-8")
        return None
    except UnicodeEncodeError as e:
        return e.start


def _refuse_surrogate(path: tuple, text: str, at: int, what: str) -> None:
    raise ApiError(400, f"{_dotted(path)}: the {what} holds a lone UTF-16 surrogate (\\u{ord(text[at]):04x} at "
                        f"character {at}), which is not valid Unicode: send UTF-8 text (an escaped surrogate must "
                        "be half of a pair)", _param(path))


def _dotted(path: tuple) -> str:
    """("messages", 0, "content") -> "messages.0.content" (error_body escapes a key's surrogate)."""
    return ".".join(str(p) for p in path) or "body"


def _param(path: tuple) -> str | None:
    return str(path[0]) if path else None
