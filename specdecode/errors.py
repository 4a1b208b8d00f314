"""The one exception type the library raises for problems a user can fix.

Every message is a single line that names what went wrong and how to fix it, so the CLI can print it
without a traceback.
"""

from __future__ import annotations

import importlib.util


class SpecdecodeError(Exception):
    """A user-facing error: bad input, missing model, corrupt file. The message says what to do. `field`: the
    request field at fault where one is (the server's error names it as OpenAI's `param`), `code`: a machine-readable
    kind (e.g. "context_length_exceeded")."""

    def __init__(self, message: str, field: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.field = field
        self.code = code


def require(module: str, extra: str, what: str) -> None:
    """Raise a SpecdecodeError naming the extra to install when an optional dependency is missing."""
    if importlib.util.find_spec(module) is None:
        raise SpecdecodeError(f"{what} needs the '{extra}' extra: pip install 'specdecode[{extra}]' "
                              f"(the module {module} is missing)")
