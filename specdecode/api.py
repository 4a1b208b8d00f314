"""The public Python API: load a target and a drafter, then generate text with speculation statistics.

    from specdecode import SpecDecoder, SamplingParams
    sd = SpecDecoder.load("qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct", method="hybrid")
    result = sd.generate("def fib(n):", SamplingParams(max_new_tokens=64))
    print(result.text, result.stats.acceptance_rate)

This layer turns text into token ids (chat template included), streams text back with each token marked as
drafted-and-accepted or not, and applies stop strings; the engine below it sees token ids only.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from specdecode.batch import BatchEngine
from specdecode.budget import CostCurve, load_or_measure
from specdecode.config import SamplingParams
from specdecode.drafters import (DRAFTERS, HEAD_KIND, TRAINED, USES_DRAFT_MODEL, DraftModelDrafter,
                                 HybridDrafter)
from specdecode.drafters.draft_model import TREE_EXPAND, TREE_WIDTH
from specdecode.engine import Engine, Step
from specdecode.errors import SpecdecodeError
from specdecode.loading import LoadPlan, load_model, load_tokenizer, plan_load
from specdecode.model import Transformer
from specdecode.stats import GenerationStats
from specdecode.text import TextStream
from specdecode.vocab_subset import DEFAULT_HEAD_SIZE, cut_draft_head

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
# The draft size is chosen per step from this machine's verify cost curve (budget.py) unless the user fixes it.
# With a fixed size the draft model stops a chain early once its own top probability falls below this.
DRAFT_MIN_CONFIDENCE = 0.5
DRAFT_SHAPES = ("chain", "tree")
# Measured side by side (BENCHMARKS.md): on a 2-core CPU the draft model's siblings rarely pay for the wider draft
# forwards and verify rows they cost, while n-gram siblings are free to draft.
DEFAULT_DRAFT_SHAPE = {"draft": "chain", "hybrid": "chain", "ngram": "tree", "eagle": "tree", "medusa": "tree",
                       "hybrid-eagle": "tree"}
NGRAM_TREE_BRANCHES = 4  # earlier matches merged into an n-gram tree


@dataclass
class TextChunk:
    pieces: list[str]  # text released with each token (empty while a character or stop string is incomplete)
    token_ids: list[int]
    from_draft: list[bool]  # per token: proposed by the drafter and accepted by the target
    finish_reason: str | None = None  # "stop" (EOS or a stop string) or "length"

    @property
    def text(self) -> str:
        return "".join(self.pieces)


@dataclass
class Generation:
    text: str
    token_ids: list[int]
    from_draft: list[bool]
    finish_reason: str | None
    stats: GenerationStats = field(default_factory=GenerationStats)


class SpecDecoder:
    def __init__(self, target: torch.nn.Module, tokenizer, drafter, method: str, num_draft_tokens: int | None,
                 max_len: int = 8192, costs: CostCurve | None = None) -> None:
        self.tokenizer = tokenizer
        self.method = method
        self.engine = Engine(target, drafter, num_draft_tokens, max_len, costs)

    @classmethod
    def load(cls, target: str = DEFAULT_TARGET, draft: str | None = None, method: str = "hybrid",
             num_draft_tokens: int | None = None, dtype: str = "auto", device: str = "cpu",
             max_len: int = 8192, max_ngram: int = 3, quantize: str = "none",
             draft_quantize: str = "auto", weights: str = "auto", draft_shape: str | None = None,
             draft_vocab: int = DEFAULT_HEAD_SIZE, draft_vocab_corpus: list[str] | None = None,
             draft_adapter: str | None = None) -> SpecDecoder:
        """`weights` = 'auto' runs a GGUF file's quantized blocks as stored on CPU (the model llama.cpp runs),
        'float' de-quantizes it to `dtype`. `quantize` writes a float target in blocks (q8_0, q4_k; the output
        stays exact for that target); `draft_quantize` only changes how good and how cheap the guesses are.
        `num_draft_tokens` None chooses the draft size per step from what a verify forward costs on this machine
        (measured once and cached); `draft_shape` 'tree' drafts several guesses per position, 'chain' one
        (None: the method's default, DEFAULT_DRAFT_SHAPE).
        `draft_vocab` cuts the draft's LM head to that many frequent tokens (0: whole vocabulary), counted on
        `draft_vocab_corpus` (jsonl files) or on the instruction data shipped for the vocabulary.
        Methods `eagle`, `hybrid-eagle` and `medusa` take `draft` = the folder `specdecode train` wrote for this
        target;
        `draft_adapter` = a LoRA adapter folder (`specdecode train draft`) applied to the draft model."""
        if method not in DRAFTERS:
            raise SpecdecodeError(f"unknown method '{method}': choose one of {', '.join(DRAFTERS)}")
        draft_shape = draft_shape or default_shape(method)
        if draft_shape not in DRAFT_SHAPES:
            raise SpecdecodeError(f"unknown draft shape '{draft_shape}': choose one of {', '.join(DRAFT_SHAPES)}")
        heads = check_trained_folder(method, draft)
        draft = (draft or DEFAULT_DRAFT) if method in USES_DRAFT_MODEL else None
        if draft_adapter is not None and method not in USES_DRAFT_MODEL:
            raise SpecdecodeError("--draft-adapter applies to --method draft or hybrid (a LoRA adapter of the draft "
                                  "model)")
        plan = plan_load(target, draft, dtype, device, quantize, draft_quantize, weights)
        model, tokenizer = load_model(target, plan.dtype, device, plan.quantize, plan.weights)
        draft_model = None
        if draft is not None:
            # The draft's own tokenizer comes with it: loading it separately first cost a second at every start.
            draft_model, draft_tokenizer = load_model(draft, plan.dtype, device, plan.draft_quantize,
                                                      plan.draft_weights)
            check_same_tokenizer(tokenizer, draft_tokenizer or load_tokenizer(draft), target, draft)
            if draft_adapter is not None:
                from specdecode.trained.lora import apply_adapter

                apply_adapter(draft_model, draft_adapter, draft)
            cut_draft_head(draft_model, tokenizer, draft, draft_vocab, draft_vocab_corpus)
        if draft_shape == "tree" and not isinstance(model, Transformer):
            draft_shape = "chain"  # trees need the native model's tree attention; transformers' verify chains
        drafter = build_drafter(method, model, draft_model, max_ngram, draft_shape, heads)
        if num_draft_tokens is not None and num_draft_tokens < 0:
            raise SpecdecodeError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
        k = 0 if method == "none" else num_draft_tokens
        costs = verify_costs(model, target, plan, device) if k is None else None
        return cls(model, tokenizer, drafter, method, k, max_len, costs)

    @property
    def stats(self) -> GenerationStats:
        """Statistics of the request in progress or the last one."""
        return self.engine.stats

    def encode(self, prompt: str | list[int] | list[dict], chat: bool = False) -> list[int]:
        """Token ids for a raw prompt, a prompt wrapped as one user message (chat=True), a list of chat
        messages ({"role", "content"} dicts; the chat template is applied), or ids passed through."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        if isinstance(prompt, str) and not chat:
            return self.tokenizer.encode(prompt)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not getattr(self.tokenizer, "chat_template", None):
            raise SpecdecodeError("this target has no chat template: send a raw prompt instead of chat messages")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def stream(self, prompt: str | list[int] | list[dict], params: SamplingParams, chat: bool = False,
               num_draft_tokens: int | None = None) -> Iterator[TextChunk]:
        ids = self.encode(prompt, chat)
        text = TextStream(self.tokenizer, params.stop)
        steps = self.engine.generate(ids, params, num_draft_tokens)
        for step in steps:
            chunk = text_chunk(text, step, self.stats)
            yield chunk
            if chunk.finish_reason is not None:
                steps.close()
                return

    def batch_engine(self, max_running: int = 16, kv_budget_tokens: int | None = None) -> BatchEngine:
        """An engine that runs many requests through one forward per step (the server's), over the same models:
        each request gets a fresh drafter like this decoder's."""
        e = self.engine
        return BatchEngine(e.target, e.drafter.fork, e.num_draft_tokens, e.max_len, e.costs, max_running,
                           kv_budget_tokens)

    def generate(self, prompt: str | list[int] | list[dict], params: SamplingParams, chat: bool = False,
                 num_draft_tokens: int | None = None) -> Generation:
        pieces, ids, flags, reason = [], [], [], None
        for chunk in self.stream(prompt, params, chat, num_draft_tokens):
            pieces.append(chunk.text)
            ids += chunk.token_ids
            flags += chunk.from_draft
            reason = chunk.finish_reason
        return Generation("".join(pieces), ids, flags, reason, self.stats)


def text_chunk(text: TextStream, step: Step, stats: GenerationStats) -> TextChunk:
    """An engine Step -> the text it releases, stop strings applied (tokens past one are not output)."""
    pieces, kept = text.push(step.tokens)
    stats.new_tokens -= len(step.tokens) - kept
    flags = [i < step.num_accepted for i in range(kept)]
    reason = "stop" if text.stopped else step.finish_reason
    if reason is not None and pieces:
        pieces[-1] += text.flush()
    return TextChunk(pieces, step.tokens[:kept], flags, reason)


def build_drafter(method: str, target: torch.nn.Module, draft_model: torch.nn.Module | None = None,
                  max_ngram: int = 3, shape: str | None = None, heads: str | None = None):
    """The drafter for `method` over already-loaded models, with the library's defaults (`heads`: the folder
    of a trained eagle or medusa drafter)."""
    tree = (shape or default_shape(method)) == "tree"
    if method in TRAINED:
        drafter = DRAFTERS[HEAD_KIND[method]].load(heads, target, **({} if tree else {"width": 1}))
        return HybridDrafter(drafter, max_ngram) if method == "hybrid-eagle" else drafter
    if method in USES_DRAFT_MODEL:
        drafter = DraftModelDrafter(draft_model, vocab_size=target.config.vocab_size,
                                    min_confidence=DRAFT_MIN_CONFIDENCE, width=TREE_WIDTH if tree else 1,
                                    expand=TREE_EXPAND if tree else 1)
        return HybridDrafter(drafter, max_ngram) if method == "hybrid" else drafter
    if method == "ngram":
        return DRAFTERS[method](max_ngram=max_ngram, branches=NGRAM_TREE_BRANCHES if tree else 1)
    return DRAFTERS[method]()


def verify_costs(model: torch.nn.Module, target: str, plan: LoadPlan, device: str) -> CostCurve:
    """The cost curve of `target` as `plan` loads it on `device`: cached, measured on first use."""
    return load_or_measure(model, f"{target} | {plan.describe()} | {device}")


def check_trained_folder(method: str, draft: str | None) -> str | None:
    """The trained drafter folder an eagle, hybrid-eagle or medusa method needs (None for other methods)."""
    if method not in TRAINED:
        return None
    if not draft or not Path(draft).is_dir():
        raise SpecdecodeError(f"--method {method} needs --draft DIR: the folder `specdecode train "
                              f"{HEAD_KIND[method]}` wrote" + (f" ('{draft}' is not a folder)" if draft else ""))
    return draft


def default_shape(method: str) -> str:
    return DEFAULT_DRAFT_SHAPE.get(method, "chain")


def check_same_tokenizer(target_tok, draft_tok, target: str, draft: str) -> None:
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise SpecdecodeError(
            f"draft '{draft}' and target '{target}' use different tokenizers: pick a draft of the same "
            "family (same vocabulary), or use --method ngram"
        )
