"""JSON-schema output speed: `none` and the default method against llama.cpp's grammar-constrained decoding on the
same GGUF file, interleaved, greedy. Also the grammar engine's cost per token and the tokens the grammar forced.

    python scripts/bench_json.py --repeats 2 --out bench-json.json

The prompts are field extractions written for this script (no evaluation set).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from specdecode.api import SpecDecoder
from specdecode.bench.machine import machine_info
from specdecode.config import SamplingParams
from specdecode.weights.hub import resolve_packaged
from specdecode.rules import grammar as grammar_module

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "city", "email", "skills", "employed"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                         "email": {"type": "string"}, "skills": {"type": "array", "items": {"type": "string"}},
                         "employed": {"type": "boolean"}}}
TEXTS = [
    "Maria Lopez, 34, lives in Valencia. She writes Rust and Go, and some SQL. Reach her at maria.lopez@example.org."
    " She joined a fintech startup last spring.",
    "Contact: Tomasz Nowak (tomasz.n@example.com). Age 51. Based in Gdansk. Skills: welding, CAD, project planning."
    " Currently between jobs.",
    "Our new hire Aiko Tanaka (29) moves from Osaka next month; she knows Python, PyTorch, CUDA and Kubernetes. "
    "Email: aiko@example.jp.",
    "Kwame Mensah is 42 and lives in Accra. He teaches mathematics and coaches football. kwame.m@example.net. He has"
    " a full-time position at a secondary school.",
    "Freelancer Lena Fischer, 38, Hamburg, lena.fischer@example.de, does UX research, Figma prototypes and user "
    "interviews; she has no employer.",
    "Ravi Shankar, age 27, Bangalore, ravi27@example.in. Java, Spring Boot, Kafka. Works at a logistics company.",
]


def prompt_of(text: str) -> list[dict]:
    return [{"role": "user", "content": "Extract the person's details from this text as JSON with the fields name, "
                                        f"age, city, email, skills, employed.\n\n{text}"}]


class GrammarClock:
    """Seconds spent in the grammar engine (masks, draft checks, advancing), patched around GrammarState."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for name in ("mask", "legal_nodes", "advance", "forced"):
            self._wrap(name)

    def _wrap(self, name: str) -> None:
        original = getattr(grammar_module.GrammarState, name)

        def timed(state, *args, **kwargs):
            began = time.perf_counter()
            try:
                return original(state, *args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - began
        setattr(grammar_module.GrammarState, name, timed)


def run_ours(decoder: SpecDecoder, messages: list[dict], max_tokens: int, clock: GrammarClock) -> dict:
    params = SamplingParams(max_new_tokens=max_tokens, grammar=decoder.response_format(
        {"type": "json_schema", "json_schema": {"schema": SCHEMA}}))
    before = clock.seconds
    began = time.perf_counter()
    out = decoder.generate(messages, params, chat=True)
    wall = time.perf_counter() - began
    if out.finish_reason == "stop":
        json.loads(out.text)  # valid, or the run is wrong
    forced = out.stats.by_drafter.get("grammar", [0, 0])[1]
    return {"tokens": len(out.token_ids), "wall_s": wall, "finish_reason": out.finish_reason, "grammar_s": clock.seconds - before,
            "forced_tokens": forced, "accepted": out.stats.accepted_tokens, "drafted": out.stats.drafted_tokens,
            "text": out.text}


def run_llamacpp(llm, grammar, messages: list[dict], max_tokens: int) -> dict:
    llm.reset()
    began = time.perf_counter()
    out = llm.create_chat_completion(messages, grammar=grammar, max_tokens=max_tokens, temperature=0.0)
    wall = time.perf_counter() - began
    text = out["choices"][0]["message"]["content"]
    if out["choices"][0]["finish_reason"] == "stop":
        json.loads(text)
    return {"tokens": out["usage"]["completion_tokens"], "wall_s": wall, "text": text,
            "finish_reason": out["choices"][0]["finish_reason"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--out", default="bench-json.json")
    args = ap.parse_args()
    import llama_cpp

    threads = torch.get_num_threads()
    decoders = {"none": SpecDecoder.load(args.target, method="none"),
                "hybrid": SpecDecoder.load(args.target, draft=args.draft, method="hybrid")}
    llm = llama_cpp.Llama(model_path=str(resolve_packaged(args.target)), n_ctx=2048, n_threads=threads,
                          n_threads_batch=threads, verbose=False)
    llama_grammar = llama_cpp.LlamaGrammar.from_json_schema(json.dumps(SCHEMA), verbose=False)
    clock = GrammarClock()
    for decoder in decoders.values():  # warm-up: kernels, cost curve, the grammar engine's tokenizer
        run_ours(decoder, prompt_of(TEXTS[0]), 16, clock)
    # Every run starts from the same memory of earlier answers (suffix decoding's pool): a repeat would else copy
    # the first run's answer.
    memories = {m: [(mem, mem.snapshot()) for mem in d.engine.drafter.memories()] for m, d in decoders.items()}
    run_llamacpp(llm, llama_grammar, prompt_of(TEXTS[0]), 16)
    rows: list[dict] = []
    for repeat in range(args.repeats):
        for i, text in enumerate(TEXTS):
            messages = prompt_of(text)
            for method in ("llamacpp", "none", "hybrid"):  # interleaved: the machine's noise hits all alike
                if method == "llamacpp":
                    result = run_llamacpp(llm, llama_grammar, messages, args.max_tokens)
                else:
                    for memory, state in memories[method]:
                        memory.restore(state)
                    result = run_ours(decoders[method], messages, args.max_tokens, clock)
                rows.append({"method": method, "prompt": i, "repeat": repeat, **result})
                print(method, i, repeat, f"{result['tokens'] / result['wall_s']:.2f} tok/s", flush=True)
    summary = {}
    for method in ("llamacpp", "none", "hybrid"):
        mine = [r for r in rows if r["method"] == method]
        rates = [r["tokens"] / r["wall_s"] for r in mine]
        summary[method] = {"tok_s_median": statistics.median(rates), "tok_s_min": min(rates),
                           "tok_s_max": max(rates), "tokens": sum(r["tokens"] for r in mine)}
        if method != "llamacpp":
            tokens = sum(r["tokens"] for r in mine)
            summary[method]["grammar_us_per_token"] = 1e6 * sum(r["grammar_s"] for r in mine) / tokens
            summary[method]["forced_tokens_per_answer"] = sum(r["forced_tokens"] for r in mine) / len(mine)
            drafted = sum(r["drafted"] for r in mine)
            summary[method]["acceptance_rate"] = sum(r["accepted"] for r in mine) / drafted if drafted else 0.0
    same = all(a["text"] == b["text"] for a, b in zip([r for r in rows if r["method"] == "none"],
                                                        [r for r in rows if r["method"] == "hybrid"]))
    report = {"machine": machine_info("cpu", ["scripts/bench_json.py"]), "date": time.strftime("%Y-%m-%d"), "schema": SCHEMA,
              "threads": threads, "summary": summary, "none_equals_hybrid": same, "rows": rows}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    print(json.dumps({k: report[k] for k in ("machine", "summary", "none_equals_hybrid")}, indent=1))


if __name__ == "__main__":
    main()
