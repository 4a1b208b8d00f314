"""A request's output rules: penalties, biases, min_tokens and a grammar, applied to the target's logits.

The distribution a request samples from is the target's after these rules (then temperature, min-p, top-k,
top-p: sampling.to_probs). Under speculation every verified row is shaped as plain decoding would have shaped
it at that point: with the output so far plus the draft tokens on that row's path, and the grammar state after
them. The verifier then keeps exactly the shaped target's distribution (verify.py); drafts need no shaping for
that, only to be accepted more often, so they are just cut where the grammar rejects them.

    rules = OutputRules(params, prompt_ids, eos_ids)
    draft = rules.cut(draft)                   # drop nodes the grammar rejects (and their subtrees)
    shaped = rules.shape(logits, draft)        # [1 + len(draft), vocab]: root row, then each node's row
    rules.emitted(tokens)                      # after verification
"""

from __future__ import annotations

import torch

from specdecode.config import SamplingParams
from specdecode.models.masks import tree_mask
from specdecode.rules.penalties import Penalties

__all__ = ["OutputRules"]


class OutputRules:
    def __init__(self, params: SamplingParams, prompt_ids: list[int], eos_ids: tuple[int, ...]) -> None:
        self.penalties = Penalties(params, prompt_ids, eos_ids) if params.shapes_logits else None
        self.grammar = params.grammar.matcher() if params.grammar is not None else None
        self.active = params.shapes_logits
        self.eos = sorted(set(eos_ids))

    def shape(self, logits: torch.Tensor, draft_tokens: torch.Tensor | list[int] | None = None,
              parents: torch.Tensor | list[int] | None = None, rows: list[int] | None = None) -> torch.Tensor:
        """Logits over the root and n draft nodes (`parents` as in a Draft; None: a chain) -> a shaped copy (the
        input itself when no rule is set). Rows are [root, node 0, ..., node n - 1], or those `rows` names (-1:
        the root), as a drafter growing a tree asks for the nodes it expands."""
        if not self.active:
            return logits
        tokens = [] if draft_tokens is None else torch.as_tensor(draft_tokens, dtype=torch.long).tolist()
        n = len(tokens)
        parents = torch.arange(-1, n - 1) if parents is None else torch.as_tensor(parents, dtype=torch.long).cpu()
        rows = list(range(-1, n)) if rows is None else rows
        pick = torch.tensor(rows) + 1
        on_path = tree_mask(0, parents)[0, 0, :, 1:][pick]  # [rows, n]: node j is on row r's path
        depth = on_path.sum(-1)  # [rows]
        shaped = logits.float().clone()
        if self.penalties is not None:
            self.penalties.apply(shaped, tokens, on_path, depth)
        if self.grammar is not None:
            self.grammar.mask(shaped, tokens, parents.tolist(), rows)
            # min_tokens forbids EOS where the grammar allows nothing else: the grammar wins, the text ends
            dead = (~torch.isfinite(shaped).any(-1)).nonzero()[:, :1]  # [rows, 1]
            if dead.numel() and self.eos:
                eos = torch.tensor(self.eos, device=shaped.device)
                shaped[dead, eos] = logits[dead, eos].float()
        return shaped

    def cut(self, tokens: list[int], parents: list[int]) -> list[int] | None:
        """The draft nodes the grammar allows, every kept node's parent kept too (None: all of them)."""
        if self.grammar is None or not tokens:
            return None
        return self.grammar.legal_nodes(tokens, parents)

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next: free drafts."""
        return self.grammar.forced(limit) if self.grammar is not None and limit > 0 else []

    def emitted(self, tokens: list[int]) -> None:
        if self.penalties is not None:
            self.penalties.saw(tokens)
        if self.grammar is not None:
            self.grammar.advance(tokens)
