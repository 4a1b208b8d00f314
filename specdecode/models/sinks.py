"""Attention with sinks (gpt-oss): each head has a learned logit that joins its softmax's denominator and carries no
value, so a query may attend to "nothing" and its weights over the keys sum to less than one.

The native attention kernel has no such term, so these layers attend through torch. Decode rows go one query per
call over exactly the slots that row reads (its window and tree ancestors included), the call a one-token forward
of that row makes: a verify forward's rows agree with one-token forwards whatever else is in the forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from specdecode.models.parts import RowSlots


def sink_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, sinks: torch.Tensor,
                   mask: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, H, T, hd], keys and values [B, Hkv, S, hd] (query head h reads key head h // (H / Hkv)), sinks [H],
    mask [B or 1, 1, T, S] bool (True = may attend) or None -> [B, H, T, hd]."""
    B, H, T, hd = q.shape
    groups = H // keys.shape[1]
    if groups > 1:
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * hd**-0.5  # [B, H, T, S]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    sink = sinks.to(scores.dtype).view(1, H, 1, 1).expand(B, H, T, 1)
    combined = torch.cat((scores, sink), dim=-1)
    # the largest logit taken out first (the sink included): a row whose keys are all masked still sums to one
    combined = combined - combined.amax(dim=-1, keepdim=True)
    probs = F.softmax(combined, dim=-1)[..., :-1]  # the sink's share dropped
    return torch.matmul(probs.to(values.dtype), values)


def sink_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, sinks: torch.Tensor,
                          rows: RowSlots) -> torch.Tensor:
    """Decode rows, each over its own slots (a chain's run from its first slot, a tree's gathered), one call per
    row. q [B, H, T, hd] -> [B, H, T, hd]."""
    out = []
    for j in range(q.shape[2]):
        if rows.extras and rows.extras[j]:
            slots = rows.slots(j, q.device)
            keys, values = k_cache[:, :, slots], v_cache[:, :, slots]
        else:
            keys, values = k_cache[:, :, rows.first(j) : rows.spans[j]], v_cache[:, :, rows.first(j) : rows.spans[j]]
        out.append(sink_attention(q[:, :, j : j + 1], keys, values, sinks))
    return torch.cat(out, dim=2)
