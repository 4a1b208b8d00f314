"""Per-request speculation statistics, accumulated from the engine's step records.

Definitions (the ones Spec-Bench and vLLM use, so numbers compare):
- acceptance_rate = accepted draft tokens / drafted tokens.
- mean_accepted_length = tokens emitted by decode steps / target forwards in decode, so the bonus or recovered
  token counts: plain decoding scores exactly 1.0; the prefill forward and its first token are excluded.
- acceptance_per_position[i] = P(draft token i accepted | it was drafted), i from 0.
- ttft_s: from the start of prefill to the first token; itl_s: mean gap per token after the first one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    target_forwards: int = 0  # verify/decode forwards after prefill
    drafts: int = 0  # decode steps that had at least one draft token
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    drafted_at: list[int] = field(default_factory=list)  # [position] times a draft reached this position
    accepted_at: list[int] = field(default_factory=list)  # [position] times that token was accepted
    ttft_s: float = 0.0
    wall_s: float = 0.0  # from the first prefill to the last token; model loading excluded
    step_latencies_s: list[float] = field(default_factory=list)  # per decode step
    token_latencies_s: list[float] = field(default_factory=list)  # per token after the first: step time / tokens

    def record_step(self, num_drafted: int, num_accepted: int, num_emitted: int, seconds: float) -> None:
        self.target_forwards += 1
        self.new_tokens += num_emitted
        self.step_latencies_s.append(seconds)
        if num_emitted:
            self.token_latencies_s.extend([seconds / num_emitted] * num_emitted)
        if num_drafted:
            self.drafts += 1
            self.drafted_tokens += num_drafted
            self.accepted_tokens += num_accepted
            grow = num_drafted - len(self.drafted_at)
            if grow > 0:
                self.drafted_at.extend([0] * grow)
                self.accepted_at.extend([0] * grow)
            for i in range(num_drafted):
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
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_at, self.drafted_at)]

    @property
    def itl_s(self) -> float:
        return (self.wall_s - self.ttft_s) / (self.new_tokens - 1) if self.new_tokens > 1 else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "drafts": self.drafts,
            "drafted_tokens": self.drafted_tokens,
            "accepted_tokens": self.accepted_tokens,
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_per_position": self.acceptance_per_position,
            "ttft_s": self.ttft_s,
            "itl_s": self.itl_s,
            "wall_s": self.wall_s,
            "tokens_per_s": self.tokens_per_s,
        }
