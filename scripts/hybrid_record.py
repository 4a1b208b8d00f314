"""What `hybrid`'s steps really cost against what its record of the draft model says they cost.

`hybrid` drafts with a copier when the copy is worth at least the model's record in the request: the tokens its
steps made over the seconds the planner charges them (drafting_s, its draft forwards at their running time, plus
the verify cost curve at the step's rows; drafters/hybrid.py). This runs `hybrid` alone on each prompt, times
every step, and prints per prompt:

- the model's steps: tokens, the record's seconds against their wall time, and both as a rate over plain
  decoding's (one token per C(1));
- where the difference goes: the drafting's wall time against drafting_s (the draft model's prompt read and its
  catching up after copied steps are not charged to its record by design), the verify forward against C(rows),
  and the rest of the step;
- the copied steps: how many, their tokens and wall time; the prompt's prefill.

    python scripts/hybrid_record.py                        # the dev sets, 1 prompt each
    python scripts/kind_prompts.py --out kinds && python scripts/hybrid_record.py --limit 2 kinds/translation.jsonl kinds/qa.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import time

from profile_step import prompts

from specdecode import SamplingParams, SpecDecoder
from specdecode.bench.data import load_prompts
from specdecode.drafters import HybridDrafter


class StepLog:
    """One prompt's steps: each step's wall time, its drafting and verify forward's, and what hybrid charged."""

    def __init__(self, sd: SpecDecoder) -> None:
        self.steps: list[dict] = []
        self.now: dict = {}
        engine, target = sd.engine, sd.engine.target
        step, draft, forward = engine.step, engine._draft, target.forward_parts

        def timed_step():
            self.now = {}
            began = time.perf_counter()
            out = step()
            self.now["wall"] = time.perf_counter() - began
            self.steps.append(self.now)
            return out

        def timed_draft(*args):
            began = time.perf_counter()
            out = draft(*args)
            self.now["draft_wall"] = time.perf_counter() - began
            return out

        def timed_forward(parts, *args, **kwargs):
            began = time.perf_counter()
            out = forward(parts, *args, **kwargs)
            self.now["verify_wall"] = time.perf_counter() - began
            return out

        engine.step, engine._draft, target.forward_parts = timed_step, timed_draft, timed_forward
        commit, log = HybridDrafter.commit, self

        def charged_commit(drafter, accepted, verified=None):  # every request's fork commits through the class
            commit(drafter, accepted, verified)
            if drafter.used is None:  # it proposed nothing this request yet
                return
            model = drafter.used is drafter.draft and drafter.plan.costs is not None
            log.now.update(model=model, tokens=len(accepted) + 1)
            if model:
                rows = 1 + (len(verified) if verified is not None else drafter.nodes)
                log.now.update(drafting_s=drafter.draft.drafting_s, curve_s=drafter.plan.costs.cost(rows))

        HybridDrafter.commit = charged_commit


def report(name: str, new_tokens: int, wall: float, steps: list[dict], one_row_s: float) -> None:
    prefill, decoding = steps[0], steps[1:]
    model = [s for s in decoding if s.get("model")]
    copied = [s for s in decoding if "model" in s and not s["model"]]
    line = f"{name:12s} {new_tokens:3d} tokens in {wall:5.2f} s (prefill {prefill['wall']:4.2f} s)"
    if model:
        tokens = sum(s["tokens"] for s in model)
        charged = sum(s["drafting_s"] + s["curve_s"] for s in model)
        real = sum(s["wall"] for s in model)

        def ms(key):
            return statistics.mean(s.get(key, 0.0) for s in model) * 1e3

        line += (f" | model {len(model):3d} steps, {tokens:3d} tokens: record {charged:5.2f} s = "
                 f"{tokens / charged * one_row_s:4.2f}x plain, real {real:5.2f} s = {tokens / real * one_row_s:4.2f}x"
                 f" | a step, ms: drafting {ms('draft_wall'):5.1f} (charged {ms('drafting_s'):5.1f}), verify "
                 f"{ms('verify_wall'):5.1f} (C(rows) {ms('curve_s'):5.1f}), rest "
                 f"{ms('wall') - ms('draft_wall') - ms('verify_wall'):4.1f}")
    if copied:
        line += (f" | copied {len(copied)} steps, {sum(s['tokens'] for s in copied)} tokens, "
                 f"{sum(s['wall'] for s in copied):4.2f} s")
    print(line, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="*", help="JSONL prompt sets, as `specdecode bench --dataset` reads them (first "
                    "turns; default: the dev sets)")
    ap.add_argument("--limit", type=int, default=1, help="prompts per set")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    sets = prompts(args.limit) if not args.files else [
        (p.dataset, p.messages(0, [])) for p in load_prompts(args.files, args.limit, prompt_as_chat=True)]
    sd = SpecDecoder.load(method="hybrid")
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    sd.generate("Say hi.", params, chat=True)  # kernels, caches, the cost curve
    log = StepLog(sd)
    for name, text in sets:
        log.steps.clear()
        began = time.perf_counter()
        out = sd.generate(text, params, chat=True)
        report(name, len(out.token_ids), time.perf_counter() - began, log.steps, sd.engine.planner.costs.cost(1))


if __name__ == "__main__":
    main()
