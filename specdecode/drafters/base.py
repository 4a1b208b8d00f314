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

from specdecode.drafters.draft import Draft, DraftContext
from specdecode.drafters.lockstep import run_alone
from specdecode.models.parts import Part

__all__ = ["Draft", "DraftContext", "Drafter"]


class Drafter:
    """The base every drafter extends: `fork`, `reset`, `propose` (or `drafting`) and `commit`, plus the
    capabilities below, declared here with the defaults of a drafter that needs nothing."""

    feature_layers: tuple[int, ...] = ()  # target layers whose inputs it reads (after the final hidden state)
    reads_every_position: bool = False  # hidden states of every position, not just the last step's
    reads_hidden: bool = False  # reads DraftContext.hidden at all (a trained head); others get None
    forward_s: float = 0.0  # its running seconds per forward (the planner's estimate of a catch-up)
    drafting_s: float = 0.0  # what its last draft cost, catching up excluded
    cache_bytes_per_token: int = 0  # what its own KV cache holds per token of context (in the engine's KV budget)
    name: str = "drafter"  # what statistics call it: which drafter proposed each accepted token
    target_topk: int = 0  # the target's likeliest next tokens it learns from after every forward (`saw_target`)

    @property
    def proposer(self) -> str:
        """Who proposed the last draft: its name (a drafter that chooses among others names the one it chose)."""
        return self.name

    @property
    def forward_model(self) -> torch.nn.Module | None:
        """The model whose forwards `drafting` yields: the engine batches them across requests. None: it drafts
        without forwards of its own, or runs them itself (`propose`)."""
        return None

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
        return run_alone(self.drafting(ctx, max_tokens), self.forward_model, self)

    def drafting(self, ctx: DraftContext, max_tokens: int) -> Generator[Part, torch.Tensor, Draft]:
        """`propose` as a generator of the forwards of `forward_model` it needs: yields each Part, is sent its
        logits, returns the Draft. A drafter without such forwards yields none."""
        return self.propose(ctx, max_tokens)
        yield  # a generator all the same

    def commit(self, accepted: list[int], verified: list[int] | None = None) -> None:
        """The target kept these nodes of the last draft (root to leaf); roll own state to match. `verified`:
        the nodes of that draft the target saw (the planner may have cut it to fewer), None = all."""

    def passed_over(self, accepted: list[int], verified: list[int]) -> None:
        """Its last draft was not taken (another drafter proposed): what it would have given against the tokens
        that followed (as `commit` takes them), to learn from; its state stays as it is."""

    def behind(self, tokens: list[int]) -> int:
        """Tokens its own state lacks: what its next draft first feeds (a prompt, or steps it sat out)."""
        return 0

    def forward_took(self, seconds: float) -> None:
        """One of its forwards (its share, when batched with other requests') took `seconds`."""

    def saw_target(self, tokens: torch.Tensor, top: torch.Tensor, proposed: list[int] | None = None) -> None:
        """After the target's forward over `tokens` [rows] (the root and the draft nodes it verified, whether or
        not this drafter proposed them): its `target_topk` likeliest next tokens after each row [rows, k].
        `proposed`: each draft row's index in the draft as proposed (the planner may have cut it), None = same."""

    def prediction_counts(self) -> tuple[int, int] | None:
        """(tokens predicted, of those accepted so far) for a request that came with a prediction (Predicted
        Outputs, drafters/prediction.py); None for the others."""
        return None

    def memories(self) -> list:
        """What it learns across requests (a recycling table, a suffix pool), each with `snapshot()` and
        `restore(state)`: a benchmark runs every repeat of a prompt from the same memory."""
        return []

    def finished(self, answer: list[int]) -> None:
        """Its request ended with this answer (not cancelled, not failed): a drafter that learns across requests
        (suffix decoding's pool) keeps it."""

    def sat_out(self, ctx: DraftContext) -> None:
        """Another drafter proposed this step in its place (hybrid): keep what it will need later."""
