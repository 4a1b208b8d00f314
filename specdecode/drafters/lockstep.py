"""Running drafters as generators (`Drafter.drafting(ctx, max_tokens)`): each yields the forwards of its
`needs.forward_model` it needs as `Part`s over its own cache, is sent the logits, and returns its Draft.

`run_alone` serves one drafter: one forward per part. `run_batched` serves the drafters of many requests at once
(the engine's step): every round, the parts all of them wait for go through ONE forward of their shared
draft model (model.forward_parts: ragged rows, attention per request), so a batch of requests reads the draft
model's weights once per depth instead of once per request; a prompt's first feed (a non-decode part) rides along.
"""

from __future__ import annotations

import time
from collections.abc import Generator
from typing import Protocol

import torch

from specdecode.drafters.draft import Draft, ForwardTook
from specdecode.models.parts import Part

Drafting = Generator[Part, torch.Tensor, Draft]


class Drafter(Protocol):
    """What running a drafter's forwards tells it (drafters/base.py declares it for every drafter)."""

    def hear(self, event: ForwardTook) -> None: ...


def run_alone(drafting: Drafting, model: torch.nn.Module | None, drafter: Drafter) -> Draft:
    """Drive one drafter's generator to its Draft, one forward per part (its failure raised here)."""
    result = _run_one(drafting, model, drafter)
    if isinstance(result, Exception):
        raise result
    return result


def run_batched(draftings: list[tuple[Drafting, torch.nn.Module, Drafter]]) -> list[Draft | Exception]:
    """[(generator, its model, its drafter)] -> each one's Draft (or the exception that ended it), in order.
    Called inside the engine's step, in its inference mode (entering it again cost ~15 us a step)."""
    if len(draftings) == 1:  # a lone request: its forwards in turn, no rounds to group (~15 us a step)
        return [_run_one(*draftings[0])]
    results: list[Draft | Exception | None] = [None] * len(draftings)
    waiting: dict[int, Part] = {}
    for i, (gen, _, _) in enumerate(draftings):
        _advance(i, gen, None, waiting, results)
    while waiting:
        groups: dict[int, list[int]] = {}  # one forward per draft model
        for i in waiting:
            groups.setdefault(id(draftings[i][1]), []).append(i)
        sent: dict[int, torch.Tensor] = {}
        for members in groups.values():
            model = draftings[members[0]][1]
            logits = _forward(model, [waiting[i] for i in members], [draftings[i][2] for i in members])
            sent.update(zip(members, logits))
        for i, logits in sent.items():
            del waiting[i]
            _advance(i, draftings[i][0], logits, waiting, results)
    return results


def _run_one(gen: Drafting, model: torch.nn.Module, drafter: Drafter) -> Draft | Exception:
    """run_batched for one generator: its Draft, or the exception that ended it (a forward's own failure is
    raised, as run_batched raises it)."""
    logits = None
    while True:
        try:
            part = next(gen) if logits is None else gen.send(logits)
        except StopIteration as done:
            return done.value
        except Exception as e:  # noqa: BLE001 - the drafter's failure is its request's alone
            return e
        logits = _forward(model, [part], [drafter])[0]


def _advance(i: int, gen: Drafting, logits: torch.Tensor | None, waiting: dict[int, Part],
             results: list) -> None:
    try:
        waiting[i] = next(gen) if logits is None else gen.send(logits)
    except StopIteration as done:
        results[i] = done.value
    except Exception as e:  # noqa: BLE001 - one request's drafter failing must not end the others'
        results[i] = e


def _forward(model: torch.nn.Module, parts: list[Part], drafters: list[Drafter]) -> list[torch.Tensor]:
    """One forward over `parts`; advances each part's cache; -> each part's logits. A forward of decode rows only
    tells the drafters their share of its time (a prompt's feed would inflate it)."""
    began = time.perf_counter()
    outputs = model.forward_parts(parts)
    seconds = (time.perf_counter() - began) / len(parts)
    for part in parts:
        part.cache.truncate(part.cache.length + part.count)
    if all(part.decode for part in parts):
        for drafter in drafters:
            drafter.hear(ForwardTook(seconds))
    return [logits for logits, _ in outputs]
