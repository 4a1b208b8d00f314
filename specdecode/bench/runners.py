"""One runner per method family: ours through `SpecDecoder`, the references through transformers' `generate`.

A runner turns prompt token ids into a `TurnResult`. Both families get the same ids, the same greedy or
sampling settings, the same EOS ids and the same token budget, and both are timed the same way: from the call
to the return, with a device sync before each clock read. Neither detokenizes inside the timed region except
our API's streaming text layer, which is part of what a user of `SpecDecoder.generate` pays.

Transformers' TTFT and inter-token latencies come from a streamer: `generate` hands it the prompt first, then
the tokens of every target forward, so the second `put` marks the first token and each later `put` one step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from specdecode.config import SamplingParams


@dataclass
class TurnResult:
    """One generation (one turn of a prompt) by one method."""

    token_ids: list[int]  # new tokens only, EOS included when it ended the turn
    wall_s: float
    ttft_s: float | None
    token_latencies_s: list[float]  # per token after the first: its step's time / tokens of that step
    decode_tokens: int  # tokens emitted by the forwards after the first one (prefill)
    decode_forwards: int  # target forwards after the first one
    finish_reason: str | None = None
    drafted_tokens: int | None = None  # None: the method does not report drafting (transformers)
    drafts: int | None = None  # decode steps that verified a draft (a chain or a tree)
    accepted_tokens: int | None = None
    drafted_at: list[int] = field(default_factory=list)  # [position] times a draft reached it
    accepted_at: list[int] = field(default_factory=list)  # [position] times that token was accepted
    peak_memory_bytes: int | None = None  # filled in by the harness
    by_drafter: dict[str, list[int]] = field(default_factory=dict)  # who proposed: name -> [drafted, accepted]
    draft_s: float | None = None  # time spent proposing drafts (None: not reported)


class Runner(Protocol):
    family: str  # "ours" or "hf"

    def run(self, prompt_ids: list[int], params: SamplingParams) -> TurnResult: ...


def clock(device: torch.device) -> float:
    # Kernels run asynchronously on CUDA: wait for them, or the clock reads launch time.
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


class SpecRunner:
    family = "ours"

    def __init__(self, decoder: Any, device: torch.device) -> None:
        self.decoder = decoder  # a SpecDecoder
        self.device = device  # the target's, for the clock's sync

    def snapshot(self) -> list:
        """What its drafter remembers across requests, and the prompts its engine keeps, to run a prompt's
        repeats from the same memory."""
        engine = self.decoder.engine
        memories = engine.drafter.memories() + ([engine.prompt_cache] if engine.prompt_cache is not None else [])
        return [(m, m.snapshot()) for m in memories]

    @staticmethod
    def restore(snapshot: list) -> None:
        for memory, state in snapshot:
            memory.restore(state)

    def run(self, prompt_ids: list[int], params: SamplingParams) -> TurnResult:
        start = clock(self.device)
        out = self.decoder.generate(prompt_ids, params)
        wall = clock(self.device) - start
        s = out.stats
        return TurnResult(
            token_ids=list(out.token_ids), wall_s=wall, ttft_s=s.ttft_s, token_latencies_s=list(s.token_latencies_s),
            decode_tokens=max(len(out.token_ids) - 1, 0), decode_forwards=s.target_forwards,
            finish_reason=out.finish_reason, drafted_tokens=s.drafted_tokens, drafts=s.drafts,
            accepted_tokens=s.accepted_tokens,
            drafted_at=list(s.drafted_at), accepted_at=list(s.accepted_at),
            by_drafter={name: list(counts) for name, counts in s.by_drafter.items()}, draft_s=s.draft_s,
        )  # fmt: skip


class StepTimer:
    """A transformers streamer that records when each chunk of tokens arrives and how many it holds."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.sizes: list[int] = []
        self.seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:  # generate streams the prompt first
            self.seen_prompt = True
            return
        self.times.append(time.perf_counter())  # value came through .cpu(): the step has finished
        self.sizes.append(int(value.numel()))

    def end(self) -> None:
        pass


class HFRunner:
    """transformers `generate`; `options` picks the variant (assistant_model, prompt_lookup_num_tokens)."""

    family = "hf"

    def __init__(self, model: torch.nn.Module, eos_token_ids: list[int], options: dict[str, Any] | None = None) -> None:
        self.model = model
        self.eos_token_ids = eos_token_ids
        self.options = options or {}

    def run(self, prompt_ids: list[int], params: SamplingParams) -> TurnResult:
        device = self.model.device
        ids = torch.tensor([prompt_ids], device=device)  # [1, T]
        timer = StepTimer()
        if not params.greedy and params.seed is not None:
            torch.manual_seed(params.seed)  # transformers samples from the global generator
        start = clock(device)
        with torch.inference_mode():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), streamer=timer,
                                      **self.generate_kwargs(params), **self.options)
        end = clock(device)
        new = out[0, len(prompt_ids):].tolist()
        latencies = []
        for before, now, size in zip(timer.times, timer.times[1:], timer.sizes[1:]):
            latencies += [(now - before) / size] * size
        first = timer.sizes[0] if timer.sizes else 0
        return TurnResult(
            token_ids=new, wall_s=end - start, ttft_s=timer.times[0] - start if timer.times else None,
            token_latencies_s=latencies, decode_tokens=len(new) - first, decode_forwards=max(len(timer.sizes) - 1, 0),
            finish_reason="stop" if new and new[-1] in self.eos_token_ids else "length",
        )  # fmt: skip

    def generate_kwargs(self, params: SamplingParams) -> dict[str, Any]:
        # The same stop ids and budget as our engine; min_new_tokens unset so EOS ends a turn in both.
        kwargs: dict[str, Any] = dict(max_new_tokens=params.max_new_tokens, eos_token_id=self.eos_token_ids,
                                      pad_token_id=self.eos_token_ids[0] if self.eos_token_ids else None)
        if params.greedy:
            return kwargs | dict(do_sample=False, temperature=None, top_k=None, top_p=None)
        # top_k=0 switches the filter off in transformers too (None would mean its default, 50).
        return kwargs | dict(do_sample=True, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
