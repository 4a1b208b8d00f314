"""What every head's training shares: packed batches over the feature cache, the teacher loss, the draft
vocabulary, progress with loss, per-position agreement and tokens/s."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from specdecode.drafters.eagle import target_embeddings
from specdecode.training.features import Features
from specdecode.weights.vocab_subset import frequent_tokens

PACK_TOKENS = 512  # rows per training batch: whole sequences packed together, attention kept within each


def packed_batches(spans: list[tuple[int, int]], rng: random.Random | None,
                   max_tokens: int = PACK_TOKENS) -> Iterator[list[tuple[int, int]]]:
    """Sequences (shuffled when `rng` is given) packed greedily into groups of at most `max_tokens` rows."""
    order = list(spans)
    if rng is not None:
        rng.shuffle(order)
    group, size = [], 0
    for a, b in order:
        if group and size + (b - a) > max_tokens:
            yield group
            group, size = [], 0
        group.append((a, b))
        size += b - a
    if group:
        yield group


@dataclass(slots=True)
class Batch:
    """Packed sequences' rows: what a head reads at row i and what it should say at step k."""

    final: torch.Tensor  # [T, d] the target's final hidden state (what Medusa heads read)
    features: torch.Tensor  # [T, F * d] final hidden state, then the layer inputs (what an EAGLE head reads)
    embeds: torch.Tensor | None  # [T + steps - 1, d] the target's embedding of token i + 1 (+ k)
    positions: torch.Tensor  # [T] position within its own sequence
    same_doc: torch.Tensor  # [T, T] row j is in row i's sequence and j <= i
    doc: torch.Tensor  # [T] which sequence of the batch
    loss: torch.Tensor  # [T] the token at row i is the target's to write
    top_ids: torch.Tensor  # [T, K] the target's likeliest tokens after row i
    top_logprobs: torch.Tensor  # [T, K]

    @classmethod
    @torch.no_grad()
    def build(cls, features: Features, spans: list[tuple[int, int]], embed: nn.Module | None, steps: int) -> Batch:
        """`embed`: the target's token embedding (None: a head that reads none, like Medusa's)."""
        idx = torch.cat([torch.arange(a, b) for a, b in spans])
        doc = torch.cat([torch.full((b - a,), i) for i, (a, b) in enumerate(spans)])
        positions = torch.cat([torch.arange(b - a) for a, b in spans])
        tokens = features.tokens[idx]
        later = torch.cat((tokens[1:], tokens.new_zeros(max(steps - 1, 0) + 1)))[: idx.numel() + steps - 1]
        embeds = None
        if embed is not None:  # an embedding kept in blocks (GGUF as stored) has no `weight` and runs on the CPU
            embeds = embed(later.to(getattr(embed, "weight", later).device)).float().cpu()
        T = idx.numel()
        same_doc = (doc[:, None] == doc[None, :]) & torch.ones(T, T, dtype=torch.bool).tril()
        d = features.hidden_size
        hidden = features.hidden[idx].float()
        return cls(hidden[:, :d], hidden, embeds, positions, same_doc, doc,
                   features.loss[idx], features.top_ids[idx], features.top_logprobs[idx])

    def to(self, device: torch.device | str) -> Batch:
        """The batch on the device the head trains on (built on the CPU, where the cache is read)."""
        moved = {f: getattr(self, f) for f in self.__slots__}
        return Batch(**{f: v.to(device) if isinstance(v, torch.Tensor) else v for f, v in moved.items()})

    @property
    def size(self) -> int:
        return self.doc.numel()

    def rows(self, k: int) -> torch.Tensor:
        """Rows i whose step-k guess (the token at i + 2 + k) exists, in the same sequence, and is the target's
        to write."""
        T = self.size
        i = torch.arange(max(T - 2 - k, 0), device=self.doc.device)
        later = i + 2 + k
        return i[(self.doc[later] == self.doc[i]) & self.loss[later]]

    def teacher(self, k: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's top-k (ids, log-probs) for the token step k of `rows` guesses."""
        return self.top_ids[rows + 1 + k], self.top_logprobs[rows + 1 + k]


def soft_loss(logits: torch.Tensor, teacher: tuple[torch.Tensor, torch.Tensor],
              head_tokens: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Cross-entropy of draft logits [R, n] over `head_tokens` against the target's top-k distribution (renormalised
    over the tokens the draft can say) -> (mean loss, rows whose top guess is the target's top token)."""
    ids, logprobs = teacher
    if logits.shape[0] == 0:
        return logits.sum() * 0.0, 0
    where = torch.full((int(max(head_tokens.max(), ids.max())) + 1,), -1, dtype=torch.long, device=ids.device)
    where[head_tokens] = torch.arange(head_tokens.numel(), device=ids.device)
    at = where[ids]  # [R, K] index in the draft vocabulary, -1 = not in it
    p = logprobs.exp() * (at >= 0)
    mass = p.sum(-1, keepdim=True)
    keep = mass[:, 0] > 0
    p = p / mass.clamp_min(1e-12)
    logq = logits.log_softmax(-1).gather(1, at.clamp_min(0))
    loss = -(p * logq).sum(-1)[keep].mean() if bool(keep.any()) else logits.sum() * 0.0
    right = int((head_tokens[logits.argmax(-1)] == ids[:, 0]).sum())
    return loss, right


def draft_vocab(features: Features, vocab_size: int, size: int, always: tuple[int, ...]) -> torch.Tensor:
    """The `size` tokens the target writes most in the training split (its own top choices counted too)."""
    rows = torch.cat([torch.arange(a, b) for a, b in features.sequences(held=False)])
    counts = torch.bincount(features.tokens[rows], minlength=vocab_size)[:vocab_size]
    counts += torch.bincount(features.top_ids[rows, 0], minlength=vocab_size)[:vocab_size]
    return frequent_tokens(counts, min(size, vocab_size), [i for i in always if 0 <= i < vocab_size])


def chain_report(all_right: torch.Tensor, counted: int) -> dict:
    """all_right[k] = held-back rows whose guesses at draft positions 0..k were all the target's top token ->
    acceptance per position (given the ones before it was accepted) and the mean accepted length a chain of
    that many guesses would reach (1 + the sum of all_right / counted)."""
    if counted == 0:
        return {"acceptance_per_position": [], "mean_accepted_length": 1.0, "rows": 0}
    p = (all_right / counted).tolist()
    conditional = [p[0]] + [p[k] / p[k - 1] if p[k - 1] > 0 else 0.0 for k in range(1, len(p))]
    return {"acceptance_per_position": [round(x, 4) for x in conditional],
            "all_right_through_position": [round(x, 4) for x in p],
            "mean_accepted_length": round(1.0 + sum(p), 3), "rows": counted}


@torch.no_grad()
def head_rows(target: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The target's LM head rows for `ids` in float32 [n, d], whatever form the head runs in."""
    if target.config.tie_word_embeddings:
        return target_embeddings(target)(ids.to(target.device)).float().cpu()
    head = target.lm_head
    if isinstance(head, nn.Linear):
        return head.weight[ids.to(head.weight.device)].float().cpu()
    d = target.config.hidden_size
    rows = []
    for start in range(0, d, 128):  # a head in blocks: read it back through one-hot inputs (exact in 8 bits)
        eye = torch.eye(d, dtype=target.dtype, device=target.device)[start : start + 128]
        rows.append(head(eye[None])[0][:, ids.to(target.device)].float().cpu())
    return torch.cat(rows).T.contiguous()


# One optimizer step: a packed group of sequences -> (loss to minimise, (agreeing, counted) per draft position).
StepFn = Callable[[list[tuple[int, int]]], tuple[torch.Tensor, list[tuple[int, int]]]]


def optimize(module: nn.Module, features: Features, step_fn: StepFn, *, epochs: float, lr: float,
             seconds: float | None, seed: int, positions: int, desc: str, batch_tokens: int = PACK_TOKENS,
             warmup: int = 20) -> dict:
    """AdamW on `module`'s trainable parameters over shuffled packed batches of the training split, for `epochs`
    passes or until `seconds` are spent: linear warmup, then cosine decay to zero where the run will end.
    -> the training log summary. The module is left in eval mode."""
    module.train()
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    rng = random.Random(seed)
    spans = features.sequences(held=False)
    total_steps = max(1, math.ceil(epochs * len(list(packed_batches(spans, rng, batch_tokens)))))
    progress = Progress(sum(b - a for a, b in spans) * epochs, positions, seconds, desc)
    step = 0
    while step < total_steps and not progress.out_of_time():
        for group in packed_batches(spans, rng, batch_tokens):
            total_steps = progress.steps_in_budget(total_steps)
            if step >= total_steps or progress.out_of_time():
                break
            for g in opt.param_groups:
                g["lr"] = lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * step / total_steps))
            loss, agree = step_fn(group)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            progress.update(sum(b - a for a, b in group), loss.item(), agree)
            step += 1
    progress.close()
    module.eval()
    return progress.summary()


class Progress:
    """A progress bar over training tokens showing loss, top-1 agreement with the target per draft position
    (recent batches) and tokens/s; stops the run at the time budget."""

    def __init__(self, total_tokens: float, positions: int, seconds: float | None, desc: str) -> None:
        self.bar = tqdm(total=int(total_tokens), unit="tok", desc=desc, dynamic_ncols=True)
        self.deadline = None if seconds is None else time.perf_counter() + seconds
        self.started = time.perf_counter()
        self.loss = None
        self.agree = [0.0] * positions
        self.tokens = 0
        self.steps = 0

    def steps_in_budget(self, planned: int) -> int:
        """The planned optimizer steps, or fewer once a few steps show the time budget cannot fit them (so a
        learning-rate schedule over the steps still ends where the run ends)."""
        if self.deadline is None or self.steps < 5:
            return planned
        per_step = (time.perf_counter() - self.started) / self.steps
        return max(self.steps + 1, min(planned, int((self.deadline - self.started) / per_step)))

    def out_of_time(self) -> bool:
        return self.deadline is not None and time.perf_counter() >= self.deadline

    def update(self, tokens: int, loss: float, agree: list[tuple[int, int]]) -> None:
        self.steps += 1
        self.tokens += tokens
        self.loss = loss if self.loss is None else 0.95 * self.loss + 0.05 * loss
        for k, (right, counted) in enumerate(agree):
            if counted:
                rate = right / counted
                self.agree[k] = rate if self.steps == 1 else 0.9 * self.agree[k] + 0.1 * rate
        rate = self.tokens / max(time.perf_counter() - self.started, 1e-9)
        self.bar.set_postfix_str(f"loss {self.loss:.3f}  agree {' '.join(f'{a:.2f}' for a in self.agree)}  "
                                 f"{rate:.0f} tok/s", refresh=False)
        self.bar.update(tokens)

    def close(self) -> None:
        self.bar.close()

    def summary(self) -> dict:
        seconds = time.perf_counter() - self.started
        return {"steps": self.steps, "tokens": self.tokens, "seconds": round(seconds, 1),
                "final_loss": None if self.loss is None else round(self.loss, 4),
                "train_agreement_per_position": [round(a, 4) for a in self.agree],
                "stopped_by_time_budget": self.out_of_time()}
