"""Every cost decision of speculation, in one place: which requests draft this step, how far a draft grows, which
of its nodes are verified, copy or model in `hybrid`, what catching up costs, and what size a request gets.

The unit is tokens per second. A verify forward over m rows costs C(m) (budget.CostCurve, measured once per
machine, then each size's median time in use: budget.InUseCurve). A drafter scores each node with its estimate
that the target accepts it; keeping the best n nodes of a draft is expected to emit 1 + (sum of their scores)
tokens (the expected accepted length of a tree is the sum over its nodes of P(node accepted), plus the target's
own token) for what drafting took plus C(rows + n). In a batch the other requests' rows share the forward: a node costs what
it adds at that size. "No draft this step" is one of the answers: a request whose drafting is not expected to pay
decodes plainly, and tries again now and then.

Drafters report what they know (node scores, their own seconds per forward, how far behind they are) and ask the
`StepPlan` handed to them whether to grow a tree or to copy; the engine asks the `Planner` the rest. With a fixed
draft size (`num_draft_tokens`) there is no cost curve and a draft grows while the drafter is sure of its newest
best guess (`min_confidence`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from specdecode.planner.budget import CostCurve, InUseCurve
from specdecode.config import SamplingParams
from specdecode.errors import SpecdecodeError

if TYPE_CHECKING:
    from specdecode.engine.sequence import Sequence, Step

# --- the tuned constants, each with where its value came from (BENCHMARKS.md sections in quotes) ---------------
MAX_AUTO_NODES = 16  # the most nodes an automatic size verifies: the end of the measured cost curve (budget.py)
# A seeded sampled request served beside others gets this fixed size instead of an automatic one, which follows
# load and timing and would change its draws: the pre-cost-curve default k ("Draft length default").
SEEDED_NUM_DRAFT_TOKENS = 4
# A request with a prediction under a method that never drafts (no cost curve measured) copies this many (not swept).
PREDICTION_DRAFT_TOKENS = 8
DRAFT_MIN_CONFIDENCE = 0.5  # fixed size: a draft model stops below this top probability ("Draft length default")
HEAD_MIN_CONFIDENCE = 0.3  # the same for an EAGLE head, lower: its 2nd-3rd guesses are often right (docs/train.md)
# The most prompt tokens a draft model reads (its first few and the newest). It reads a prompt at about a third of
# the target's prefill cost, which a short answer does not pay back: on RAG and summary prompts of 400-560 tokens
# `hybrid` went from 0.90x `none` with the whole prompt to 0.94x with 256 and 1.01x with 128, and 0.96-0.98x with
# 64 or 32 (the draft guesses worse); the dev sets 1.21x -> 1.24x with 128 ("A window on the draft's prompt").
DRAFT_WINDOW = 128
COPY_MIN_SCORE = 0.5  # hybrid, fixed size: copy when the first copied token is at least an even bet (not swept)
# P(a draft model's next guess is accepted | the guess it follows was), for one more draft forward's worth:
# 0.83 measured on the dev sets; weighing the best child at 0.8 instead of as a sure thing cut the drafted tokens
# that lose on other kinds of work (1.17x vs 1.11x `none`; on unused prompts of those kinds 1.15x vs 1.06x), and
# was level to 2.7% ahead on the dev sets; 0.6 cut good drafts there (1.32x vs 1.41x) ("Draft trees by default").
FOLLOW = 0.8
# A model drafter's confidence in a node given its parent, against how often the target accepted such nodes in this
# request (drafters/tree_growth.py, DepthTrust), kept apart for the first depth and the deeper ones: on the dev
# sets both matched, on translation and answers from a passage the deeper ones promised more than they gave
# ("Believing the draft model's scores"). A step's evidence weighs MODEL_TRUST_DECAY less after each later step,
# and MODEL_TRUST_PRIOR tokens of "as promised" always stay, so a depth that stopped being drafted drifts back to
# being believed and is tried again. Held to MODEL_TRUST_RANGE: a few lucky steps cannot make it draft without limit.
MODEL_TRUST_DECAY = 0.9
MODEL_TRUST_PRIOR = 1.0
MODEL_TRUST_RANGE = (0.3, 1.25)
PRIOR_SPEEDUP = 1.3  # hybrid: the model's value before its first step, x a one-token forward's rate ("Hybrid drafter")
RECORD_WEIGHT = 0.25  # hybrid: a step's weight in the model's running record ("Hybrid drafter"; not swept)
FORWARD_WEIGHT = 0.2  # a forward's weight in a drafter's running seconds per forward (not swept)
CHEAP_DRAFT = 0.02  # a drafter under this share of a step always proposes: n-gram, ~0.1 of ~25 ms ("Batched serving")
CATCH_UP_STEPS = 8  # a draft model's catching up is paid back over at most this many steps ("Batched serving")
PRIOR_GAIN = 2.0  # accepted tokens per drafted step before any is measured: the dev sets' 2-3 ("Hybrid drafter")
PRIOR_WEIGHT = 4.0  # drafted steps the engine-wide gain weighs beside a request's own ("Batched serving"; not swept)
PRIOR_NODES = 4.0  # nodes per drafted step before any is measured: the old fixed k ("Draft length default")
OWN_WEIGHT = 0.3  # a step's weight in a request's own running estimates ("Batched serving"; not swept)
SHARED_WEIGHT = 0.1  # a step's weight in the engine-wide estimates ("Batched serving"; not swept)
# A request kept from drafting retries after this many steps, only in batches this small: in larger ones a draft
# model's retry and catch-up cost everyone ("Batched serving": retries cost 15% in small per-replica batches).
EXPLORE_EVERY = 16
EXPLORE_BATCH = 2


def best_count(costs: CostCurve, scores: list[float], draft_seconds: float = 0.0, tokens: float = 1.0,
               rows: int = 1, sunk_rows: int = 0) -> int:
    """How many of the nodes (scores sorted best first) to verify: argmax (1 + sum) / (D + C(n + 1)).
    In a batch the forward also carries `rows` other rows that yield `tokens` tokens without any draft (a
    request's root each), and `sunk_rows` of prompt chunks, paid for whatever is drafted: the nodes then
    cost what they add at that size, C(all + n) - C(all), on top of C(rows)."""
    every = rows + sunk_rows
    plain = draft_seconds + costs.cost(rows)
    best, best_rate, expected = 0, tokens / plain, tokens
    before = costs.cost(every)
    # the prices of every size at once: the loop runs ~900 times a step's worth of nodes, once per draft forward
    for n, (score, price) in enumerate(zip(scores, costs.span(every + 1, len(scores))), start=1):
        expected += score
        rate = expected / (plain + price - before)
        if rate > best_rate:
            best, best_rate = n, rate
    return best


def running_mean(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new


@dataclass
class Record:
    """A drafter's running tokens and seconds per step (hybrid's record of its model)."""

    tokens: float = 0.0
    seconds: float = 0.0  # 0: no step yet

    def add(self, tokens: float, seconds: float) -> None:
        if self.seconds == 0.0:
            self.tokens, self.seconds = tokens, seconds
            return
        self.tokens = running_mean(self.tokens, tokens, RECORD_WEIGHT)
        self.seconds = running_mean(self.seconds, seconds, RECORD_WEIGHT)


@dataclass(frozen=True)
class StepPlan:
    """What one request's draft may cost this step, for the questions its drafter asks while proposing."""

    costs: CostCurve | None = None  # None: a fixed draft size
    others_tokens: float = 0.0  # tokens the other requests' rows yield in the same forward
    others_rows: int = 0  # rows they (and prompt chunks) put in it

    def grow(self, scores: list[float], best_score: float, best_prob: float, spent: float, forward_s: float,
             min_confidence: float, max_tokens: int, follow: float = FOLLOW) -> bool:
        """One more draft forward for a tree whose nodes score `scores`, best new node scoring `best_score` with
        the drafter's confidence `best_prob`, after `spent` seconds of drafting, a forward costing `forward_s`?
        `follow`: P(its best child is accepted | it is)."""
        if self.costs is None:  # fixed size: grow while the drafter is sure of its newest best guess
            return best_prob >= min_confidence
        # One more draft forward adds about best_score * follow expected tokens: its best child, accepted when the
        # node it is fed from is, `follow` of the time (a child never scores above its parent).
        costs = self.costs
        ranked = sorted(scores, reverse=True)[:max_tokens]
        tokens, rows = 1.0 + self.others_tokens, 1 + self.others_rows
        n = best_count(costs, ranked, spent, tokens, rows)
        expected, now = tokens + sum(ranked[:n]), spent + costs.cost(rows + n)
        grown = spent + forward_s + costs.cost(rows + n + 1)
        return (expected + follow * best_score) / grown > expected / now

    def copy_value(self, copy_scores: list[float], max_tokens: int) -> float:
        """What a copied draft (node scores) is worth: tokens per second of verifying its best nodes (0: none
        pay). With a fixed size (no curve): its first node's score."""
        costs = self.costs
        if costs is None:
            return copy_scores[0] if copy_scores else 0.0
        ranked = sorted(copy_scores, reverse=True)[:max_tokens]
        n = best_count(costs, ranked)
        return (1.0 + sum(ranked[:n])) / costs.cost(n + 1) if n else 0.0

    def copy_pays(self, copy_scores: list[float], max_tokens: int, model: Record) -> bool:
        """hybrid: is a copied draft (node scores) worth at least the model's record in this request?"""
        return self.copy_beats(self.copy_value(copy_scores, max_tokens), model)

    def copy_beats(self, copy_value: float, model: Record) -> bool:
        """Is a copied draft worth `copy_value` (as copy_value measures) at least the model's record in this request?"""
        if self.costs is None:
            return copy_value >= COPY_MIN_SCORE
        if copy_value == 0.0:
            return False
        model_rate = PRIOR_SPEEDUP / self.costs.cost(1) if model.seconds == 0.0 else model.tokens / model.seconds
        return copy_value >= model_rate

    def beats_plain(self, record: Record) -> bool:
        """Does a drafter with this record in the request make more tokens per second than plain decoding (yes
        before its first step, or without a cost curve)?"""
        if self.costs is None or record.seconds == 0.0:
            return True
        return record.tokens / record.seconds >= 1.0 / self.costs.cost(1)

    def step_seconds(self, drafting_s: float, rows: int) -> float:
        """What a drafted step cost: its drafting plus a verify forward over `rows` (0 without a curve)."""
        return drafting_s + self.costs.cost(rows) if self.costs is not None else 0.0


FIXED = StepPlan()


@dataclass
class Outlook:
    """What drafting has been worth for one request: the gate's estimates."""

    draft_s: float | None = None  # seconds its drafter takes per step (running mean); None = not known yet
    nodes: float = PRIOR_NODES  # nodes it verifies per drafted step (running mean)
    steady: bool = False  # it drafted the step before too: no catching up in this step's drafting time
    idle: int = 0  # steps since it last drafted


class Planner:
    def __init__(self, costs: CostCurve | None) -> None:
        """`costs`: the target's verify cost curve (None: only fixed draft sizes can run)."""
        self.costs = costs
        self.in_use = InUseCurve(costs) if costs is not None else None
        self.outlook: dict[Sequence, Outlook] = {}
        self.prior = Outlook()  # engine-wide running estimates, over every request so far
        self.prior_gain = PRIOR_GAIN  # accepted tokens per drafted step, engine-wide
        self.alone_factor = 1.0  # a batched drafter's share of the last draft forwards -> its time alone

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

    def join(self, seq: Sequence) -> None:
        self.outlook[seq] = Outlook(None, self.prior.nodes)

    def leave(self, seq: Sequence) -> None:
        self.outlook.pop(seq, None)

    # --- one step -------------------------------------------------------------------------------------------

    def plan(self, seq: Sequence, decoding: int, prefill_rows: int) -> StepPlan:
        """What `seq`'s draft may cost in a forward with `decoding` requests and `prefill_rows` prompt rows."""
        if not seq.auto:
            return FIXED
        return StepPlan(self.costs, decoding - 1, decoding - 1 + prefill_rows)

    def choose(self, decoding: list[Sequence], prefill_rows: int) -> set[Sequence]:
        """The decoding requests that draft this step: every fixed-size one, a request decoding alone, and the
        automatic ones the gate lets through when several decode. Alone, a drafter's own decisions (grow one
        more depth? `StepPlan.grow`) and the cut weigh each forward against the verify cost as it happens; the
        gate's running means only lag behind them: gated, the 0.5B draft model drafted in 37% of a lone
        request's steps on the dev sets (3 of 63 in one turn), its accepted length fell from 3.21 to 1.94 and its
        speedup from 1.17x to 1.09x (BENCHMARKS.md, "One engine")."""
        gated = [s for s in decoding if s.auto] if len(decoding) > 1 else []
        chosen = set(self._gate(gated, len(decoding), prefill_rows)) if gated else set()
        for seq in decoding:
            look = self.outlook[seq]
            look.steady = seq.proposed  # it drafted last step: no catching up in this step's time
            if seq in gated and seq not in chosen:
                look.idle += 1
            else:
                look.idle = 0
                chosen.add(seq)
        return chosen

    def drafted_together(self, count: int) -> None:
        """`count` drafters' forwards just ran batched: what one of them would have taken alone is its share
        times count * C(1) / C(count) (the target's curve standing in for the draft model's)."""
        if self.costs is not None:
            self.alone_factor = count * self.costs.cost(1) / self.costs.cost(count)

    def cut(self, decoding: list[Sequence], prefill_rows: int) -> None:
        """Keep the nodes worth verifying: every automatic draft's nodes, best scores first, while (tokens of the
        batch + their scores) / (drafting time + C(rows)) still grows."""
        proposed = [s for s in decoding if s.auto and s.proposed and s.draft.scores and len(s.draft)]
        if not proposed:
            return
        draft_seconds = sum(s.draft_seconds for s in proposed)  # one after another on this thread
        fixed_rows = sum(len(s.draft) for s in decoding if not s.auto)
        ranked = sorted(((score, i, node) for i, s in enumerate(proposed) for node, score in enumerate(s.draft.scores)),
                        key=lambda t: (-t[0], t[1], t[2]))
        keep = best_count(self.costs, [t[0] for t in ranked], draft_seconds, tokens=len(decoding),
                          rows=len(decoding) + fixed_rows, sunk_rows=prefill_rows)
        counts = [0] * len(proposed)
        for _, i, _ in ranked[:keep]:
            counts[i] += 1
        for seq, count in zip(proposed, counts):
            seq.keep_best(count)

    def observe(self, rows: int, seconds: float) -> None:
        """A target forward over `rows` rows took `seconds` (CPU only: CUDA runs ahead of the clock)."""
        if self.in_use is not None:
            self.costs = self.in_use.observe(rows, seconds)

    def learn(self, seq: Sequence, step: Step) -> None:
        """After `seq`'s verify: its drafting time, its nodes and what was accepted update the estimates."""
        if not seq.proposed:
            return
        look, n = self.outlook[seq], len(seq.draft)
        look.nodes = running_mean(look.nodes, n, OWN_WEIGHT)
        self.prior.nodes = running_mean(self.prior.nodes, n, SHARED_WEIGHT)
        if look.steady:
            seconds = seq.draft_seconds
            if seq.drafter.forward_model is not None:
                seconds *= self.alone_factor
            look.draft_s = running_mean(look.draft_s, seconds, OWN_WEIGHT)
            self.prior.draft_s = running_mean(self.prior.draft_s, seconds, SHARED_WEIGHT)
        if n:
            self.prior_gain = running_mean(self.prior_gain, step.num_accepted, SHARED_WEIGHT)

    # --- the gate -------------------------------------------------------------------------------------------

    def _gate(self, auto: list[Sequence], decoding: int, prefill_rows: int) -> list[Sequence]:
        """The automatic requests that draft. Cheap drafters (n-gram) always do: the cut decides what their
        guesses are worth. Of the others, best value per second first, the number k that maximises the batch's
        tokens per second: (decoding + their expected gains) / (C(decoding) + drafting time + what their rows
        add to the forward). Draft-model forwards are batched (drafters/lockstep.py), so k of them draft in about
        their one-request time times C(k) / C(1). Until a drafter's cost per step is known (from any request of
        this engine), one request at a time drafts to learn it: a draft model's first draft costs it the prompt,
        which a full batch should not pay for every request."""
        costs = self.costs
        rows = decoding + prefill_rows  # prompt rows are paid for anyway: drafting is weighed against decoding
        base_seconds = costs.cost(decoding)
        chosen, candidates, explorer = [], [], None
        for seq in auto:
            look, gain = self.outlook[seq], self._gain(seq)
            draft_s = look.draft_s if look.draft_s is not None else self.prior.draft_s
            if draft_s is None:
                explorer = explorer or seq
            elif draft_s <= CHEAP_DRAFT * base_seconds:
                chosen.append(seq)
            else:
                n, catch_up = max(1, round(look.nodes)), self._catch_up(seq, gain)
                value = gain / (draft_s + catch_up + costs.cost(rows + n) - costs.cost(rows))
                candidates.append((value, seq, gain, n, draft_s, catch_up, seq.drafter.forward_model is not None))
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
            chosen.append(max(stale, key=lambda s: self.outlook[s].idle))
        return chosen

    def _catch_up(self, seq: Sequence, gain: float) -> float:
        """A draft model that sat out steps (or never drafted) first feeds what it missed, one forward over those
        rows (its cost taken as the target's curve scaled to the draft's one-row time), paid back over the steps
        the request has left."""
        behind = seq.drafter.behind(seq.tokens)
        if behind <= 2:  # the usual: the last token, maybe the last draft token
            return 0.0
        one_row = seq.drafter.forward_s or (self.prior.draft_s or 0.0) / 4
        steps_left = (seq.params.max_new_tokens - seq.stats.new_tokens) / (1.0 + gain)
        return one_row * self.costs.cost(behind) / self.costs.cost(1) / min(max(1.0, steps_left), CATCH_UP_STEPS)

    def _gain(self, seq: Sequence) -> float:
        """Expected accepted draft tokens per drafted step: the request's own record, leaning on the engine's."""
        stats = seq.stats
        return (stats.accepted_tokens + PRIOR_WEIGHT * self.prior_gain) / (stats.drafts + PRIOR_WEIGHT)
