"""A step's time outside the forwards, with as little measuring in the way as possible.

`profile_step.py` splits a step into categories with a timer around each part, and those timers cost time of
their own. This script wraps only the two models' `forward_parts`: what is left of the wall time (prompt forwards
excluded) is what the engine, the drafters and the text layer spend outside the forwards, per step and per step
or draft forward (a draft forward brings its own tree growth and bookkeeping). That total is then split into what
the engine's decode steps spend (planning, tree growth, verification, KV bookkeeping, stats) and what is spent
between them: the text layer, and each request's setup and teardown (prompt cache copies, drafter memories).

    python scripts/outside_forwards.py --method draft
    PYTHONPATH=/path/to/other/checkout python scripts/outside_forwards.py   # the same for another commit

Two other prompts per dev set run first to warm up (warmed up on the measured ones, the suffix drafter would copy
their answers whole), then the first two per set `--passes` times, measured. Passes after the first see their
own answers in the suffix pool: `--passes 1` for what a new prompt gets.
"""

from __future__ import annotations

import argparse
import time

from profile_step import prompts

from specdecode import SamplingParams, SpecDecoder
PROMPT_ROWS = 20  # a target forward over more rows than this is a prompt's, not a step's


class ForwardClock:
    """Seconds and calls of a model's `forward_parts`, prompt forwards apart."""

    def __init__(self, model, is_target: bool) -> None:
        self.seconds = self.prompt_seconds = 0.0
        self.calls = 0
        plain = model.forward_parts

        def timed(parts, *args, **kwargs):
            began = time.perf_counter()
            out = plain(parts, *args, **kwargs)
            took = time.perf_counter() - began
            if is_target and any((getattr(p, "count", None) or p.tokens.numel()) > PROMPT_ROWS for p in parts):
                self.prompt_seconds += took
            else:
                self.seconds += took
                self.calls += 1
            return out

        model.forward_parts = timed

    def reset(self) -> None:
        self.seconds = self.prompt_seconds = 0.0
        self.calls = 0


class StepClock:
    """Wall time of the engine's decode steps (a step with a prompt forward in it is left out), forwards apart."""

    def __init__(self, engine, clocks: list[ForwardClock]) -> None:
        self.seconds = 0.0
        self.steps = 0
        plain = engine.step

        def timed():
            forwards, prompts = (sum(getattr(c, f) for c in clocks) for f in ("seconds", "prompt_seconds"))
            began = time.perf_counter()
            out = plain()
            took = time.perf_counter() - began
            if sum(c.prompt_seconds for c in clocks) == prompts:
                self.seconds += took - (sum(c.seconds for c in clocks) - forwards)
                self.steps += 1
            return out

        engine.step = timed

    def reset(self) -> None:
        self.seconds = 0.0
        self.steps = 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--method", default="draft")
    ap.add_argument("--passes", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    sd = SpecDecoder.load(args.target, draft=args.draft, method=args.method)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    texts = [text for _, text in prompts(2)]
    target = ForwardClock(sd.engine.target, is_target=True)
    model = getattr(sd.engine.drafter, "forward_model", None)
    draft = ForwardClock(model, is_target=False) if model is not None else None
    stepping = StepClock(sd.engine, [c for c in (target, draft) if c is not None])
    for _, text in prompts(2, skip=2):
        sd.generate(text, params, chat=True)
    for _ in range(args.passes):
        target.reset()
        stepping.reset()
        if draft is not None:
            draft.reset()
        wall, tokens = 0.0, 0
        for text in texts:
            began = time.perf_counter()
            tokens += len(sd.generate(text, params, chat=True).token_ids)
            wall += time.perf_counter() - began
        steps, draft_calls = target.calls, draft.calls if draft is not None else 0
        drafting = draft.seconds if draft is not None else 0.0
        outside = wall - target.seconds - target.prompt_seconds - drafting
        print(f"{args.method}: {tokens} tokens in {steps} steps, {wall:.2f} s; target "
              f"{1e3 * target.seconds / steps:.1f} ms/step, draft {1e3 * drafting / steps:.1f} ms/step "
              f"({draft_calls / steps:.2f} forwards); outside the forwards {1e3 * outside / steps:.2f} ms/step, "
              f"{1e3 * outside / (steps + draft_calls):.2f} ms per step or draft forward; of which in the decode "
              f"steps {1e3 * stepping.seconds / stepping.steps:.2f} ms/step, between them "
              f"{1e3 * (outside - stepping.seconds) / steps:.2f} ms/step")


if __name__ == "__main__":
    main()
