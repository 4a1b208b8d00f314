"""Predicted Outputs without the clock: the edit set's greedy answers replayed through the prediction drafter.

Greedy verification accepts exactly the draft nodes that match the answer, so once the answers are known, every
step of `none + prediction` follows from the drafter's choices alone: this script replays them (no model runs) and
prices each step with this machine's verify cost curve, C(1 + nodes verified). It compares drafters and sizing
rules in seconds where a timed run takes minutes and moves with the machine's noise; `bench_prediction.py` times
the real thing. The request's own drafter is `none` here (no draft model).

    python scripts/replay_prediction.py                 # answers generated once (12 edits, ~10 min), then cached
    python scripts/replay_prediction.py --answers bench-results/prediction-answers.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prediction import edit_set  # noqa: E402 - the same edits as the timed benchmark


def answers(path: Path, target: str, count: int) -> list[dict]:
    """Each edit's prompt, prediction and greedy answer (token ids): read from `path`, else generated and saved."""
    if path.exists():
        return json.loads(path.read_text())
    from specdecode import SamplingParams, SpecDecoder
    decoder = SpecDecoder.load(target, method="none")
    cases = []
    for i, edit in enumerate(edit_set(count)):
        prompt, prediction = decoder.encode(edit["prompt"], chat=True), decoder.encode_prediction(edit["prediction"])
        out = decoder.generate(prompt, SamplingParams(max_new_tokens=len(prediction) + 48))
        cases.append({"where": edit["where"], "kind": edit["kind"], "prompt": prompt, "prediction": prediction,
                      "answer": out.token_ids})
        print(f"replay_prediction: answer {i + 1}/{count} ({len(out.token_ids)} tokens)", file=sys.stderr)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cases))
    return cases


def replay(case: dict, costs, sized: bool) -> tuple[float, int, int]:
    """(verify seconds, steps, nodes verified) of `none + prediction` on this answer: drafts of a fixed 8, or
    sized by the cost curve as the engine sizes them."""
    from specdecode.config import SamplingParams
    from specdecode.drafters.base import DraftContext
    from specdecode.drafters.none import NoDrafter
    from specdecode.drafters.prediction import PredictionDrafter
    from specdecode.planner.planner import FIXED, MAX_AUTO_NODES, PREDICTION_DRAFT_TOKENS, StepPlan, best_count

    drafter, answer = PredictionDrafter(NoDrafter(), case["prediction"]), case["answer"]
    plan = StepPlan(costs) if sized else FIXED
    done, seconds, steps, nodes = 0, 0.0, 0, 0
    while done < len(answer):
        ctx = DraftContext(case["prompt"] + answer[:done], SamplingParams(), None, plan=plan,
                           max_depth=len(answer) - done)
        draft = drafter.propose(ctx, MAX_AUTO_NODES if sized else PREDICTION_DRAFT_TOKENS)
        if sized and draft.scores and len(draft):
            draft = draft.best(best_count(costs, sorted(draft.scores, reverse=True)))
        path, parents, tokens = [], draft.parents.tolist(), draft.tokens.tolist()
        while True:  # the longest root path matching the answer: what greedy verification keeps
            at = path[-1] if path else -1
            nxt = [i for i, p in enumerate(parents) if p == at and done + len(path) < len(answer)
                   and tokens[i] == answer[done + len(path)]]
            if not nxt:
                break
            path.append(nxt[0])
        drafter.commit(draft.as_proposed(path), draft.as_proposed(list(range(len(draft)))))
        done, seconds, steps, nodes = done + len(path) + 1, seconds + costs.cost(1 + len(draft)), steps + 1, \
            nodes + len(draft)
    return seconds, steps, nodes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    p.add_argument("--edits", type=int, default=12)
    p.add_argument("--answers", default="bench-results/prediction-answers.json", type=Path)
    args = p.parse_args()

    from specdecode.api import cached_costs
    from specdecode.weights.loading import plan_load

    cases = answers(args.answers, args.target, args.edits)
    costs = cached_costs(args.target, plan_load(args.target, None), "cpu")
    if costs is None:
        p.error(f"no verify cost curve of {args.target} on this machine yet: run any drafting method once")
    print("| edit | kind | answer tokens | fixed 8: vs none, steps | sized by the curve: vs none, steps |")
    print("|---|---|---:|---:|---:|")
    totals = {False: [0.0, 0.0], True: [0.0, 0.0]}
    for case in cases:
        plain = len(case["answer"]) * costs.cost(1)
        cells = []
        for sized in (False, True):
            seconds, steps, _ = replay(case, costs, sized)
            totals[sized][0] += plain
            totals[sized][1] += seconds
            cells.append(f"{plain / seconds:.2f}x, {steps}")
        print(f"| {case['where']} | {case['kind']} | {len(case['answer'])} | {cells[0]} | {cells[1]} |")
    print(f"| all | | | {totals[False][0] / totals[False][1]:.2f}x | {totals[True][0] / totals[True][1]:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
