"""A finished request's key/value cache, kept for the next request of the same model.

A new cache is megabytes of fresh memory (the 1.5B target: 57 KB a token, 256 slots at the least): allocating and
zeroing it cost 1-4 ms on a 2-core EPYC, and growing it mid-answer ~2.5 ms more, paid by every request. A request
that follows another (the CLI, a benchmark, a server between bursts) takes the last one's buffers instead. Slots
past a cache's length are garbage that the next forward overwrites, within a request as much as across two
(kv_cache.KVCache.truncate): a cache taken here computes what a fresh one does.
"""

from __future__ import annotations

import torch

from specdecode.models.kv_cache import KVCache


class SpareCache:
    """At most one cache, given back by a finished request and lent to the next one whose slots it holds."""

    def __init__(self) -> None:
        self.cache: KVCache | None = None

    def take(self, model: torch.nn.Module, slots: int) -> KVCache:
        """An empty cache of at least `slots` slots for `model`: the spare if it holds that many (it may hold more:
        a KV budget counts its `max_len`), else a new one. A spare not taken is dropped: it would only hold
        memory."""
        spare, self.cache = self.cache, None
        if (spare is not None and slots <= spare.max_len
                and (torch.is_inference_mode_enabled() or not spare.k.is_inference())):  # writable here
            spare.reset()
            return spare
        return model.new_cache(1, slots)

    def give(self, model: torch.nn.Module, cache: object) -> None:
        """`cache` is no longer read or written by its request. Not one a model's CUDA graphs lent (theirs to
        reuse) or a cache of another kind (transformers')."""
        if type(cache) is KVCache and getattr(model, "graphs", None) is None:
            self.cache = cache
