"""Server settings: one plain record built from the `serve` flags (or by hand in tests and notebooks)."""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.errors import SpecdecodeError


@dataclass
class ServerSettings:
    model_name: str  # the name clients put in "model"; /v1/models lists it
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <api_key>"
    api_keys: tuple[str, ...] = ()  # more accepted keys (--api-key-file); fairness and limits count per key
    protect_metrics: bool = False  # /metrics needs a key too
    allowed_hosts: tuple[str, ...] = ("*",)  # Host headers served (others: 400): a loopback server names its own
    allowed_origins: tuple[str, ...] = ()  # web origins whose pages may call the API (CORS); none by default
    trusted_proxies: tuple[str, ...] = ()  # peers whose X-Forwarded-For names the client
    max_waiting: int = 64  # requests queued beyond those the batch can start at once; more get 503
    max_running: int = 16  # requests in the batch at once (one engine step serves them all)
    max_per_client: int = 32  # requests one client (peer address) may hold, running and waiting; more get 429
    client_prompt_tokens_per_minute: int | None = None  # prompt tokens one client may send a minute (budgets.py)
    kv_cache_gib: float = 4.0  # keys and values the running requests may reserve together
    replica: str | None = None  # this server's name among replicas (Ray Serve), a label on its metrics
    keepalive_s: float = 10.0  # an SSE comment this often while a stream waits, so proxies keep it open
    max_body_bytes: int = 1_000_000  # larger request bodies get 413 before they are parsed
    max_draft_tokens: int = 16  # upper bound for the per-request `num_draft_tokens` extension
    completion_default_max_tokens: int = 16  # OpenAI's default for /v1/completions; chat defaults to the window
    request_timeout_s: float | None = None  # a request not done this long after it arrived ends with a 504
    body_timeout_s: float = 30.0  # a request body that has not all arrived by then gets 408 (a slow-loris client)

    @property
    def keys(self) -> tuple[str, ...]:
        """Every accepted API key (none: the API is open)."""
        return tuple(dict.fromkeys(k for k in (self.api_key, *self.api_keys) if k))

    def __post_init__(self) -> None:
        if self.max_waiting < 0:
            raise SpecdecodeError(f"--max-waiting must be >= 0, got {self.max_waiting}")
        for name in ("max_running", "max_per_client"):
            if getattr(self, name) < 1:
                raise SpecdecodeError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.client_prompt_tokens_per_minute is not None and self.client_prompt_tokens_per_minute < 1:
            raise SpecdecodeError("--client-prompt-tokens-per-minute must be >= 1, got "
                                  f"{self.client_prompt_tokens_per_minute}")
        if not self.kv_cache_gib > 0 or not self.keepalive_s > 0:
            raise SpecdecodeError("--kv-cache-gib and the keep-alive interval must be > 0")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0 or not self.body_timeout_s > 0:
            raise SpecdecodeError("--request-timeout and the body timeout must be > 0")
        if self.max_body_bytes < 1024:
            raise SpecdecodeError(f"--max-body-bytes must be >= 1024, got {self.max_body_bytes}")
