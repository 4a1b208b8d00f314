"""The drafter contract: every way of guessing tokens speaks `propose` and `commit`, and declares what it needs.

A drafter reads a `DraftContext` (the request's tokens so far, the target's hidden states, a generator, and the
`StepPlan` it asks how far to grow) and returns a `Draft`. After verification the engine calls
`commit(accepted)` with the accepted node indices, root to leaf, so the drafter can roll its own state (a draft
model's KV cache) back to the accepted path; adaptive drafters learn there too, from the nodes the target verified.
Drafters never touch the target's cache, never sample the output, never see the tokenizer, and never decide the
draft size: they report node scores and their own cost per forward, and the planner decides (planner.py).

What a drafter needs from the engine is declared on the `Drafter` base class, with defaults every drafter
inherits, so no caller probes for attributes: which target layers' inputs it reads (the target returns them with
its hidden states), whether it reads every position's features, the model whose forwards it batches with other
requests' (`drafting` yields them), how many tokens it is behind, its seconds per forward.

A chain is a tree whose parents are [-1, 0, 1, ...]; tree drafters fill `parents` with every parent before its
child. `probs=None` means each token is a point mass (a deterministic guess); otherwise row i is the distribution
node i was drawn from (see verify.py for siblings). `scores[i]` is the drafter's estimate that node i is accepted
(for a draft model, the product of draft probabilities along its path): the planner keeps the best nodes.
"""

from __future__ import annotations

from collections.abc import Generator

import torch

from specdecode.drafters.draft import Draft, DraftContext, Event, Needs
from specdecode.drafters.lockstep import run_alone
from specdecode.models.parts import Part

__all__ = ["Draft", "DraftContext", "Drafter", "Needs"]


class Drafter:
    """The base every drafter extends: `fork`, `reset`, `propose` (or `drafting`) and `commit`, plus the
    capabilities below, declared here with the defaults of a drafter that needs nothing."""

    needs: Needs = Needs()  # what it needs from the engine (drafters/draft.py), declared once
    name: str = "drafter"  # what statistics call it: which drafter proposed each accepted token
    forward_s: float = 0.0  # its running seconds per forward (the planner's estimate of a catch-up)
    drafting_s: float = 0.0  # what its last draft cost, catching up excluded

    @property
    def proposer(self) -> str:
        """Who proposed the last draft: its name (a drafter that chooses among others names the one it chose)."""
        return self.name

    @property
    def trained_weights(self) -> torch.nn.Module | None:
        """A trained head's weights (what the benchmark counts as this drafter's); None for the others."""
        return None

    def fork(self) -> Drafter:
        """A fresh drafter with the same settings (and shared weights), for another request."""
        raise NotImplementedError

    def reset(self) -> None:
        """Forget everything about the previous request."""

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        """Guess up to `max_tokens` tokens that follow `ctx.tokens`."""
        return run_alone(self.drafting(ctx, max_tokens), self.needs.forward_model, self)

    def drafting(self, ctx: DraftContext, max_tokens: int) -> Generator[Part, torch.Tensor, Draft]:
        """`propose` as a generator of the forwards of `needs.forward_model`: yields each Part, is sent its
        logits, returns the Draft. A drafter without such forwards yields none."""
        return self.propose(ctx, max_tokens)
        yield  # a generator all the same

    def commit(self, accepted: list[int], verified: list[int] | None = None) -> None:
        """The target kept these nodes of the last draft (root to leaf); roll own state to match. `verified`:
        the nodes of that draft the target saw (the planner may have cut it to fewer), None = all."""

    def behind(self, tokens: list[int]) -> int:
        """Tokens its own state lacks: what its next draft first feeds (a prompt, or steps it sat out)."""
        return 0

    def hear(self, event: Event) -> None:
        """One of the events in drafters/draft.py (the target's top guesses after a forward, a draft passed over,
        a step sat out, the request finished, a forward's time): a drafter handles those it learns from."""

    def prediction_counts(self) -> tuple[int, int] | None:
        """(tokens predicted, of those accepted so far) for a request that came with a prediction (Predicted
        Outputs, drafters/prediction.py); None for the others."""
        return None

    def memories(self) -> list:
        """What it learns across requests (a recycling table, a suffix pool), each with `snapshot()` and
        `restore(state)`: a benchmark runs every repeat of a prompt from the same memory."""
        return []

