"""The public Python API: load a target and a drafter, then generate text with speculation statistics.

    from specdecode import SpecDecoder, SamplingParams
    sd = SpecDecoder.load("qwen2.5-coder-1.5b-instruct", draft="qwen2.5-coder-0.5b-instruct", method="hybrid")
    result = sd.generate("def fib(n):", SamplingParams(max_new_tokens=64))
    print(result.text, result.stats.acceptance_rate)

This layer turns text into token ids (chat template included), streams text back with each token marked as
drafted-and-accepted or not, and applies stop strings; the engine below it sees token ids only.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from specdecode.config import SamplingParams, choice_seed
from specdecode.drafters import Drafter
from specdecode.drafters.suffix_pool import DEFAULT_POOL_MB, open_pool
from specdecode.engine.engine import Engine, Sequence, Step
from specdecode.engine.sequence import TokenLogprob
from specdecode.engine.stats import GenerationStats
from specdecode.errors import SpecdecodeError
from specdecode.methods import DEFAULT_METHOD, build_drafter, get_method, shape_of, trained_folder
from specdecode.models.prompt_cache import DEFAULT_PROMPT_CACHE_MB, PromptCache, check_size
from specdecode.planner.budget import CostCurve, load_cached, load_or_measure
from specdecode.rules.grammar import Constraint, GrammarCompiler
from specdecode.text.chat_prompt import ChatEncoder
from specdecode.text.stream import TextStream
from specdecode.weights.loading import LoadPlan, load_models, plan_load
from specdecode.weights.vocab_subset import DEFAULT_HEAD_SIZE

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


@dataclass
class TextChunk:
    pieces: list[str]  # text released with each token (empty while a character or stop string is incomplete)
    token_ids: list[int]
    from_draft: list[bool]  # per token: proposed by the drafter and accepted by the target
    finish_reason: str | None = None  # "stop" (EOS or a stop string) or "length"
    drafted_by: list[str | None] = field(default_factory=list)  # per token: which drafter proposed it (None: not)
    logprobs: list[TokenLogprob] | None = None  # per token, when SamplingParams.logprobs asked

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
    logprobs: list[TokenLogprob] | None = None  # per token (SamplingParams.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (SamplingParams.prompt_logprobs)


@dataclass(frozen=True)
class LoadOptions:
    """How `SpecDecoder.load` loads a target and its drafter; the CLI's and the server's flags map onto it.

    `weights` = 'auto' runs a GGUF file's quantized blocks as stored on CPU (the model llama.cpp runs), 'float'
    de-quantizes it to `dtype`. `quantize` writes a float target in blocks (q8_0, q4_k; the output stays exact for
    that target); `draft_quantize` only changes how good and how cheap the guesses are. `num_draft_tokens` None
    chooses the draft size per step from what a verify forward costs on this machine (measured once and cached);
    `draft_shape` 'tree' drafts several guesses per position, 'chain' one (None: the method's default,
    methods.METHODS). `draft_vocab` cuts the draft's LM head to that many frequent tokens (0: whole vocabulary),
    counted on `draft_vocab_corpus` (jsonl files) or on the instruction data shipped for the vocabulary. Methods
    with a trained head (`eagle`, `hybrid-eagle`, `medusa`) take `draft` = the folder `specdecode train` wrote for
    this target; `draft_adapter` = a LoRA adapter folder (`specdecode train draft`) applied to the draft model.
    `suffix_pool_mb`, `suffix_pool`: the memory of earlier answers suffix decoding copies from, and a file that
    keeps it across runs. `prompt_cache_mb`: memory for recent prompts' keys and values, so that a request sharing
    a prefix with one (a system prompt, the earlier turns of a chat) computes only the rest (0: off). `kv_dtype`:
    the KV caches' dtype, 'bfloat16' under float32 activations halving what attention reads over long contexts
    (auto: bfloat16 for GGUF files as stored on CPU, else the activations' dtype; 'float32' keeps them exact)."""

    method: str = DEFAULT_METHOD
    draft: str | None = None
    num_draft_tokens: int | None = None
    dtype: str = "auto"
    device: str = "cpu"
    max_len: int = 8192
    max_ngram: int = 3
    quantize: str = "none"
    draft_quantize: str = "auto"
    weights: str = "auto"
    draft_shape: str | None = None
    draft_vocab: int = DEFAULT_HEAD_SIZE
    draft_vocab_corpus: list[str] | None = None
    draft_adapter: str | None = None
    suffix_pool_mb: float = DEFAULT_POOL_MB
    suffix_pool: str | None = None
    prompt_cache_mb: float = DEFAULT_PROMPT_CACHE_MB
    kv_dtype: str = "auto"


class SpecDecoder:
    def __init__(self, target: torch.nn.Module, tokenizer, drafter: Drafter, method: str,
                 num_draft_tokens: int | None, max_len: int = 8192, costs: CostCurve | None = None,
                 prompt_cache_mb: float = DEFAULT_PROMPT_CACHE_MB) -> None:
        self.tokenizer = tokenizer
        self.method = method
        self.engine = Engine(target, drafter, num_draft_tokens, max_len, costs,
                             prompt_cache=PromptCache(prompt_cache_mb) if prompt_cache_mb else None)
        self._home = threading.get_ident()  # the thread that built it: where its models were loaded
        self._grammars: GrammarCompiler | None = None
        self.chat = ChatEncoder(tokenizer)

    @classmethod
    def load(cls, target: str = DEFAULT_TARGET, *, options: LoadOptions | None = None,
             **overrides: Any) -> SpecDecoder:
        """Load `target` and its drafter as `options` say (LoadOptions' defaults where None), any field of them
        also given by name: `SpecDecoder.load("qwen2.5-coder-1.5b-instruct", method="ngram")`."""
        try:
            options = replace(options or LoadOptions(), **overrides)
        except TypeError as e:  # a name that is not a field: say which ones there are
            fields = ", ".join(f.name for f in dataclasses.fields(LoadOptions))
            raise SpecdecodeError(f"SpecDecoder.load: {e}; the options are {fields}") from None
        o = options
        method, draft, num_draft_tokens, device = o.method, o.draft, o.num_draft_tokens, o.device
        how = get_method(method)
        check_size(o.prompt_cache_mb)  # a bad size fails here, before any model loads
        shape = shape_of(method, o.draft_shape)
        trained = trained_folder(method, draft)
        draft = (draft or DEFAULT_DRAFT) if how.needs_draft_model else None
        if o.draft_adapter is not None and not how.needs_draft_model:
            raise SpecdecodeError("--draft-adapter applies to --method draft or hybrid (a LoRA adapter of the draft "
                                  "model)")
        if num_draft_tokens is not None and num_draft_tokens < 0:
            raise SpecdecodeError(f"num_draft_tokens must be >= 0, got {num_draft_tokens}")
        if how.precheck is not None:  # before anything loads: a refusal costs no minutes of loading
            how.precheck(target)
        plan = plan_load(target, draft, o.dtype, device, o.quantize, o.draft_quantize, o.weights, o.kv_dtype)
        models = load_models(target, draft, plan, device, o.draft_adapter, o.draft_vocab, o.draft_vocab_corpus, trained)
        if how.remembers:
            models.suffix_pool = open_pool(o.suffix_pool_mb, o.suffix_pool, models.tokenizer)
        drafter = build_drafter(method, models, shape, o.max_ngram)
        k = num_draft_tokens if how.drafts else 0
        if k is None:
            costs = verify_costs(models.target, target, plan, device)
        else:  # a method that never drafts sizes a prediction's copies by the curve if any method measured it here
            costs = cached_costs(target, plan, device) if k == 0 else None
        return cls(models.target, models.tokenizer, drafter, method, k, o.max_len, costs, o.prompt_cache_mb)

    @property
    def stats(self) -> GenerationStats:
        """Statistics of the request in progress or the last one."""
        return self.engine.last.stats if self.engine.last is not None else GenerationStats()

    def encode(self, prompt: str | list[int] | list[dict], chat: bool = False,
               tools: list[dict] | None = None) -> list[int]:
        """Token ids for a raw prompt, a prompt wrapped as one user message (chat=True), a list of chat
        messages ({"role", "content"} dicts; the chat template is applied, with `tools` if given), or ids passed
        through. A raw prompt is the caller's own template: special token text in it becomes special tokens. In
        chat messages it stays text (text/chat_prompt.py): only the template's markup opens and closes turns."""
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        self._need_tokenizer("a text prompt")
        if isinstance(prompt, str) and not chat:
            return self.tokenizer.encode(prompt)
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        return self.chat.encode(messages, tools)

    @property
    def grammars(self) -> GrammarCompiler:
        """Compiles structured-output constraints for this target's tokenizer (SamplingParams.grammar)."""
        if self._grammars is None:
            target = self.engine.target
            self._grammars = GrammarCompiler(self.tokenizer, target.config.vocab_size, self.engine.eos)
        return self._grammars

    def response_format(self, fmt: dict | None) -> Constraint | None:
        """OpenAI's response_format -> the constraint SamplingParams.grammar takes: {"type": "json_object"} or
        {"type": "json_schema", "json_schema": {"schema": {...}}}; {"type": "text"} or None: none."""
        kind = (fmt or {}).get("type", "text")
        if kind == "text":
            return None
        if kind == "json_object":
            return self.grammars.json_object()
        if kind == "json_schema":
            return self.grammars.json_schema(fmt.get("json_schema", {}).get("schema", {}))
        raise SpecdecodeError(f"response_format type '{kind}' is not supported (text, json_object, json_schema)")

    def encode_prediction(self, prediction: str | list[int] | None) -> list[int] | None:
        """Predicted Outputs: the text the answer is expected to be (a file being edited) -> its token ids."""
        if prediction is None or isinstance(prediction, list):
            return prediction
        self._need_tokenizer("a text prediction")
        return self.tokenizer.encode(prediction, add_special_tokens=False)

    def _need_tokenizer(self, what: str) -> None:
        if self.tokenizer is None:
            raise SpecdecodeError(f"{what} needs a tokenizer, and this target ships none (no tokenizer files in its "
                                  "folder): pass token ids (the Python API takes a list of ints), or add the "
                                  "tokenizer's files to the folder")

    def stream(self, prompt: str | list[int] | list[dict], params: SamplingParams, chat: bool = False,
               num_draft_tokens: int | None = None, prediction: str | list[int] | None = None) -> Iterator[TextChunk]:
        """`prediction`: the text you expect the answer to be, mostly (Predicted Outputs: a file you are editing);
        where the answer follows it, it is copied as the draft. The answer is the same with or without it."""
        if threading.get_ident() != self._home:
            warnings.warn("specdecode: generating on another thread than the one that loaded the models makes every "
                          "forward slower (OpenMP keeps a thread team per calling thread; compute.py): load and "
                          "generate on one thread, e.g. a specdecode.server.compute.ComputeThread", RuntimeWarning,
                          stacklevel=2)
            self._home = threading.get_ident()  # said once per move
        ids = self.encode(prompt, chat)
        text = TextStream(self.tokenizer, params.stop)
        steps = self.engine.generate(ids, params, num_draft_tokens, self.encode_prediction(prediction))
        for step in steps:
            chunk = release_text(self.engine, self.engine.last, text, step)
            yield chunk
            if chunk.finish_reason is not None:
                steps.close()
                return

    def generate(self, prompt: str | list[int] | list[dict], params: SamplingParams, chat: bool = False,
                 num_draft_tokens: int | None = None, prediction: str | list[int] | None = None) -> Generation:
        out = Generation("", [], [], None, logprobs=[] if params.logprobs is not None else None)
        for chunk in self.stream(prompt, params, chat, num_draft_tokens, prediction):
            _extend(out, chunk)
        out.stats = self.stats
        out.prompt_logprobs = self.engine.last.prompt_logprobs
        return out

    def generate_n(self, prompt: str | list[int] | list[dict], params: SamplingParams, n: int,
                   chat: bool = False, num_draft_tokens: int | None = None) -> list[Generation]:
        """`n` independent answers to one prompt, prefilled once. With a seed, answer i draws from seed + i (so
        answer 0 is the one `generate` gives with that seed)."""
        if n < 1:
            raise SpecdecodeError(f"n must be >= 1, got {n}")
        ids = self.encode(prompt, chat)
        engine = self.engine
        if engine.running:
            raise SpecdecodeError("generate_n runs alone; this engine is serving others (use add/step)")
        engine.check(ids, params, num_draft_tokens, n=n)
        choices = [replace(params, seed=choice_seed(params.seed, i)) for i in range(n)]
        seqs = [engine.add(ids, choices[0], num_draft_tokens)]
        seqs += [engine.add(ids, p, num_draft_tokens, leader=seqs[0]) for p in choices[1:]]
        outs = [Generation("", [], [], None, logprobs=[] if params.logprobs is not None else None) for _ in seqs]
        texts = {id(seq): TextStream(self.tokenizer, params.stop) for seq in seqs}
        where = {id(seq): i for i, seq in enumerate(seqs)}
        try:
            while engine.running:
                for seq, step in engine.step():
                    if isinstance(step, Exception):
                        raise step
                    _extend(outs[where[id(seq)]], release_text(engine, seq, texts[id(seq)], step))
        finally:
            for seq in seqs:
                engine.remove(seq)
        for seq, out in zip(seqs, outs):
            out.stats, out.prompt_logprobs = seq.stats, seq.prompt_logprobs
        return outs


def release_text(engine: Engine, seq: Sequence, text: TextStream, step: Step) -> TextChunk:
    """An engine Step -> the text it releases; a stop string found there ends the request at it. The one text and
    stop step of the CLI, the API and the server."""
    chunk = text_chunk(text, step)
    if text.stopped:
        engine.stop(seq, len(step.tokens) - len(chunk.token_ids))
    return chunk


def text_chunk(text: TextStream, step: Step) -> TextChunk:
    """An engine Step -> the text it releases, stop strings applied (tokens past one are not output)."""
    pieces, kept = text.push(step.tokens)
    flags = [i < step.num_accepted for i in range(kept)]
    reason = "stop" if text.stopped else step.finish_reason
    if reason is not None and pieces:
        pieces[-1] += text.flush()
    logprobs = None if step.logprobs is None else step.logprobs[:kept]
    return TextChunk(pieces, step.tokens[:kept], flags, reason, [step.drafter if f else None for f in flags],
                     logprobs)


def _extend(out: Generation, chunk: TextChunk) -> None:
    out.text += chunk.text
    out.token_ids += chunk.token_ids
    out.from_draft += chunk.from_draft
    out.finish_reason = chunk.finish_reason
    if out.logprobs is not None and chunk.logprobs is not None:
        out.logprobs += chunk.logprobs


def verify_costs(model: torch.nn.Module, target: str, plan: LoadPlan, device: str) -> CostCurve:
    """The cost curve of `target` as `plan` loads it on `device`: cached, measured on first use."""
    return load_or_measure(model, curve_key(target, plan, device))


def cached_costs(target: str, plan: LoadPlan, device: str) -> CostCurve | None:
    """The cost curve of `target` as `plan` loads it on `device` if one was measured already, else None."""
    return load_cached(curve_key(target, plan, device))


def curve_key(target: str, plan: LoadPlan, device: str) -> str:
    """What a verify forward's cost depends on: the target as loaded and the device (not the draft)."""
    return f"{target} | {plan.describe_target()} | {device}"
