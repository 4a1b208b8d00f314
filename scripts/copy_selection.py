"""Do `hybrid`'s copiers take the steps where the draft model would have done best?

Runs `hybrid` greedily on dev prompts (warmed up on two others per set), then, for every step, asks the draft model
run alone as a plain decoder for its greedy chain of `--chain` tokens from that step's context, and counts how many
match the tokens that followed (the target's own, greedy). Printed per drafter used: steps, drafted and accepted
tokens a step, and that match. A copier whose steps show a match far above the model's own steps takes the easy
steps: compared with the model's average record, a copy there looks better than it is.

    python scripts/copy_selection.py --set gsm8k
"""

from __future__ import annotations

import argparse
import collections

from profile_step import prompts

from specdecode import SamplingParams, SpecDecoder
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--set", default="gsm8k", help="dev set: humaneval, mt or gsm8k")
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    sd = SpecDecoder.load(args.target, draft=args.draft, method="hybrid")
    alone = SpecDecoder.load(args.draft, method="none")
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    for _, text in prompts(2, skip=2):
        sd.generate(text, params, chat=True)
    totals = collections.defaultdict(lambda: [0, 0, 0, 0])  # steps, drafted, accepted, the model's match
    for name, text in prompts(2):
        if name != args.set:
            continue
        ids = sd.encode(text, chat=True)
        steps = list(sd.engine.generate(ids, params))
        tokens = sd.engine.last.tokens
        at = len(ids) + len(steps[0].tokens)  # the first step is the prefill's token
        for step in steps[1:]:
            chain = [t for s in alone.engine.generate(tokens[:at], SamplingParams(max_new_tokens=args.chain))
                     for t in s.tokens]
            match = 0
            while match < len(chain) and at + match < len(tokens) and chain[match] == tokens[at + match]:
                match += 1
            row = totals[step.drafter or "no draft"]
            row[0] += 1
            row[1] += step.num_drafted
            row[2] += step.num_accepted
            row[3] += match
            at += len(step.tokens)
    for drafter, (n, drafted, accepted, match) in sorted(totals.items()):
        print(f"{args.set} {drafter:12s} steps {n:3d}, a step: drafted {drafted / n:.2f}, accepted {accepted / n:.2f},"
              f" the model's chain would match {match / n:.2f}")


if __name__ == "__main__":
    main()
