"""Every cost decision of speculation, in one place: which requests draft this step, how far a draft grows, which
of its nodes are verified, copy or model in `hybrid`, what catching up costs, and what size a request gets.

The unit is tokens per second. A verify forward over m rows costs C(m) (budget.CostCurve, measured once per
machine, then each size's median time in use: budget.InUseCurve). A drafter scores each node with its estimate
that the target accepts it; keeping the best n nodes of a draft is expected to emit 1 + (sum of their scores)
tokens (the expected accepted length of a tree is the sum over its nodes of P(node accepted), plus the target's
own token) for what drafting took plus C(rows + n). In a batch the other requests' rows share the forward: a node
costs what it adds at that size. "No draft this step" is one of the answers: a request whose drafting is not
expected to pay decodes plainly, and tries again now and then.

Records flow one way. The engine hands the `Planner` a plain `Request` record per decoding request (what it has
accepted, what its drafter cost and how far behind it is, its draft's node scores) and applies the decisions it
returns (who drafts, how many nodes each keeps); the planner holds no request object and changes none. Drafters
ask the `StepPlan` handed to them (prices.py) whether to grow a tree or to copy. With a fixed draft size
(`num_draft_tokens`) there is no cost curve and a draft grows while the drafter is sure of its newest best guess
(`min_confidence`). The tuned constants are in tuning.py, each with where its value came from.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from specdecode.config import SamplingParams
from specdecode.errors import SpecdecodeError
from specdecode.planner.alone import AloneRecord
from specdecode.planner.budget import CostCurve, InUseCurve
from specdecode.planner.estimates import RunningMean
from specdecode.planner.prefill import PrefillSizer
from specdecode.planner.prices import FIXED, StepPlan, best_count, catch_up_forward_s
from specdecode.planner.tuning import (
    CATCH_UP_STEPS,
    CHEAP_DRAFT,
    EXPLORE_BATCH,
    EXPLORE_EVERY,
    OWN_WEIGHT,
    PREDICTION_DRAFT_TOKENS,
    PRIOR_GAIN,
    PRIOR_NODES,
    PRIOR_WEIGHT,
    SEEDED_NUM_DRAFT_TOKENS,
    SHARED_WEIGHT,
)


@dataclass(slots=True)
class Request:
    """What the planner reads of one decoding request in a step: plain values the engine copies from its state
    (engine/sequence.py, `Sequence.record`)."""

    key: int  # the request's identity, for the planner's running estimates of it
    auto: bool  # its draft size is the planner's to choose (False: a fixed num_draft_tokens)
    proposed: bool  # its drafter proposed this step (before this step's drafting: the step before)
    scores: list[float] | None  # this step's draft's node scores (None: no draft, or a drafter without scores)
    nodes: int  # nodes in this step's draft
    draft_seconds: float  # what proposing took this step
    batched: bool  # its drafter's forwards batch with other requests' (a draft model)
    accepted_tokens: int  # draft tokens accepted so far
    drafts: int  # steps that verified a draft so far
    tokens_left: int  # new tokens it may still generate
    cached: int = 0  # tokens in its cache: what its verify rows attend to


# What the gate asks of a request it weighs, and only then (asking costs a scan of the drafter's state, and reading
# its seconds per forward folds in the forwards timed so far): key -> (tokens its drafter's own state lacks, its
# seconds per forward where it lacks more than two, else 0).
Lag = Callable[[int], tuple[int, float]]


class Outlook:
    """What drafting has been worth for one request (or, as the prior, for every request so far): the gate's
    estimates."""

    __slots__ = ("draft_time", "node_count", "steady", "idle", "alone")

    def __init__(self, weight: float, nodes: float = PRIOR_NODES) -> None:
        self.draft_time = RunningMean(weight)  # seconds its drafter takes per step; None = not known yet
        self.node_count = RunningMean(weight, nodes)  # nodes it verifies per drafted step
        self.steady = False  # it drafted the step before too: no catching up in this step's drafting time
        self.idle = 0  # steps since it last drafted
        self.alone = AloneRecord()  # its steps while it decodes alone: whether it drafts then

    @property
    def draft_s(self) -> float | None:
        return self.draft_time.value

    @draft_s.setter
    def draft_s(self, seconds: float | None) -> None:
        self.draft_time.value = seconds

    @property
    def nodes(self) -> float:
        return self.node_count.value


class Planner:
    def __init__(self, costs: CostCurve | None) -> None:
        """`costs`: the target's verify cost curve (None: only fixed draft sizes can run)."""
        self.costs = costs
        self.in_use = InUseCurve(costs) if costs is not None else None
        self.outlook: dict[int, Outlook] = {}  # by Request.key
        self.prior = Outlook(SHARED_WEIGHT)  # engine-wide running estimates, over every request so far
        self.gain = RunningMean(SHARED_WEIGHT, PRIOR_GAIN)  # accepted tokens per drafted step, engine-wide
        self.alone_factor = 1.0  # a batched drafter's share of the last draft forwards -> its time alone
        self.alone_key: int | None = None  # the request that decodes alone this step (None: several, or none)
        self.forward_s: float | None = None  # this step's target forward, where forwards are timed
        self.prefill = PrefillSizer()  # prompt rows a step, while others decode
        self.step_costs = costs  # this step's prices: the curve at its decoding requests' context (context_cost.py)

    # --- a request's size -----------------------------------------------------------------------------------

    def draft_size(self, requested: int | None, default: int | None) -> int | None:
        """The draft size a request runs with: its own, else the engine's; None = automatic."""
        k = default if requested is None else requested
        if k is None and self.costs is None:
            raise SpecdecodeError("an automatic draft size needs the verify cost curve: give num_draft_tokens")
        return k

    @staticmethod
    def served_size(requested: int | None, default: int | None, params: SamplingParams) -> int | None:
        """The size a served request asks for: a seeded sampled one that would run automatic gets a fixed size
        (its draws then do not depend on the other requests in the batch, nor on the machine's timing)."""
        if requested is None and default is None and params.seed is not None and not params.greedy:
            return SEEDED_NUM_DRAFT_TOKENS
        return requested

    def prediction_size(self, k: int | None) -> int | None:
        """The size of a request with a prediction (Predicted Outputs) under a method that never drafts (k == 0):
        it still copies the prediction, sized each step where the cost curve is known, else a fixed size."""
        if k != 0:
            return k
        return None if self.costs is not None else PREDICTION_DRAFT_TOKENS

    def join(self, key: int) -> None:
        self.outlook[key] = Outlook(OWN_WEIGHT, self.prior.nodes)

    def leave(self, key: int) -> None:
        self.outlook.pop(key, None)

    # --- one step -------------------------------------------------------------------------------------------

    def plan(self, auto: bool, decoding: int, prefill_rows: int) -> StepPlan:
        """What a request's draft may cost in a forward with `decoding` requests and `prefill_rows` prompt rows
        (`auto`: its size is the planner's to choose)."""
        if not auto:
            return FIXED
        return StepPlan(self.step_costs, decoding - 1, decoding - 1 + prefill_rows)

    def choose(self, decoding: list[Request], prefill_rows: int, lag: Lag | None = None) -> set[int]:
        """The decoding requests that draft this step: every fixed-size one, an automatic one decoding alone while
        its drafted steps beat its plain ones (alone.py), and the automatic ones the gate lets through when
        several decode. Alone, a drafter's own decisions (grow one
        more depth? `StepPlan.grow`) and the cut weigh each forward against the verify cost as it happens; the
        gate's running means only lag behind them: gated, the 0.5B draft model drafted in 37% of a lone
        request's steps on the dev sets (3 of 63 in one turn), its accepted length fell from 3.21 to 1.94 and its
        speedup from 1.17x to 1.09x ("One engine"). `lag`: what a request the gate weighs lacks (needed only
        when several decode). -> the keys of those that draft."""
        self.step_costs = self._at_context(decoding)
        gated = [r for r in decoding if r.auto] if len(decoding) > 1 else []
        chosen = set(self._gate(gated, len(decoding), prefill_rows, lag)) if gated else set()
        alone = len(decoding) == 1 and not prefill_rows
        self.alone_key, self.forward_s = (decoding[0].key if alone else None), None
        for request in decoding:
            look = self.outlook[request.key]
            look.steady = request.proposed  # it drafted last step: no catching up in this step's time
            if alone and request.auto:  # its own record against its plain steps (alone.py)
                drafts = look.alone.drafts(self.step_costs.cost(1))
            elif len(decoding) == 1:  # beside a prompt's chunk: its steps are not its own to time
                drafts = True
            else:
                drafts = not request.auto or request.key in chosen
            if drafts:
                look.idle = 0
                chosen.add(request.key)
            else:
                look.idle += 1
        return chosen

    def drafted_together(self, count: int) -> None:
        """`count` drafters' forwards just ran batched: what one of them would have taken alone is its share
        times count * C(1) / C(count) (the target's curve standing in for the draft model's)."""
        if self.costs is not None:
            self.alone_factor = count * self.costs.cost(1) / self.costs.cost(count)

    def cut(self, decoding: list[Request], prefill_rows: int) -> dict[int, int]:
        """Keep the nodes worth verifying: every automatic draft's nodes, best scores first, while (tokens of the
        batch + their scores) / (drafting time + C(rows)) still grows. -> {key: nodes to keep, best first} for
        each automatic draft (the engine keeps them: Draft.best)."""
        proposed = [r for r in decoding if r.auto and r.proposed and r.scores and r.nodes]
        if not proposed:
            return {}
        draft_seconds = sum(r.draft_seconds for r in proposed)  # one after another on this thread
        fixed_rows = sum(r.nodes for r in decoding if not r.auto)
        ranked = sorted(((score, i, node) for i, r in enumerate(proposed) for node, score in enumerate(r.scores)),
                        key=lambda t: (-t[0], t[1], t[2]))
        keep = best_count(self.step_costs, [t[0] for t in ranked], draft_seconds, tokens=len(decoding),
                          rows=len(decoding) + fixed_rows, sunk_rows=prefill_rows)
        counts = [0] * len(proposed)
        for _, i, _ in ranked[:keep]:
            counts[i] += 1
        return {r.key: count for r, count in zip(proposed, counts)}

    def prefill_rows(self, decode_rows: int) -> int:
        """Prompt rows this step feeds (prefill.py), beside about `decode_rows` decoding rows."""
        return self.prefill.rows(self.costs, decode_rows)

    def observe(self, rows: int, seconds: float, prompt_rows: int = 0, parts: list[tuple[int, int]] = ()) -> None:
        """A target forward over `rows` rows, `prompt_rows` of them prompt chunks, took `seconds` (CPU only: CUDA
        runs ahead of the clock). `parts`: (rows, cached tokens) of each request's share, for what their caches
        added: the in-use curve learns the forward's price after a short prefix, the one the curve is measured at."""
        self.forward_s = seconds
        self.prefill.observe(prompt_rows, seconds)
        if self.in_use is not None:
            context = self.costs.context
            if context is not None and parts:
                # at least half its time stays: a context model measured too dear must not price rows at nothing
                seconds = max(seconds - sum(context.seconds(m, cached) for m, cached in parts), 0.5 * seconds)
            self.costs = self.in_use.observe(rows, seconds)

    def learn(self, request: Request, num_accepted: int) -> None:
        """After a request's verify: its drafting time, its nodes and what was accepted update the estimates."""
        look = self.outlook[request.key]
        if request.key == self.alone_key and self.forward_s is not None and request.auto:
            # a drafted step that kept no node still paid its drafting: charged to drafting
            look.alone.add(request.proposed, num_accepted + 1,
                           (request.draft_seconds if request.proposed else 0.0) + self.forward_s)
        if not request.proposed:
            return
        n = request.nodes
        look.node_count.add(n)
        self.prior.node_count.add(n)
        if look.steady:
            seconds = request.draft_seconds
            if request.batched:
                seconds *= self.alone_factor
            look.draft_time.add(seconds)
            self.prior.draft_time.add(seconds)
        if n:
            self.gain.add(num_accepted)

    # --- the gate -------------------------------------------------------------------------------------------

    def _gate(self, auto: list[Request], decoding: int, prefill_rows: int, lag: Lag | None = None) -> list[int]:
        """The automatic requests that draft. Cheap drafters (n-gram) always do: the cut decides what their
        guesses are worth. Of the others, best value per second first, the number k that maximises the batch's
        tokens per second: (decoding + their expected gains) / (C(decoding) + drafting time + what their rows
        add to the forward). Draft-model forwards are batched (drafters/lockstep.py), so k of them draft in about
        their one-request time times C(k) / C(1). Until a drafter's cost per step is known (from any request of
        this engine), one request at a time drafts to learn it: a draft model's first draft costs it the prompt,
        which a full batch should not pay for every request. -> the keys of those that draft."""
        costs = self.step_costs
        rows = decoding + prefill_rows  # prompt rows are paid for anyway: drafting is weighed against decoding
        base_seconds = costs.cost(decoding)
        chosen, candidates, explorer = [], [], None
        for request in auto:
            look, gain = self.outlook[request.key], self._gain(request)
            draft_s = look.draft_s if look.draft_s is not None else self.prior.draft_s
            if draft_s is None:
                explorer = explorer if explorer is not None else request.key
            elif draft_s <= CHEAP_DRAFT * base_seconds:
                chosen.append(request.key)
            else:
                n, catch_up = max(1, round(look.nodes)), self._catch_up(request, gain, lag)
                value = gain / (draft_s + catch_up + costs.cost(rows + n) - costs.cost(rows))
                candidates.append((value, request.key, gain, n, draft_s, catch_up, request.batched))
        if explorer is not None:
            chosen.append(explorer)
        candidates.sort(key=lambda c: -c[0])
        best, best_rate = 0, decoding / base_seconds
        tokens, nodes, alone_s, batched_s, batched, catch_ups = float(decoding), 0, 0.0, 0.0, 0, 0.0
        for k, (_, _, gain, n, draft_s, catch_up, together) in enumerate(candidates, start=1):
            tokens, nodes, catch_ups = tokens + gain, nodes + n, catch_ups + catch_up
            if together:
                batched, batched_s = batched + 1, batched_s + draft_s
            else:
                alone_s += draft_s
            drafting = alone_s + catch_ups + (batched_s / batched * costs.cost(batched) / costs.cost(1)
                                              if batched else 0.0)
            rate = tokens / (base_seconds + drafting + costs.cost(rows + nodes) - costs.cost(rows))
            if rate > best_rate:
                best, best_rate = k, rate
        chosen += [c[1] for c in candidates[:best]]
        stale = [c[1] for c in candidates[best:] if self.outlook[c[1]].idle >= EXPLORE_EVERY]
        if stale and explorer is None and decoding <= EXPLORE_BATCH:
            chosen.append(max(stale, key=lambda key: self.outlook[key].idle))
        return chosen

    def _catch_up(self, request: Request, gain: float, lag: Lag | None) -> float:
        """A draft model that sat out steps (or never drafted) first feeds what it missed, one forward over those
        rows (its cost taken as the target's curve scaled to the draft's one-row time), paid back over the steps
        the request has left."""
        behind, forward_s = lag(request.key) if lag is not None else (0, 0.0)
        return catch_up_seconds(self.costs, behind, forward_s or (self.prior.draft_s or 0.0) / 4,
                                request.tokens_left / (1.0 + gain))

    def _at_context(self, decoding: list[Request]) -> CostCurve | None:
        """The curve at this step's context: its decoding requests' mean cached tokens, each reading its own
        cache (prompt chunks' attention is paid whatever is drafted, and left out)."""
        if self.costs is None or self.costs.context is None or not decoding:
            return self.costs
        return self.costs.at(sum(r.cached for r in decoding) // len(decoding), len(decoding))

    def _gain(self, request: Request) -> float:
        """Expected accepted draft tokens per drafted step: the request's own record, leaning on the engine's."""
        return (request.accepted_tokens + PRIOR_WEIGHT * self.gain.value) / (request.drafts + PRIOR_WEIGHT)


def catch_up_seconds(costs: CostCurve, behind: int, one_row_s: float, steps_left: float) -> float:
    """What feeding `behind` missed tokens in one draft forward costs per step, paid back over the steps left (at
    most CATCH_UP_STEPS), the forward's cost taken as the target's curve scaled to the draft's one-row time."""
    if behind <= 2:  # the usual: the last token, maybe the last draft token
        return 0.0
    return catch_up_forward_s(costs, behind, one_row_s) / min(max(1.0, steps_left), CATCH_UP_STEPS)
