"""llama.cpp as a reference in `specdecode bench`, through llama-cpp-python (`pip install specdecode[llamacpp]`).

  llamacpp         plain decoding of the same GGUF file, its quantized blocks as stored
  llamacpp-lookup  llama.cpp's prompt lookup decoding (n-gram drafts from the context, verified in one batch)

Same file, same threads, same prompt ids and token budget as our methods. Greedy output is compared token by
token with ours like any method's, but expect near-identical rather than identical: llama.cpp rounds its
activations and sums in its own order. Each generation starts from an empty KV cache, as ours does (llama-cpp-
python would otherwise reuse the previous prompt's shared prefix and skip part of the prefill).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from specdecode.bench.runners import TurnResult
from specdecode.config import SamplingParams
from specdecode.errors import SpecdecodeError

METHODS = ("llamacpp", "llamacpp-lookup")


def import_llama_cpp():
    try:
        import llama_cpp
    except ImportError as exc:
        raise SpecdecodeError("methods llamacpp and llamacpp-lookup need llama-cpp-python: "
                              "pip install 'specdecode[llamacpp]' (it compiles llama.cpp, a few minutes)") from exc
    return llama_cpp


class LlamaCppRunner:
    family = "llamacpp"

    def __init__(self, gguf: Path, eos_token_ids: list[int], n_ctx: int, lookup_tokens: int = 0,
                 max_ngram: int = 3, threads: int | None = None, reuse_prefix: bool = False) -> None:
        """`reuse_prefix`: keep the last generation's context, so that llama.cpp computes only what a prompt adds
        to its common prefix with it (llama-cpp-python's default); False empties it before every prompt."""
        llama_cpp = import_llama_cpp()
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        threads = threads or torch.get_num_threads()
        draft = LlamaPromptLookupDecoding(max_ngram_size=max_ngram, num_pred_tokens=lookup_tokens) if lookup_tokens else None
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                                   draft_model=draft, verbose=False)
        self.eos_token_ids = set(eos_token_ids)
        self.reuse_prefix = reuse_prefix
        self.evals = 0
        forward = self.llm.eval

        def counted(tokens):  # one call is one llama.cpp forward (the prompt, a token, or a token plus drafts)
            self.evals += 1
            return forward(tokens)

        self.llm.eval = counted

    def snapshot(self) -> list:
        """Its context, where it keeps one between generations: every repeat of a prompt starts from the same, as
        ours start from the same kept prompts (bench/runners.py)."""
        return [self.llm.save_state()] if self.reuse_prefix else []

    def restore(self, snapshot: list) -> None:
        self.llm.load_state(snapshot[0])

    def run(self, prompt_ids: list[int], params: SamplingParams) -> TurnResult:
        if not self.reuse_prefix:
            self.llm.reset()  # an empty cache: no prefix reuse from the previous generation
        if params.seed is not None:
            self.llm.set_seed(params.seed)
        self.evals = 0
        tokens: list[int] = []
        times: list[float] = []
        start = time.perf_counter()
        for token in self.llm.generate(prompt_ids, reset=True, **sampler(params)):
            tokens.append(int(token))
            times.append(time.perf_counter())
            if token in self.eos_token_ids or len(tokens) >= params.max_new_tokens:
                break
        end = time.perf_counter()
        latencies = [b - a for a, b in zip(times, times[1:])]
        return TurnResult(
            token_ids=tokens, wall_s=end - start, ttft_s=times[0] - start if times else None,
            token_latencies_s=latencies, decode_tokens=max(len(tokens) - 1, 0),
            decode_forwards=max(self.evals - 1, 0),
            finish_reason="stop" if tokens and tokens[-1] in self.eos_token_ids else "length",
        )  # fmt: skip


def sampler(params: SamplingParams) -> dict[str, Any]:
    if params.greedy:
        return dict(temp=0.0, top_k=1, top_p=1.0, min_p=0.0)
    return dict(temp=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=0.0)
