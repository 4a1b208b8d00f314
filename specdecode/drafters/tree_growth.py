"""Growing a draft tree best nodes first, shared by drafters that score tokens with a model (a draft model, an
EAGLE head): which children each expanded node gets, asking the planner's `StepPlan` whether one more draft
forward pays, and the Draft the best nodes make. How the tree grows is told in draft_model.py.

A drafter using it sets, in its `__init__`, `device`, `head_tokens` (the vocabulary id of each logit its head
scores, None for the target's whole vocabulary), `width`, `expand`, `max_depth`, `min_confidence`, `vocab_size`
(the target's) and `clock` (a ForwardTime its forks share), and `trust = DepthTrust()` there and in `reset`;
growing sets `nodes` and `kept`, and its `commit` calls `learn_trust`.

A node's score is the product along its path of the draft's confidences, each believed as far as the drafter's
`DepthTrust` in this request says: a model drafter's probabilities are about right on the text it was tuned on
and too sure where it guesses worse (translation, answers from a passage), most of all past the first depth.
Scores that promise what the target gives size the tree and the verify cut to what pays on this text.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from specdecode.drafters.base import Draft, DraftContext, Drafter
from specdecode.drafters.draft import Event, ForwardTook
from specdecode.models.parts import RowSlots
from specdecode.planner.estimates import RunningMean, RunningRate
from specdecode.planner.tuning import FOLLOW, FORWARD_WEIGHT, MODEL_TRUST_DECAY, MODEL_TRUST_PRIOR, MODEL_TRUST_RANGE
from specdecode.sampling import greedy_topk_lists, gumbel_topk, to_probs

Request = TypeVar("Request")


@dataclass(slots=True)
class Node:
    token: int
    parent: int  # node index, -1 = root
    depth: int
    prob: float  # the draft's confidence in it given its parent: its probability (greedy), the largest probability
    # left in the distribution it was drawn from (sampling)
    score: float  # the estimate that the target accepts it: the product along its path of the confidences, each
    # times the drafter's trust at its depth (at most 1)
    dist: int  # index of the distribution (of its parent's expansion) it was drawn from
    drawn_before: list[int]  # sibling tokens drawn before it from that distribution (its rank = their count)
    slot: int = -1  # draft cache slot once fed, -1 = never fed


@dataclass
class ForwardTime:
    """Running seconds per forward of one drafting model, shared by the drafters forked from one: what a forward
    costs on this machine is no single request's to learn. The forks in one batched forward each report their
    share: the reports since the last reading make one sample."""

    mean: RunningMean = field(default_factory=lambda: RunningMean(FORWARD_WEIGHT))
    reports: list[float] = field(default_factory=list)

    def took(self, seconds: float) -> None:
        self.reports.append(seconds)

    @property
    def seconds(self) -> float:
        if self.reports:
            self.mean.add(sum(self.reports) / len(self.reports))
            self.reports.clear()
        return self.mean.value or 0.0


class DepthTrust:
    """How far a model drafter's confidences can be believed in this request: for its first depth and for the
    deeper ones, the nodes the target accepted over the confidence they were drafted with, counting only nodes
    whose parent was accepted (a rejected node takes its whole subtree with it: counting that subtree would blame
    its descendants for it). Evidence fades by MODEL_TRUST_DECAY a step over MODEL_TRUST_PRIOR tokens that always
    say "as promised" (planner.py)."""

    def __init__(self) -> None:
        # first depth, deeper ones: accepted (hits) over promised (tried), the prior kept beside the evidence
        self.rates = [RunningRate(1.0, MODEL_TRUST_PRIOR, MODEL_TRUST_DECAY, kept=True) for _ in range(2)]

    @property
    def promised(self) -> list[float]:
        return [rate.tried for rate in self.rates]

    def factor(self, depth: int) -> float:
        low, high = MODEL_TRUST_RANGE
        return min(high, max(low, self.rates[depth > 1].value))

    def follow(self, depth: int) -> float:
        """P(the best child of a node at `depth` is accepted | the node is): FOLLOW, as believed at its depth."""
        return min(1.0, FOLLOW * self.factor(depth + 1))

    def add(self, nodes: list[Node], verified: list[int], accepted: set[int]) -> None:
        """A draft's `nodes`, of which `verified` (indices into them) were verified and `accepted` accepted."""
        for rate in self.rates:
            rate.fade()
        for i in verified:
            node = nodes[i]
            if node.parent < 0 or node.parent in accepted:
                self.rates[node.depth > 1].add(i in accepted, node.prob)


class GrowsTrees(Drafter):
    clock: ForwardTime
    trust: DepthTrust

    @property
    def forward_s(self) -> float:
        return self.clock.seconds

    def _place(self, expand: list[int], nodes: list[Node], start: int,
               base_length: int) -> tuple[list[int], list[int], RowSlots]:
        """Nodes `expand` (one depth) fed at cache slots [start, start + len(expand)) -> (their token ids, their
        rotary positions (base_length - 1 + depth), and each row's slots: the agreed prefix, its fed ancestors and
        itself; model.rows_mask makes the mask of them where a forward reads one). Records each node's slot.
        Lists: a tensor write per ancestor cost ~3 us apiece, and the native layers take the ids as lists."""
        spans, extras = [], []
        for row, i in enumerate(expand):
            nodes[i].slot = start + row
            path, ancestor = [], i
            while ancestor >= 0:
                path.append(nodes[ancestor].slot)
                ancestor = nodes[ancestor].parent
            path.sort()  # ascending along the path: the order a one-token forward of it reads them
            span, k = base_length, 0
            while k < len(path) and path[k] == span:  # fed ancestors right after the prefix extend its run
                span, k = span + 1, k + 1
            spans.append(span)
            extras.append(path[k:])
        ids, positions = [nodes[i].token for i in expand], [base_length - 1 + nodes[i].depth for i in expand]
        return ids, positions, RowSlots(spans, extras if any(extras) else [])

    def hear(self, event: Event) -> None:
        if isinstance(event, ForwardTook):
            self.clock.took(event.seconds)

    def learn_trust(self, accepted: list[int], verified: list[int] | None) -> None:
        """Its last draft's verified nodes (indices into it; None: all) and the accepted ones -> its trust."""
        kept = self.kept
        seen = kept if verified is None else [kept[i] for i in verified]
        self.trust.add(self.nodes, seen, {kept[i] for i in accepted})

    def _children(self, logits: torch.Tensor, rows: list[int], depth: int, nodes: list[Node],
                  dists: list[torch.Tensor], ctx: DraftContext) -> list[int]:
        """Add the `width` children of each row's node (rows of logits [R, vocab]); -> the new node indices."""
        logits, ids, id_list = self._draft_space(logits)  # a subset head stays in its own space: 5x fewer logits
        alive = None
        if ctx.rules is not None:
            logits = self._shaped(logits, ids, rows, nodes, ctx.rules)
            # A row whose every token the grammar rules out (a head that scores a vocabulary subset may lack the
            # one it allows) gets no children: its argmax would be a token the grammar rejects.
            alive = torch.isfinite(logits).any(-1).tolist()
        greedy = ctx.params.greedy
        # As lists, once: a tensor operation per row costs tens of microseconds on the caches a forward flushed.
        if greedy:  # the likeliest children and their probabilities, without the whole softmax: [R][width] each
            index_rows, prob_rows = greedy_topk_lists(logits, min(self.width, logits.shape[-1]))
        else:
            probs = to_probs(logits, ctx.params)  # [R, vocab]
            top_index = gumbel_topk(probs, self.width, ctx.generator)  # [R, width] a draw without replacement
            index_rows, prob_rows = top_index.tolist(), probs.gather(-1, top_index).tolist()
            likeliest = probs.topk(self.width, dim=-1)  # for each draw's confidence, see below
        token_rows = index_rows if id_list is None else [[id_list[i] for i in row] for row in index_rows]
        trust = self.trust.factor(depth)
        new = []
        if greedy:  # a child's confidence is its probability; which siblings came before it is read under sampling
            for r, parent in enumerate(rows):
                if alive is not None and not alive[r]:
                    continue
                base = 1.0 if parent < 0 else nodes[parent].score
                for token, p in zip(token_rows[r], prob_rows[r]):
                    if p <= 0.0:
                        break
                    nodes.append(Node(token, parent, depth, p, base * min(1.0, p * trust), -1, []))
                    new.append(len(nodes) - 1)
            return new
        for r, parent in enumerate(rows):
            if alive is not None and not alive[r]:
                continue
            dists.append(probs[r])
            base = 1.0 if parent < 0 else nodes[parent].score
            drawn: list[int] = []
            drawn_mass, drawn_index = 0.0, set()
            for token, index, p in zip(token_rows[r], index_rows[r], prob_rows[r]):
                if p <= 0.0:
                    break  # nothing left to draw (top-k/top-p cut the distribution short)
                # Under sampling a node's confidence must not depend on the token drawn for it: keeping a node
                # because of its own q(x) would bias which tokens reach the verifier, and the output with it. What
                # it may use is the distribution it is drawn from: the largest probability left in q after the
                # siblings drawn before it.
                left = next(v for v, i in zip(likeliest.values[r].tolist(), likeliest.indices[r].tolist())
                            if i not in drawn_index)
                confidence = min(1.0, left / max(1.0 - drawn_mass, 1e-12))  # rounding: never above its parent
                nodes.append(Node(token, parent, depth, confidence, base * min(1.0, confidence * trust),
                                  len(dists) - 1, list(drawn)))
                new.append(len(nodes) - 1)
                drawn.append(token)
                drawn_mass += p
                drawn_index.add(index)
        return new

    def _shaped(self, logits: torch.Tensor, ids: torch.Tensor | None, rows: list[int], nodes: list[Node],
                rules) -> torch.Tensor:
        """The request's penalties and grammar on draft logits [R, size] whose rows follow `rows`' nodes, in the
        whole vocabulary (a subset head's logits are placed there and read back)."""
        full = logits
        if ids is not None:
            full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
            full[:, ids] = logits
        shaped = rules.shape(full, [n.token for n in nodes], [n.parent for n in nodes], rows)
        return shaped if ids is None else shaped[:, ids]

    def _grow_tree(self, logits: torch.Tensor, ctx: DraftContext, max_tokens: int, started: float,
                   feed: Callable[[list[int], list[Node]], Request]) -> Generator[Request, torch.Tensor, Draft]:
        """Grow the tree from the root's `logits` [1, vocab], one depth a round: each expanded node gets its
        children, and while one more forward pays (the planner's `StepPlan.grow`) the best `expand` of the newest are fed:
        yields feed(expand, nodes) and is sent their logits [len(expand), vocab]. Returns the Draft. The draft
        model's feed is a Part (forwards batched across requests); the EAGLE head's, its own forward."""
        nodes: list[Node] = []
        dists: list[torch.Tensor] = []  # the distributions children were drawn from (sampling only)
        parents_of_row = [-1]  # which node each row of `logits` belongs to
        depth = 0
        while True:
            depth += 1
            newest = self._children(logits, parents_of_row, depth, nodes, dists, ctx)
            if depth >= min(self.max_depth, max_tokens, ctx.max_depth) or not newest:
                break
            expand = sorted(newest, key=lambda i: -nodes[i].score)[: self.expand]
            best = nodes[expand[0]]
            if not ctx.plan.grow([n.score for n in nodes], best.score, best.prob, time.perf_counter() - started,
                                 self.forward_s, self.min_confidence, max_tokens, self.trust.follow(depth)):
                break
            logits = yield feed(expand, nodes)
            parents_of_row = expand
        return self._draft(nodes, dists, ctx, max_tokens)

    def _draft(self, nodes: list[Node], dists: list[torch.Tensor], ctx: DraftContext, max_tokens: int) -> Draft:
        order = sorted(range(len(nodes)), key=lambda i: (-nodes[i].score, i))[:max_tokens]
        self.nodes, self.kept = nodes, sorted(order)  # parents come before children, as in `nodes`
        if not self.kept:
            return Draft.empty(self.device)
        index = {node: i for i, node in enumerate(self.kept)}
        kept = [nodes[i] for i in self.kept]
        tokens = [n.token for n in kept]
        parents = [index[n.parent] if n.parent >= 0 else -1 for n in kept]
        probs = None
        if not ctx.params.greedy:
            rows = torch.stack([dists[n.dist] for n in kept])  # [n, vocab] or [n, subset]
            if self.head_tokens is not None:
                full = rows.new_zeros(len(kept), self.vocab_size)
                full[:, self.head_tokens[self.head_tokens < self.vocab_size]] = rows
                rows = full
            for row, node in zip(rows, kept):
                if node.drawn_before:  # drawn without replacement: its siblings drawn earlier were not available
                    row[node.drawn_before] = 0.0
                    row /= row.sum()
            probs = rows
        return Draft(tokens, parents, probs, [n.score for n in kept], device=self.device)

    def _draft_space(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, list[int] | None]:
        """Draft logits [R, size] -> (logits over the tokens it may propose, their vocabulary ids and the same as a
        list, or None, None when that is the target's whole vocabulary). A head over frequent tokens only
        (vocab_subset.py) keeps its subset, minus any id the target lacks; the rest are never drafted."""
        head_tokens = self.head_tokens
        if head_tokens is None:
            return self._fit_vocab(logits), None, None
        cached = getattr(self, "_known", None)  # (head_tokens, the ids the target has or None: all, ids, as a list)
        if cached is None or cached[0] is not head_tokens:
            known = head_tokens < self.vocab_size
            known = None if bool(known.all()) else known
            ids = head_tokens if known is None else head_tokens[known]
            cached = self._known = (head_tokens, known, ids, ids.tolist())
        _, known, ids, id_list = cached
        return (logits if known is None else logits[..., known]), ids, id_list

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        size = logits.shape[-1]
        if size == self.vocab_size:
            return logits
        if size > self.vocab_size:
            return logits[..., : self.vocab_size]
        return torch.nn.functional.pad(logits, (0, self.vocab_size - size), value=float("-inf"))
