"""Per-request speculation statistics, accumulated from the engine's step records.

Definitions (the ones Spec-Bench and vLLM use, so numbers compare):
- acceptance_rate = accepted draft tokens / drafted tokens.
- mean_accepted_length = tokens emitted by decode steps / target forwards in decode, so the bonus or recovered
  token counts: plain decoding scores exactly 1.0; the prefill forward and its first token are excluded.
- acceptance_per_position[i] = P(draft token at depth i + 1 accepted | the draft reached that depth), i from 0;
  for a chain the depth is the position. A tree drafts several nodes per depth and at most one is accepted.
- nodes_per_step = drafted tokens / steps that drafted; accepted_path_length = accepted / steps that drafted.
  acceptance_rate (accepted / drafted) is lower for a tree by construction: judge a tree by its path length.
- ttft_s: from the start of prefill to the first token; itl_s: mean gap per token after the first one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdecode.planner.budget import CostCurve


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0  # of them, tokens whose keys and values came from an earlier prompt
    new_tokens: int = 0
    target_forwards: int = 0  # verify/decode forwards after prefill
    drafts: int = 0  # decode steps that had at least one draft token
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    drafted_at: list[int] = field(default_factory=list)  # [depth - 1] times a draft reached this depth
    accepted_at: list[int] = field(default_factory=list)  # [depth - 1] times a node at this depth was accepted
    tree_steps: int = 0  # steps whose draft was a tree with more than one node at some depth
    draft_s: float = 0.0  # time spent proposing drafts, over every decode step
    # Which drafter proposed (hybrid chooses one per step): drafter name -> [drafted, accepted] tokens
    by_drafter: dict[str, list[int]] = field(default_factory=dict)
    prediction_tokens: int | None = None  # Predicted Outputs: the prediction's length (None: none was given)
    accepted_prediction_tokens: int = 0  # of it, tokens the target accepted as drafted
    draft_budget: int | str = 0  # the request's draft size: a number of tokens, or "auto" (chosen per step)
    verify_costs: CostCurve | None = None  # the curve an automatic budget was chosen from
    ttft_s: float = 0.0
    wall_s: float = 0.0  # from the first prefill to the last token; model loading excluded
    step_latencies_s: list[float] = field(default_factory=list)  # per decode step
    token_latencies_s: list[float] = field(default_factory=list)  # per token after the first: step time / tokens

    def record_step(self, num_drafted: int, num_accepted: int, num_emitted: int, seconds: float,
                    depth: int | None = None, drafter: str | None = None, draft_s: float = 0.0) -> None:
        """`depth`: the draft's deepest node (a chain's length, the default); `drafter`: who proposed;
        `draft_s`: what proposing took."""
        depth = num_drafted if depth is None else depth
        self.target_forwards += 1
        self.draft_s += draft_s
        self.new_tokens += num_emitted
        self.step_latencies_s.append(seconds)
        if num_emitted:
            self.token_latencies_s.extend([seconds / num_emitted] * num_emitted)
        if num_drafted:
            self.drafts += 1
            self.drafted_tokens += num_drafted
            self.accepted_tokens += num_accepted
            self.tree_steps += depth < num_drafted
            if drafter is not None:
                counts = self.by_drafter.setdefault(drafter, [0, 0])
                counts[0] += num_drafted
                counts[1] += num_accepted
            grow = depth - len(self.drafted_at)
            if grow > 0:
                self.drafted_at.extend([0] * grow)
                self.accepted_at.extend([0] * grow)
            for i in range(depth):
                self.drafted_at[i] += 1
            for i in range(num_accepted):
                self.accepted_at[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        decoded = self.new_tokens - 1 if self.new_tokens else 0  # the first token came from prefill
        return decoded / self.target_forwards if self.target_forwards else 0.0

    @property
    def nodes_per_step(self) -> float:
        return self.drafted_tokens / self.drafts if self.drafts else 0.0

    @property
    def accepted_path_length(self) -> float:
        return self.accepted_tokens / self.drafts if self.drafts else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def itl_s(self) -> float:
        return (self.wall_s - self.ttft_s) / (self.new_tokens - 1) if self.new_tokens > 1 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def rejected_prediction_tokens(self) -> int:
        """Prediction tokens that did not make it into the output (OpenAI bills these as completion tokens)."""
        return max(0, (self.prediction_tokens or 0) - self.accepted_prediction_tokens)

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "cached_prompt_tokens": self.cached_prompt_tokens,
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "drafts": self.drafts,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_per_position": self.acceptance_per_position,
            "nodes_per_step": self.nodes_per_step,
            "accepted_path_length": self.accepted_path_length,
            "tree_steps": self.tree_steps,
            "draft_s": self.draft_s,
            "by_drafter": {name: {"drafted": d, "accepted": a} for name, (d, a) in self.by_drafter.items()},
            "draft_budget": self.draft_budget,
            "prediction_tokens": self.prediction_tokens,
            "accepted_prediction_tokens": self.accepted_prediction_tokens,
            "rejected_prediction_tokens": self.rejected_prediction_tokens,
            "verify_costs": None if self.verify_costs is None else self.verify_costs.to_dict(),
            "ttft_s": self.ttft_s,
            "itl_s": self.itl_s,
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens_per_s,
        }
