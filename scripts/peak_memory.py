"""Peak memory (RSS high-water mark) of one generation with the default model pair, ours or llama.cpp's, each in a
fresh process: the figure behind BENCHMARKS.md's memory comparison.

    python scripts/peak_memory.py specdecode   # SpecDecoder.load(method="draft"), 64 new tokens
    python scripts/peak_memory.py llamacpp     # llama.cpp with the same two GGUF files loaded, same context
"""

from __future__ import annotations

import argparse
import resource

from specdecode.weights import hub
from specdecode.api import DEFAULT_DRAFT, DEFAULT_TARGET

PROMPT = "Write a Python function that checks whether a string is a palindrome."


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", choices=["specdecode", "llamacpp"])
    ap.add_argument("--max-len", type=int, default=8192, help="context allocated (both engines)")
    args = ap.parse_args()
    if args.engine == "specdecode":
        from specdecode import SamplingParams, SpecDecoder
        decoder = SpecDecoder.load(method="draft", max_len=args.max_len)
        decoder.generate(PROMPT, SamplingParams(max_new_tokens=64), chat=True)
    else:
        import llama_cpp

        target = llama_cpp.Llama(str(hub.pull(DEFAULT_TARGET)), n_ctx=args.max_len, n_threads=2, verbose=False)
        draft = llama_cpp.Llama(str(hub.pull(DEFAULT_DRAFT)), n_ctx=args.max_len, n_threads=2, verbose=False)
        for llm in (target, draft):
            ids = llm.tokenize(PROMPT.encode())
            for n, _ in enumerate(llm.generate(ids, temp=0.0, top_k=1)):
                if n == 64:
                    break
    print(f"{args.engine}: peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")


if __name__ == "__main__":
    main()
