"""Keys and values of recent prompts, so that a request starts from the longest prefix it shares with one of them.

Chat clients send the whole conversation every turn, and most requests begin with the same system prompt: those
tokens' keys and values were computed before. A new request copies them (a memory copy, ~57 KB a token for the
1.5B target) and prefills only the rest. A prompt token costs the target ~13 ms on a 2-core CPU, so a second turn
after a 300-token first turn and answer starts ~4 s sooner.

The engine keeps each finished request's prompt and answer together (a chat's next turn starts with both), and a
running request's prompt as soon as another request arrives that may share it (or as it leaves, cancelled). Exact
by construction where it is used: only where every row is computed as its own one-token forward would compute it
(engine.prompt_decode: on the CPU, prompt chunks and verify rows alike, a tree node's row over its path's slots in
the path's order; tests/test_engine.py checks a request's cache against a fresh prefill after every step), so the
copied keys and values are bit for bit the ones this request's own prefill would write. A draft model keeps its prompts the same way, and its answers where it read the whole
prompt; its numbers never change the output.

Bounded in memory (`max_mb`): the least recently used prompts leave first, and a prompt that is a prefix of a newer
one is dropped, since the newer one serves it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specdecode.errors import SpecdecodeError
from specdecode.models.kv_cache import KVCache

DEFAULT_PROMPT_CACHE_MB = 256.0  # ~4,600 prompt tokens of the 1.5B target (float32 keys and values)
# A draft model's: its window of a prompt (~3 MB for the 0.5B), or a whole chat turn with its answer (~6-12 MB)
DRAFT_PROMPT_CACHE_MB = 64.0


@dataclass(eq=False)  # compared by identity (list.remove)
class _Prompt:
    tokens: np.ndarray  # int64 [n]
    k: torch.Tensor  # [layers, 1, kv_heads, n, head_dim]
    v: torch.Tensor

    @property
    def nbytes(self) -> int:
        return self.k.nbytes + self.v.nbytes + self.tokens.nbytes


def check_size(max_mb: float) -> None:
    """Reject a negative size (before any model loads, where a size comes from a user)."""
    if max_mb < 0:
        raise SpecdecodeError(f"--prompt-cache-mb must be 0 (off) or more (got {max_mb})")


class PromptCache:
    def __init__(self, max_mb: float = DEFAULT_PROMPT_CACHE_MB) -> None:
        check_size(max_mb)
        self.max_bytes = int(max_mb * 2**20)
        self.prompts: list[_Prompt] = []  # least recently used first

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.prompts)

    def snapshot(self) -> list[_Prompt]:
        """What it holds now (the kept prompts are never changed in place): a benchmark runs every repeat of a
        prompt from the same memory, as for the drafters' (Drafter.memories)."""
        return list(self.prompts)

    def restore(self, state: list[_Prompt]) -> None:
        self.prompts = list(state)

    def reuse(self, cache: KVCache, tokens: list[int], limit: int) -> int:
        """Copy the keys and values of the longest prefix of `tokens` (at most `limit` tokens) that a kept prompt
        starts with into `cache`, from position 0 -> how many (0: none). The cache must hold `limit` positions."""
        best, length = self._longest(tokens, limit)
        if best is None:
            return 0
        cache.k[:, :, :, :length] = best.k[:, :, :, :length]
        cache.v[:, :, :, :length] = best.v[:, :, :, :length]
        cache.truncate(length)
        self._used(best)
        return length

    def shared(self, tokens: list[int], limit: int) -> int:
        """How many leading tokens of `tokens` (at most `limit`) `reuse` would copy now."""
        return self._longest(tokens, limit)[1]

    def _longest(self, tokens: list[int], limit: int) -> tuple[_Prompt | None, int]:
        """The kept prompt sharing the longest prefix with `tokens[:limit]`, and that prefix's length."""
        if not self.prompts or limit <= 0:
            return None, 0
        ids = np.asarray(tokens[:limit], dtype=np.int64)
        best, length = None, 0
        for prompt in self.prompts:
            shared = common_prefix(prompt.tokens, ids)
            if shared > length:
                best, length = prompt, shared
        return best, length

    def store(self, tokens: list[int], cache: KVCache) -> bool:
        """Keep the keys and values of `tokens` (a prompt, or a prompt and its answer), positions [0, len(tokens)) of
        `cache` -> whether they are kept (not: too large, or the cache is off)."""
        n = len(tokens)
        if n == 0 or self.max_bytes == 0:
            return False
        ids = np.asarray(tokens, dtype=np.int64)
        for prompt in self.prompts:
            if len(prompt.tokens) >= n and common_prefix(prompt.tokens, ids) == n:
                self._used(prompt)  # already kept, within a longer one
                return True
        k, v = cache.k[:, :, :, :n], cache.v[:, :, :, :n]  # views: a prompt too large for the cache is not copied
        if k.nbytes + v.nbytes + ids.nbytes > self.max_bytes:
            return False
        entry = _Prompt(ids, k.clone(), v.clone())
        self.prompts = [p for p in self.prompts if common_prefix(p.tokens, ids) < len(p.tokens)]
        self.prompts.append(entry)
        while self.nbytes > self.max_bytes:
            self.prompts.pop(0)
        return True

    def _used(self, prompt: _Prompt) -> None:
        """`prompt` was used now: it leaves last."""
        self.prompts.remove(prompt)
        self.prompts.append(prompt)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens two id arrays share."""
    m = min(len(a), len(b))
    differ = np.flatnonzero(a[:m] != b[:m])
    return int(differ[0]) if differ.size else m
