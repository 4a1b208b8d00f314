"""Server settings: one plain record built from the `serve` flags (or by hand in tests and notebooks)."""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.errors import SpecdecodeError


@dataclass
class ServerSettings:
    model_name: str  # the name clients put in "model"; /v1/models lists it
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <api_key>"
    max_waiting: int = 64  # requests queued behind the running one; more get 503 until the queue drains
    max_body_bytes: int = 1_000_000  # larger request bodies get 413 before they are parsed
    max_draft_tokens: int = 16  # upper bound for the per-request `num_draft_tokens` extension
    completion_default_max_tokens: int = 16  # OpenAI's default for /v1/completions; chat defaults to the window

    def __post_init__(self) -> None:
        if self.max_waiting < 0:
            raise SpecdecodeError(f"--max-waiting must be >= 0, got {self.max_waiting}")
        if self.max_body_bytes < 1024:
            raise SpecdecodeError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
