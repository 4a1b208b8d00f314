"""Train an EAGLE head (drafters/eagle.py) on a feature cache: soft cross-entropy against the target's own
top-k distribution, restricted to the draft vocabulary, over `steps` unrolled draft steps (weights 0.8^k: the
first guess matters most, every later one only if those before it were accepted)."""

from __future__ import annotations

import torch

from specdecode.drafters.eagle import EagleConfig, EagleHead, target_embeddings
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

STEP_WEIGHT = 0.8


def new_head(target: torch.nn.Module, features: Features, layers: tuple[int, ...], vocab_size: int,
             intermediate: int) -> EagleHead:
    c = target.config
    ids = draft_vocab(features, c.vocab_size, vocab_size, c.eos_token_ids)
    config = EagleConfig(c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, intermediate, 1 + len(layers),
                         ids.numel(), c.rope_theta, c.rms_norm_eps)
    head = EagleHead(config)
    with torch.no_grad():
        head.head_tokens.copy_(ids)
        head.lm_head.weight.copy_(head_rows(target, ids))  # starts as the target's own head over these tokens
        # The fused features start as the target's final hidden state alone, and the layer as the identity (its
        # outputs zero): the untrained head says what the target said one position earlier, and training moves
        # it one token ahead from there instead of from noise.
        head.fc.weight.zero_()
        head.fc.weight[:, : c.hidden_size].copy_(torch.eye(c.hidden_size))
        head.o_proj.weight.zero_()
        head.down_proj.weight.zero_()
    return head


def train(head: EagleHead, target: torch.nn.Module, features: Features, epochs: float, steps: int, lr: float,
          seconds: float | None, seed: int = 0) -> dict:
    """Train in place; -> the training log summary."""
    head.lm_head.weight.requires_grad_(False)  # the target's rows: learning them overfits a small corpus
    embed = target_embeddings(target)

    def step(group: list[tuple[int, int]]):
        losses, agree = run(head, Batch.build(features, group, embed, steps).to(head.device), steps)
        return sum(STEP_WEIGHT**k * loss for k, loss in enumerate(losses)), agree

    return optimize(head, features, step, epochs=epochs, lr=lr, seconds=seconds, seed=seed, positions=steps,
                    desc="train eagle")


def run(head: EagleHead, batch: Batch, steps: int) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
    """Losses per unrolled step and (agreeing, counted) top-1 agreement with the target per step."""
    outs = head.unrolled(batch.features, batch.embeds, batch.positions, batch.same_doc, steps)
    losses, agree = [], []
    for k, hidden in enumerate(outs):
        rows = batch.rows(k)  # rows whose step-k guess is a token the target writes
        logits = head.logits(hidden[rows])
        loss, right = soft_loss(logits, batch.teacher(k, rows), head.head_tokens)
        losses.append(loss)
        agree.append((right, rows.numel()))
    return losses, agree


@torch.no_grad()
def evaluate(head: EagleHead, target: torch.nn.Module, features: Features, steps: int) -> dict:
    """Per-position agreement on the held-back split: conditional (step k right given steps < k right) and the
    mean accepted length a chain of `steps` would reach (1 + sum over k of P(steps 0..k all right))."""
    head.eval()
    joint = torch.zeros(steps)
    counted = 0
    for span_group in packed_batches(features.sequences(held=True), None):
        batch = Batch.build(features, span_group, target_embeddings(target), steps).to(head.device)
        outs = head.unrolled(batch.features, batch.embeds, batch.positions, batch.same_doc, steps)
        rows = batch.rows(steps - 1)  # rows where every step has a teacher: one population for all positions
        ok = torch.ones(rows.numel(), dtype=torch.bool, device=rows.device)
        for k, hidden in enumerate(outs):
            guess = head.head_tokens[head.logits(hidden[rows]).argmax(-1)]
            ok &= guess == batch.top_ids[rows + 1 + k, 0]
            joint[k] += ok.sum().cpu()
        counted += rows.numel()
    return chain_report(joint, counted)
