"""Attention masks for a forward over new tokens that sit after `prefix_len` cached positions.

Every new token sees the whole prefix; among the new tokens, a token sees itself and its ancestors. A chain
(plain decoding, prefill, linear drafts) is the special case where the ancestors are all earlier tokens.
"""

from __future__ import annotations

import torch


def chain_mask(prefix_len: int, num_new: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """-> [1, 1, num_new, prefix_len + num_new] bool, True where attention is allowed."""
    span = prefix_len + num_new
    cols = torch.arange(span, device=device)
    rows = torch.arange(prefix_len, span, device=device)
    return (cols[None, :] <= rows[:, None])[None, None]


def tree_mask(prefix_len: int, parents: torch.Tensor) -> torch.Tensor:
    """Mask for a root token followed by draft nodes with `parents` ([n], -1 = root).

    -> [1, 1, n + 1, prefix_len + n + 1]; row 0 is the root, row i + 1 is node i."""
    n = parents.numel()
    device = parents.device
    # parent index in the root-first numbering; the root is its own parent so the doubling below terminates.
    up = torch.cat((torch.zeros(1, dtype=torch.long, device=device), parents + 1))  # [n + 1]
    ancestors = torch.eye(n + 1, dtype=torch.bool, device=device)
    ancestors[:, 0] = True
    hop = up
    # Pointer doubling: after j rounds each row holds every ancestor within 2^j hops.
    for _ in range(max(1, n.bit_length())):
        ancestors |= ancestors[hop]
        hop = hop[hop]
    prefix = torch.ones(n + 1, prefix_len, dtype=torch.bool, device=device)
    return torch.cat((prefix, ancestors), dim=1)[None, None]


def depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of each draft node (a child of the root has depth 1) -> [n]."""
    mask = tree_mask(0, parents)[0, 0, 1:, 1:]  # [n, n] node-to-node ancestry including self
    return mask.sum(-1)
