"""Sliding-window attention (Gemma 3's local layers): a query at position p sees keys at positions (p - window, p].

The KV cache keeps every slot; a local layer only narrows what each row reads, so rollback and tree compaction stay
as they are (a cache sized by the window is left for later). The window is counted along rotary positions: a
cached slot's position is its index, a new row's is its own (a tree node's, its depth after the prefix), and the
tree mask has already kept each node to its ancestors.

A forward's segments are narrowed once (`windowed_segments`), then every local layer attends over them: decode rows
get a first slot per row (RowSlots.starts), a masked forward a narrower mask.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F

from specdecode.models.parts import RowSlots, Segment


def windowed_segments(segments: list[Segment], positions: torch.Tensor, window: int) -> list[Segment]:
    """`segments` as a local layer reads them: each row's slots or mask cut to its window. `positions` [B, N]: the
    rotary positions of the forward's rows (a ragged forward's, B = 1)."""
    out = []
    for s in segments:
        at = positions[:, s.begin : s.end]  # [B, t]
        if s.rows is not None:
            out.append(replace(s, rows=window_rows(s.rows, at[0].tolist(), s.cache.length, window)))
        else:
            out.append(replace(s, attn_mask=window_mask(s.attn_mask, at, s.write_pos, window)))
    return out


def window_rows(rows: RowSlots, positions: list[int], base: int, window: int) -> RowSlots:
    """Decode rows' slots cut to the window. `positions`: each row's; `base`: the slot of the first new row (slots
    below it hold positions equal to their index). The leading run [0, span) is a run of positions equal to its
    slots, so its cut is a first slot; extra (tree ancestor) slots are kept by their positions. Unchanged, the same
    object, where no row reaches past its window (no row then leaves the native kernel's plain path)."""
    starts, extras, cut = [], [], False
    for t, p in enumerate(positions):
        first = p - window + 1  # the oldest position it sees
        span = rows.spans[t]
        start = min(max(rows.first(t), first, 0), span)
        cut |= start > 0
        kept = rows.extras[t] if rows.extras else []
        if kept and first > 0:
            kept = [e for e in kept if (e if e < base else positions[e - base]) >= first]
            cut |= len(kept) != len(rows.extras[t])
        starts.append(start)
        extras.append(kept)
    if not cut:
        return rows
    return RowSlots(rows.spans, extras if any(extras) else [], starts)


def window_mask(mask: torch.Tensor, positions: torch.Tensor, write_pos: torch.Tensor, window: int) -> torch.Tensor:
    """A forward's mask [B or 1, 1, t, S] cut to the window: slot j holds position j, except the new rows' slots
    `write_pos` [t], which hold `positions` [B, t] (no host read: a CUDA graph captures this)."""
    width = mask.shape[-1]
    slot_positions = torch.arange(width, device=mask.device)
    slot_positions = slot_positions.index_copy(0, write_pos, positions[0].to(slot_positions.dtype))  # [S]
    near = slot_positions[None, None, None, :] > positions[:, None, :, None] - window  # [B, 1, t, S]
    return mask & near


def windowed_decode_attention(native, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                              rows: RowSlots) -> torch.Tensor:
    """Decode rows with first slots (window_rows) on the native kernel, which reads each row's slots from 0: rows
    whose window starts at 0 go in one call, as they would without a window; any other row alone, over the cache
    seen from its first slot (a view the kernel takes where it is contiguous: one batch row and one KV head), else
    through torch. Each row's operations depend on that row alone, so a verify forward's rows are its one-token
    forwards'. q [B, H, T, hd] float32 -> [B, H, T, hd]."""
    T = q.shape[2]
    whole = [t for t in range(T) if rows.first(t) == 0]
    out: list[torch.Tensor | None] = [None] * T
    if whole:
        part = q if len(whole) == T else q[:, :, whole].contiguous()
        extras = [rows.extras[t] for t in whole] if rows.extras else []
        done = native.decode_attention(part, k_cache, v_cache, [rows.spans[t] for t in whole], extras)
        for i, t in enumerate(whole):
            out[t] = done[:, :, i : i + 1]
    for t in range(T):
        if out[t] is not None:
            continue
        start, span = rows.first(t), rows.spans[t]
        extras = rows.extras[t] if rows.extras else []
        offset = start if start < span else extras[0]  # the row's first slot
        keys, values = k_cache[:, :, offset:], v_cache[:, :, offset:]
        row = q[:, :, t : t + 1].contiguous()
        if keys.is_contiguous() and values.is_contiguous():
            run = span - start if start < span else 1  # slots from the first that the row reads in a run
            later = [e - offset for e in (extras if start < span else extras[1:])]
            out[t] = native.decode_attention(row, keys, values, [run], [later] if later else [])
        else:
            slots = rows.slots(t, q.device)
            out[t] = F.scaled_dot_product_attention(row, k_cache[:, :, slots].to(q.dtype),
                                                    v_cache[:, :, slots].to(q.dtype), enable_gqa=True)
    return torch.cat(out, dim=2)
