"""What one forward takes per sequence: a `Part` (its new tokens, their rotary positions, its cache and which slots
each row attends to), made for a chain by `chain_part`; a `Segment` is a part's rows inside a ragged forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.models.kv_cache import KVCache


@dataclass(slots=True)
class RowSlots:
    """The cache slots each query row of a decode step attends to: [starts[t], spans[t]), then extras[t] in order."""

    spans: list[int]
    extras: list[list[int]]  # empty for a chain: every row's slots are a prefix
    starts: list[int] | None = None  # a sliding window's first slot per row (models/windows.py); None: all 0

    def first(self, t: int) -> int:
        return 0 if self.starts is None else self.starts[t]

    def slots(self, t: int, device: torch.device) -> torch.Tensor:
        head = torch.arange(self.first(t), self.spans[t], device=device)
        return torch.cat((head, torch.tensor(self.extras[t], dtype=torch.long, device=device))) if self.extras else head


@dataclass(slots=True)
class Segment:
    """The rows [begin, end) of a forward that belong to one sequence, and where that sequence's keys live."""

    begin: int
    end: int
    cache: KVCache
    write_pos: torch.Tensor | None  # [end - begin] cache slots of the new tokens (None where the native layers run)
    attn_mask: torch.Tensor | None  # [B or 1, 1, end - begin, S]; None where rows are given
    rows: RowSlots | None  # decode mode: each row's slots; None = one attention call under attn_mask
    mask_rows: bool = False  # rows None: one attention call per row, each under its own row of attn_mask


class Part:
    """One sequence's share of a ragged forward (forward_parts): t new tokens after cache.length cached ones.

    Its token ids and rotary positions come as tensors [t], or as lists: a step's parts are made from lists, and
    the native decode layers take them as lists, so no tensor is made for them between two forwards (two tensors,
    or one and its two rows, cost ~40 us on the caches a forward flushed). `tokens` and `positions` make the
    tensors, on `device`, where a forward needs them (the Python layers, a GPU's graphs)."""

    __slots__ = ("_tokens", "_positions", "id_list", "position_list", "count", "device", "cache", "attn_mask",
                 "logits_from", "decode", "rows", "wants_argmax", "row_argmax")

    def __init__(self, tokens: torch.Tensor | list[int], positions: torch.Tensor | list[int], cache: KVCache,
                 attn_mask: torch.Tensor | None, logits_from: int = 0, decode: bool = True,
                 rows: RowSlots | None = None, device: torch.device | str | None = None) -> None:
        """`attn_mask` [1, 1, t, S] bool; None: built from `rows` where a forward needs it (mask()). `logits_from`:
        logits only for rows [logits_from, t). `decode`: rows computed as one-token forwards would (a prompt may
        go faster without). `rows`: each row's slots where the caller knows them (a chain), else read off the
        mask. `device`: where lists' tensors are made (default: the cache's)."""
        if isinstance(tokens, list):
            self.id_list, self.position_list, self._tokens, self._positions = tokens, positions, None, None
            self.device = cache.k.device if device is None else device
            self.count = len(tokens)
        else:
            self.id_list = self.position_list = None
            self._tokens, self._positions, self.device, self.count = tokens, positions, tokens.device, tokens.numel()
        self.cache, self.attn_mask, self.logits_from = cache, attn_mask, logits_from
        self.decode, self.rows = decode, rows
        # Greedy verification reads only each row's argmax of its logits: asked for, the LM head finds it as it
        # writes them (forward_parts sets row_argmax [t - logits_from], where the head can and no row holds a NaN)
        self.wants_argmax = False
        self.row_argmax: torch.Tensor | None = None

    @property
    def tokens(self) -> torch.Tensor:  # [t]
        return self._tensors()[0]

    @property
    def positions(self) -> torch.Tensor:  # [t] rotary positions
        return self._tensors()[1]

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tokens is None:  # made from the lists, once
            self._tokens, self._positions = ids_and_positions(self.id_list, self.position_list, self.device)
        return self._tokens, self._positions

    def mask(self) -> torch.Tensor:
        """The attention mask [1, 1, t, S]: as given, or built from `rows`. The CPU's decode rows attend by their
        slots and never read it; a step's parts skip building it (a few tensor operations each)."""
        if self.attn_mask is None:
            self.attn_mask = rows_mask(self.rows, self.device)
        return self.attn_mask


def chain_part(tokens: torch.Tensor | list[int], cache: KVCache, logits_from: int = 0, decode: bool = True,
               start: int | None = None, device: torch.device | None = None) -> Part:
    """`tokens` [t] as a chain after `start` (default: the cache's length) tokens: row j at position start + j sees
    slots [0, start + j]. Its rows' slots come with it (reading them off the mask costs a few tensor operations).
    Tokens as a list: its tensors, where a forward needs them, made on `device` (default: the cache's)."""
    start, count = cache.length if start is None else start, len(tokens)
    if isinstance(tokens, list):
        positions = list(range(start, start + count))
    else:
        positions = torch.arange(start, start + count, device=tokens.device)
    rows = RowSlots(list(range(start + 1, start + count + 1)), [])
    return Part(tokens, positions, cache, None, logits_from, decode, rows, device)


def ids_and_positions(ids: list[int], positions: list[int], device: torch.device | str) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    """A forward's token ids and rotary positions [t] each, made as one tensor (its two rows, contiguous views):
    between two forwards each tensor made costs ~10 us on the caches a forward flushed."""
    both = torch.tensor([ids, positions], dtype=torch.long, device=device)
    return both[0], both[1]


def rows_mask(rows: RowSlots, device: torch.device | str = "cpu") -> torch.Tensor:
    """Each row's slots -> the mask [1, 1, T, S] that shows them, S one past the last slot any row sees (each row
    sees its own slot, the last row's the last one): chain_mask or tree_mask of the same rows."""
    width = max(max(rows.spans), max((e[-1] + 1 for e in rows.extras if e), default=0))
    mask = torch.zeros(len(rows.spans), width, dtype=torch.bool)
    for t, span in enumerate(rows.spans):
        mask[t, :span] = True
    if rows.extras:
        cells = [(t, slot) for t, extra in enumerate(rows.extras) for slot in extra]
        mask[[t for t, _ in cells], [slot for _, slot in cells]] = True
    return mask.to(device)[None, None]


def row_slots(attn_mask: torch.Tensor) -> RowSlots:
    """[B, 1, T, S] mask (shared by the batch) -> each row's slots: the leading run of allowed slots, then the rest
    in ascending order. A tree node's ancestors ascend along its path, so that order is the path's order: the row
    attends over exactly the slots, in exactly the order, a one-token forward of that path would."""
    rows = attn_mask[0, 0]  # [T, S]
    spans = rows.int().cumprod(-1).sum(-1)  # [T] length of each row's leading run
    leading = torch.arange(rows.shape[-1], device=rows.device) < spans[:, None]
    rest = rows & ~leading
    if not bool(rest.any()):
        return RowSlots(spans.tolist(), [])
    row_of, slot = rest.nonzero(as_tuple=True)
    extras: list[list[int]] = [[] for _ in range(rows.shape[0])]
    for r, s in zip(row_of.tolist(), slot.tolist()):
        extras[r].append(s)
    return RowSlots(spans.tolist(), extras)
