"""Train Medusa heads (drafters/medusa.py) on a feature cache: head k against the target's own top-k
distribution k + 2 tokens ahead; then measure each head's top-k accuracy, which decides the static tree."""

from __future__ import annotations

import torch

from specdecode.drafters.medusa import MedusaConfig, MedusaHeads
from specdecode.training.features import Features
from specdecode.training.loop import (
    Batch,
    chain_report,
    draft_vocab,
    head_rows,
    optimize,
    packed_batches,
    soft_loss,
)

TOP_CHOICES = 8  # ranks whose accuracy is measured per head: the static tree picks among them
HEAD_WEIGHT = 0.8


def new_heads(target: torch.nn.Module, features: Features, num_heads: int, vocab_size: int) -> MedusaHeads:
    c = target.config
    ids = draft_vocab(features, c.vocab_size, vocab_size, c.eos_token_ids)
    heads = MedusaHeads(MedusaConfig(c.hidden_size, num_heads, ids.numel()))
    with torch.no_grad():
        heads.head_tokens.copy_(ids)
        heads.lm_head.weight.copy_(head_rows(target, ids))
        for block in heads.blocks:
            block.weight.zero_()
            block.bias.zero_()
    return heads


def train(heads: MedusaHeads, features: Features, epochs: float, lr: float, seconds: float | None,
          seed: int = 0) -> dict:
    heads.lm_head.weight.requires_grad_(False)

    def step(group: list[tuple[int, int]]):
        batch = Batch.build(features, group, None, 1).to(heads.device)
        loss, agree = 0.0, []
        for k in range(heads.config.num_heads):
            rows = batch.rows(k)
            head_loss, right = soft_loss(heads(batch.final[rows], k), batch.teacher(k, rows), heads.head_tokens)
            loss = loss + HEAD_WEIGHT**k * head_loss
            agree.append((right, rows.numel()))
        return loss, agree

    return optimize(heads, features, step, epochs=epochs, lr=lr, seconds=seconds, seed=seed,
                    positions=heads.config.num_heads, desc="train medusa", warmup=1)


@torch.no_grad()
def evaluate(heads: MedusaHeads, features: Features) -> dict:
    """On the held-back split: accuracy[k][j] = P(head k's rank-j guess is the target's top token), and the
    mean accepted length of a chain of each head's top guess."""
    K = heads.config.num_heads
    hits = torch.zeros(K, TOP_CHOICES)
    chain = torch.zeros(K)
    counted = 0
    for group in packed_batches(features.sequences(held=True), None):
        batch = Batch.build(features, group, None, 1).to(heads.device)
        rows = batch.rows(K - 1)  # rows every head has a teacher for
        ok = torch.ones(rows.numel(), dtype=torch.bool, device=rows.device)
        for k in range(K):
            guesses = heads.head_tokens[heads(batch.final[rows], k).topk(TOP_CHOICES, -1).indices]  # [R, C]
            right = guesses == batch.top_ids[rows + 1 + k, :1]
            hits[k] += right.sum(0).cpu()
            ok &= right[:, 0]
            chain[k] += ok.sum().cpu()
        counted += rows.numel()
    accuracy = [[round(x, 4) for x in row] for row in (hits / counted).tolist()] if counted else []
    return {"top_accuracy": accuracy, **chain_report(chain, counted)}

