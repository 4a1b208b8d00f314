"""Verification of draft tokens against the target: pure functions, lossless by construction.

Glossary (vLLM's):
- *draft* tokens: proposed by a drafter; `draft_probs` is the distribution they were drawn from (None = a point
  mass: the drafter was deterministic, as n-gram lookup or greedy drafting is). A draft model of another
  tokenizer is in this case: its greedy text, tokenized for the target, is a function of the context alone, and
  its own probabilities are over other tokens, so it proposes point masses (drafters/cross_tokenizer.py).
- *target*: the model whose output distribution we must reproduce exactly; `target_probs` is its distribution
  after temperature / top-k / top-p.
- *accepted*: the draft prefix kept. *recovered*: the token sampled after a rejection. *bonus*: the token
  sampled from the target's last position when every draft token is accepted.
- *emitted* = accepted + one recovered or bonus token, so every verify step emits at least one token.

Speculative sampling (Leviathan et al. 2023, Chen et al. 2023): accept draft token x with probability
min(1, target_probs(x) / draft_probs(x)); on the first rejection sample from norm(max(0, target_probs -
draft_probs)). The emitted token is then distributed exactly as target_probs. Greedy is the same rule with
one-hot distributions, done here directly as an argmax comparison: exact, and it consumes no random numbers.

Trees (`verify_tree`): walk from the root; at each node try its children in draft order, each as one round of the
rule above against what is left of the target: a child drawn from proposal q is accepted with probability
min(1, p(x) / q(x)); if rejected, p becomes norm(max(0, p - q)) and the next child is tried (SpecInfer's multi-round
rule). Each round is an exact speculative step whose target is the previous round's residual, so whatever the
rounds do the emitted token is distributed as p (Miao et al. 2024; Chen et al. 2023). What q is per child:
- deterministic siblings (greedy top-k of a draft model, n-gram branches): a point mass, `probs=None`. Then
  acceptance is p(x) / remaining mass and the residual is p with x zeroed: the rounds together just sample from p
  and look for the result among the children, exact for any fixed set of distinct candidates. That is how they
  run: one draw a depth, where rounds would build a residual row per rejected sibling and read each verdict back.
- siblings drawn without replacement from q (the draft model's tree under sampling, Gumbel top-k): child j's row
  is q with the earlier siblings zeroed and renormalised, the distribution it was actually drawn from.
- siblings drawn i.i.d. from q: every child's row is q itself.
Greedy on a tree follows the child whose token is the target's argmax: the accepted path is what plain greedy
decoding would emit, token for token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.config import SamplingParams
from specdecode.sampling import greedy_tokens, sample, to_probs


@dataclass(slots=True)
class Verdict:
    emitted: list[int]  # [num_accepted + 1]: accepted draft tokens, then the recovered or bonus token
    num_accepted: int
    path: list[int] | None = None  # accepted draft node indices, root to leaf (a chain keeps 0, 1, ... implicitly)

    @property
    def accepted_nodes(self) -> list[int]:
        return list(range(self.num_accepted)) if self.path is None else self.path


def verify_chain(
    target_logits: torch.Tensor,  # [n + 1, vocab]: the target's logits after the last token and each draft token
    draft_tokens: torch.Tensor | list[int],  # [n] int64
    draft_probs: torch.Tensor | None,  # [n, vocab] after the same transform as the target, or None (point mass)
    params: SamplingParams,
    generator: torch.Generator | None,
    argmax: torch.Tensor | None = None,  # [n + 1] the logits' row argmax where the LM head found it (greedy)
) -> Verdict:
    n = len(draft_tokens)
    if params.greedy:  # compared as lists: tensor operations on a few tokens cost more than the comparison
        choice = (greedy_tokens(target_logits) if argmax is None else argmax).tolist()  # [n + 1], the one host sync
        drafted = draft_tokens if isinstance(draft_tokens, list) else draft_tokens.tolist()
        num_accepted = 0
        while num_accepted < n and drafted[num_accepted] == choice[num_accepted]:
            num_accepted += 1
        return Verdict(choice[: num_accepted + 1], num_accepted)

    draft_tokens = as_tensor(draft_tokens, target_logits.device)
    target_probs = to_probs(target_logits, params)  # [n + 1, vocab]
    accept_probs = acceptance_probs(target_probs[:n], draft_tokens, draft_probs)  # [n]
    draws = torch.rand(n, generator=generator, device=target_probs.device)
    num_accepted = int((draws < accept_probs).cumprod(0).sum())
    if num_accepted < n:
        row_draft = None if draft_probs is None else draft_probs[num_accepted]
        weights = residual(target_probs[num_accepted], draft_tokens[num_accepted], row_draft)
    else:
        weights = target_probs[n]
    last = sample(weights, generator)
    return Verdict(draft_tokens[:num_accepted].tolist() + [int(last)], num_accepted)


def acceptance_probs(
    target_probs: torch.Tensor,  # [n, vocab]
    draft_tokens: torch.Tensor,  # [n]
    draft_probs: torch.Tensor | None,  # [n, vocab] or None
) -> torch.Tensor:
    """min(1, target_probs(x) / draft_probs(x)) for each draft token x -> [n]."""
    target_at = target_probs.gather(-1, draft_tokens[:, None]).squeeze(-1)
    if draft_probs is None:
        return target_at
    draft_at = draft_probs.gather(-1, draft_tokens[:, None]).squeeze(-1)
    # draft_at > 0 for a token the drafter actually sampled; the guard keeps a bad drafter from dividing by 0.
    return (target_at / draft_at.clamp_min(torch.finfo(draft_at.dtype).tiny)).clamp(max=1.0)


def residual(
    target_row: torch.Tensor,  # [vocab]
    draft_token: torch.Tensor,  # [] the rejected token
    draft_row: torch.Tensor | None,  # [vocab], or None for a point mass at draft_token
) -> torch.Tensor:
    """Unnormalised max(0, target - draft): what to sample from after a rejection -> [vocab].

    For a point mass this is the target with the rejected token zeroed. If rounding leaves nothing (target ==
    draft up to float error, where rejection is all but impossible), the target row itself is returned."""
    if draft_row is None:
        out = target_row.clone()
        out[draft_token] = 0.0
    else:
        out = (target_row - draft_row).clamp_min(0.0)
    return torch.where(out.sum() > 0, out, target_row)


def verify_tree(
    target_logits: torch.Tensor,  # [n + 1, vocab]: row 0 after the root, row i + 1 after draft node i
    draft_tokens: torch.Tensor | list[int],  # [n] int64
    parents: list[int],  # [n] parent node of each node, -1 = root; parents[i] < i
    draft_probs: torch.Tensor | None,  # [n, vocab] the distribution each node was drawn from, or None (point masses)
    params: SamplingParams,
    generator: torch.Generator | None,
    argmax: torch.Tensor | None = None,  # [n + 1] the logits' row argmax where the LM head found it (greedy)
) -> Verdict:
    children: list[list[int]] = [[] for _ in range(len(parents) + 1)]  # [node + 1] -> its children in draft order
    for node, parent in enumerate(parents):
        children[parent + 1].append(node)
    tokens = draft_tokens if isinstance(draft_tokens, list) else draft_tokens.tolist()
    path: list[int] = []
    if params.greedy:
        choice = (greedy_tokens(target_logits) if argmax is None else argmax).tolist()  # [n + 1]
        row = 0
        while (child := next((c for c in children[row] if tokens[c] == choice[row]), None)) is not None:
            path.append(child)
            row = child + 1
        return Verdict(tokens_on(path, tokens) + [choice[row]], len(path), path)

    target_probs = to_probs(target_logits, params)  # [n + 1, vocab]
    draft_tokens = as_tensor(draft_tokens, target_logits.device)
    row = 0
    while True:
        remaining, accepted, drawn = target_probs[row], None, None
        if draft_probs is None:  # point masses: the rounds together draw from p and look for the draw among them
            drawn = int(sample(remaining, generator))  # one draw a depth, no residual rows, one host sync
            accepted = next((c for c in children[row] if tokens[c] == drawn), None)
        else:
            for child in children[row]:
                accept, rest = sibling_round(remaining, draft_tokens[child], draft_probs[child])
                if float(torch.rand((), generator=generator, device=remaining.device)) < accept:
                    accepted = child
                    break
                remaining = rest
        if accepted is None:  # the draw, or one from what the rounds left
            last = drawn if drawn is not None else int(sample(remaining, generator))
            return Verdict(tokens_on(path, tokens) + [last], len(path), path)
        path.append(accepted)
        row = accepted + 1


def sibling_round(
    target_row: torch.Tensor,  # [vocab] what is left of the target distribution, normalised
    token: torch.Tensor,  # [] the sibling tried now
    proposal: torch.Tensor | None,  # [vocab] the distribution it was drawn from, or None (a point mass)
) -> tuple[float, torch.Tensor]:
    """One round of the multi-round rule -> (P(accept the sibling), the normalised target for the next round)."""
    accept = float(acceptance_probs(target_row[None], token[None], None if proposal is None else proposal[None])[0])
    rest = residual(target_row, token, proposal)
    return accept, rest / rest.sum()


def tokens_on(path: list[int], tokens: list[int]) -> list[int]:
    return [tokens[node] for node in path]


def as_tensor(tokens: torch.Tensor | list[int], device: torch.device) -> torch.Tensor:
    return tokens if isinstance(tokens, torch.Tensor) else torch.tensor(tokens, dtype=torch.long, device=device)
