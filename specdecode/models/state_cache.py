"""The cache of a model with recurrent layers (Qwen3-Next's gated DeltaNet beside attention): keys and values for
the attention layers, and for the recurrent layers the state after each recent token.

Speculation rolls a cache back to the accepted prefix (`truncate`) or compacts a tree's accepted path (`keep`).
Keys and values allow it by slot; a recurrent state does not, it is one running value. So each forward keeps, per
new row, the state after that row (its conv window and its recurrent matrix), filed under the row's cache slot as
keys are: `truncate(n)` takes the state filed under slot n - 1, `keep` moves states with their slots. The states
are the ones the forward computes anyway (the update makes a new tensor per row): filing them copies nothing.

Only the KEPT_STATES highest slots keep a state (an 80B model's are tens of megabytes a row): a verify forward, or
a draft model's draft and the prefix it rolls back to, is far fewer rows; a long prompt's forward files its last
rows. Rolling back further than that is refused, with a clear error, never silently wrong. A cache that never ran
holds zero states at any length, as a KV cache holds zero keys (what a cost measurement truncates to and times).

It is not a KVCache: the prompt cache and the copy of a leader's prefill move keys and values only, so the engine
leaves such caches alone (they prefill on their own), as it does transformers' caches.
"""

from __future__ import annotations

import torch

from specdecode.models.kv_cache import KVCache

KEPT_STATES = 64  # slots whose recurrent states are kept: a verify forward's rows and some to spare

LayerState = tuple[torch.Tensor, torch.Tensor]  # (conv window [B, C, kernel - 1], recurrent state [B, H, dk, dv])


class StateCache:
    """Keys and values of `kv_layers` attention layers, and the states of `recurrent_layers` recurrent layers."""

    def __init__(self, kv_layers: int, batch: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str, recurrent_layers: int) -> None:
        self.kv = KVCache(kv_layers, batch, num_kv_heads, max_len, head_dim, dtype, device)
        self.recurrent_layers = recurrent_layers
        self.states: dict[int, list[LayerState | None]] = {}  # slot -> each recurrent layer's state after it
        self.zero_at: int | None = None  # a length where a cache that never ran was cut: zero states there

    # What the attention layers and the engine read of a KV cache
    @property
    def k(self) -> torch.Tensor:
        return self.kv.k

    @property
    def v(self) -> torch.Tensor:
        return self.kv.v

    @property
    def max_len(self) -> int:
        return self.kv.max_len

    @property
    def length(self) -> int:
        return self.kv.length

    @length.setter
    def length(self, value: int) -> None:
        self.kv.length = value

    @property
    def cpu_native(self) -> bool:
        return self.kv.cpu_native

    @property
    def cpu_contiguous(self) -> bool:
        return self.kv.cpu_contiguous

    def state(self, length: int, layer: int) -> LayerState | None:
        """Recurrent layer `layer`'s state after the first `length` tokens (None: the zero state, before any)."""
        if length == 0:
            return None
        kept = self.states.get(length - 1)
        if kept is not None and kept[layer] is not None:
            return kept[layer]
        if length == self.zero_at:
            return None
        raise ValueError(f"no recurrent state is kept at length {length} (only the last {KEPT_STATES} slots' are)")

    def file(self, slot: int, layer: int, state: LayerState) -> None:
        """Layer `layer`'s state after the token at `slot` (written by a forward, in layer order)."""
        self.states.setdefault(slot, [None] * self.recurrent_layers)[layer] = state

    def start_rows(self, base: int, count: int) -> int:
        """A forward writes slots [base, base + count): the states it replaces and those past it are dropped, and
        the oldest beyond KEPT_STATES (never the one it starts from) -> the first of its rows to file a state."""
        for slot in [s for s in self.states if s >= base]:
            del self.states[slot]
        if self.zero_at is not None and base < self.zero_at:  # written over
            self.zero_at = None
        older = sorted(s for s in self.states if s != base - 1)
        room = max(KEPT_STATES - count, 0)
        for slot in older[: max(len(older) - room, 0)]:
            del self.states[slot]
        return max(count - KEPT_STATES, 0)

    def truncate(self, length: int) -> None:
        if self.recurrent_layers and not self.states:
            self.zero_at = length  # never ran: zero states stand for the tokens, as zero keys do
        elif self.recurrent_layers:  # refused here, not at the next forward
            self.state(length, 0)
        self.kv.truncate(length)

    def keep(self, indices: list[int]) -> None:
        """KVCache.keep, the states moving with their slots; the state is then the last kept slot's."""
        start = self.length
        moved = {to: self.states.get(at) for to, at in enumerate(indices, start)}
        self.kv.keep(indices)
        for slot in [s for s in self.states if s >= start]:
            del self.states[slot]
        self.states.update({to: state for to, state in moved.items() if state is not None})
        if self.recurrent_layers:
            self.state(self.length, 0)

    def grow(self, max_len: int) -> None:
        self.kv.grow(max_len)

    def reset(self) -> None:
        self.kv.reset()
        self.states.clear()
        self.zero_at = None
