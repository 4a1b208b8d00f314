"""How many prompt tokens should the draft model read? An interleaved A/B of `hybrid` with the draft model's prompt
window at several sizes, beside `none`, in one process (one load, the same cost curve, the same machine spell).

    python scripts/ab_draft_window.py --windows all,256,128 ../shared/data/humaneval_dev.jsonl --limit 4
    python scripts/kind_prompts.py --out kinds
    python scripts/ab_draft_window.py --windows all,128,64 kinds/rag.jsonl kinds/summary.jsonl

Each prompt runs once per setting, the settings' order rotated from prompt to prompt; every run starts from the
same memory of earlier answers (the suffix pool) and of earlier prompts (the target's and the draft's prompt
caches: without that, a setting that ran second on a prompt got its prefill for free), and every output is
checked token-identical to `none`. Prints tokens/s per set (new tokens over wall time, prefill included) and the
ratio to `none`.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from specdecode import SamplingParams, SpecDecoder
from specdecode.bench.data import load_prompts
from specdecode.drafters import HybridDrafter, NoDrafter


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="JSONL prompt sets, as `specdecode bench --dataset` reads them (first turns)")
    ap.add_argument("--windows", default="all,256,128", help="window sizes to compare; all: the whole prompt")
    ap.add_argument("--limit", type=int, default=100, help="prompts per file")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()

    hybrid = SpecDecoder.load(method="hybrid")
    plain = SpecDecoder(hybrid.engine.target, hybrid.tokenizer, NoDrafter(), "none", None, costs=hybrid.engine.costs)
    drafter = hybrid.engine.drafter
    assert isinstance(drafter, HybridDrafter), "the default method's drafter"
    # Every `hybrid` run starts from the same memories: the suffix pool, the draft's recent prompts and the target's
    # (restored before each run, else a setting run after another on the same prompt reads its prefill for free)
    stores = [*drafter.memories(), *([hybrid.engine.prompt_cache] if hybrid.engine.prompt_cache is not None else [])]
    memory = [(m, m.snapshot()) for m in stores]
    settings = ["none", *args.windows.split(",")]
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    for decoder in (plain, hybrid):  # warm-up
        decoder.generate([{"role": "user", "content": "Say hi."}], params, chat=True)

    totals: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0.0]))
    mismatches = 0
    for i, prompt in enumerate(load_prompts(args.files, args.limit, prompt_as_chat=True)):
        kind, chat = prompt.dataset.split("_")[0], prompt.messages(0, [])
        outputs = {}
        for setting in settings[i % len(settings):] + settings[: i % len(settings)]:
            if setting != "none":
                for m, state in memory:
                    m.restore(state)
                drafter.draft.window = None if setting == "all" else int(setting)  # forks copy it
            began = time.perf_counter()
            out = (plain if setting == "none" else hybrid).generate(chat, params, chat=True)
            wall = time.perf_counter() - began
            outputs[setting] = list(out.token_ids)
            for group in (kind, "all"):
                totals[group][setting][0] += len(out.token_ids)
                totals[group][setting][1] += wall
        same = all(o == outputs["none"] for o in outputs.values())
        mismatches += not same
        print(f"{kind} {i}: {len(outputs['none'])} tokens" + ("" if same else ", NOT IDENTICAL to `none`"), flush=True)

    print("\n| set | " + " | ".join("`none`" if s == "none" else f"window {s}" for s in settings) + " |")
    print("|---|" + "---:|" * len(settings))
    for group, by in totals.items():
        base = by["none"][0] / by["none"][1]
        print(f"| {group} | " + " | ".join(f"{by[s][0] / by[s][1]:.2f} ({by[s][0] / by[s][1] / base:.2f}x)"
                                           for s in settings) + " |")
    print(f"\noutputs identical to `none`: {'all' if not mismatches else f'{mismatches} prompts differ'}")


if __name__ == "__main__":
    main()
