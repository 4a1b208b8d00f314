"""Running drafters written as generators (`drafting(ctx, max_tokens)`): each yields the forwards it needs as
`Part`s over its own cache, is sent the logits, and returns its Draft.

`run_alone` serves one drafter: one forward per part. `run_batched` serves the drafters of many requests at once
(the batch engine's step): every round, the parts all of them wait for go through ONE forward of their shared
draft model (model.forward_parts: ragged rows, attention per request), so a batch of requests reads the draft
model's weights once per depth instead of once per request. Parts that ask for non-decode rows (a prompt's first
feed) run on their own, as they would alone.
"""

from __future__ import annotations

import time
from collections.abc import Generator

import torch

from specdecode.drafters.base import Draft
from specdecode.model import Part, forward_parts

Drafting = Generator[Part, torch.Tensor, Draft]


def run_alone(drafting: Drafting, model: torch.nn.Module, drafter) -> Draft:
    try:
        part = next(drafting)
        while True:
            part = drafting.send(_forward(model, [part], drafter and [drafter])[0])
    except StopIteration as done:
        return done.value


@torch.inference_mode()
def run_batched(draftings: list[tuple[Drafting, torch.nn.Module, object]]) -> list[Draft | Exception]:
    """[(generator, its model, its drafter)] -> each one's Draft (or the exception that ended it), in order."""
    results: list[Draft | Exception | None] = [None] * len(draftings)
    waiting: dict[int, Part] = {}
    for i, (gen, _, _) in enumerate(draftings):
        _advance(i, gen, None, waiting, results)
    while waiting:
        groups: dict[tuple[int, bool], list[int]] = {}
        for i, part in waiting.items():  # one forward per model; a non-decode part alone
            key = (id(draftings[i][1]), part.decode)
            groups.setdefault(key if part.decode else (i, False), []).append(i)
        sent: dict[int, torch.Tensor] = {}
        for members in groups.values():
            model = draftings[members[0]][1]
            logits = _forward(model, [waiting[i] for i in members], [draftings[i][2] for i in members])
            sent.update(zip(members, logits))
        for i, logits in sent.items():
            del waiting[i]
            _advance(i, draftings[i][0], logits, waiting, results)
    return results


def _advance(i: int, gen: Drafting, logits: torch.Tensor | None, waiting: dict[int, Part],
             results: list) -> None:
    try:
        waiting[i] = next(gen) if logits is None else gen.send(logits)
    except StopIteration as done:
        results[i] = done.value
    except Exception as e:  # noqa: BLE001 - one request's drafter failing must not end the others'
        results[i] = e


def _forward(model: torch.nn.Module, parts: list[Part], drafters: list | None) -> list[torch.Tensor]:
    """One forward over `parts` (all decode, or one non-decode part); advances each part's cache; -> logits."""
    began = time.perf_counter()
    outputs = forward_parts(model, parts, decode=parts[0].decode)
    seconds = (time.perf_counter() - began) / len(parts)  # each request's share of the forward
    logits = []
    for part, (rows, _) in zip(parts, outputs):
        part.cache.truncate(part.cache.length + part.tokens.numel())
        logits.append(rows)
    if parts[0].decode:
        for drafter in drafters or []:
            if hasattr(drafter, "forward_took"):
                drafter.forward_took(seconds)
    return logits
