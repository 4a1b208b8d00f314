"""The one exception type the library raises for problems a user can fix.

Every message is a single line that names what went wrong and how to fix it, so the CLI can print it
without a traceback.
"""

from __future__ import annotations


class SpecdecodeError(Exception):
    """A user-facing error: bad input, missing model, corrupt file. The message says what to do."""
