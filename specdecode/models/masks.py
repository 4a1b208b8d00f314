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
    mask = torch.zeros(n + 1, prefix_len + n + 1, dtype=torch.bool, device=parents.device)
    mask[:, : prefix_len + 1] = True  # the prefix and the root
    rows, cols = [], []
    for i, path in enumerate(tree_paths(parents.tolist())):
        rows += [i + 1] * len(path)
        cols += [prefix_len + 1 + j for j in path]
    if rows:  # one indexed write: a few small tensor operations per node cost more than the lists (drafts are small)
        mask[rows, cols] = True
    return mask[None, None]


def tree_paths(parents: list[int]) -> list[list[int]]:
    """Each node's path from the root's first child down to itself, as node indices (ascending, since a parent
    comes before its children)."""
    paths: list[list[int]] = []
    for i, parent in enumerate(parents):
        paths.append((paths[parent] if parent >= 0 else []) + [i])
    return paths


def tree_depths(parents: list[int]) -> list[int]:
    """Depth of each draft node (a child of the root has depth 1)."""
    out: list[int] = []
    for parent in parents:
        out.append(1 if parent < 0 else out[parent] + 1)
    return out


def depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of each draft node (a child of the root has depth 1) -> [n]."""
    return torch.tensor(tree_depths(parents.tolist()), dtype=torch.long, device=parents.device)


def tree_row_slots(prefix_len: int, parents: list[int]) -> tuple[list[int], list[list[int]]]:
    """The cache slots each row of tree_mask(prefix_len, parents) lets it attend to, as model.row_slots reads them
    off that mask: (spans, extras), row t seeing [0, spans[t]) and then extras[t]; extras is [] when every row's
    slots are a prefix. The root sits at slot prefix_len, node i at prefix_len + 1 + i."""
    spans, extras = [prefix_len + 1], [[]]
    for path in tree_paths(parents):
        k = 0
        while k < len(path) and path[k] == k:  # nodes 0, 1, ... on the path extend the leading run
            k += 1
        spans.append(prefix_len + 1 + k)
        extras.append([prefix_len + 1 + j for j in path[k:]])
    return spans, (extras if any(extras) else [])
