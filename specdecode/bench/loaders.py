"""Load every model once and build one runner per method around the shared models.

Our methods are the method table's rows (`methods.METHODS`), so a method added there is benchmarked with no change
here; each gets its own `SpecDecoder` (own engine) over the one loaded target. Methods run their default shape;
`<method>-chain` and `<method>-tree` pin it for the methods whose shape is a choice, so one run compares them.
Ours choose the draft size per step from the verify cost curve unless --num-draft-tokens fixes it. The reference
methods run transformers' `generate` on the same checkpoint files (the HF folder that `weights` resolved or
converted), in the same dtype and on the same device:
  hf           plain greedy/sampled `generate`
  hf-assisted  `assistant_model` = the draft checkpoint, up to k tokens per step, our confidence cut-off
  hf-pld       `prompt_lookup_num_tokens` = k, n-grams up to `max_ngram` (prompt lookup decoding)
and llama.cpp on the same GGUF file, its blocks as stored (bench/llamacpp.py): `llamacpp`, `llamacpp-lookup`.
Their k is fixed (they have no cost model): REFERENCE_NUM_DRAFT_TOKENS, our best fixed k in earlier sweeps. transformers runs
the float checkpoint in our dtype, or in bfloat16 when our target runs a GGUF file's blocks as stored.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from specdecode.api import SpecDecoder
from specdecode.bench.llamacpp import METHODS as LLAMACPP_METHODS
from specdecode.bench.llamacpp import LlamaCppRunner, import_llama_cpp
from specdecode.bench.runners import HFRunner, Runner, SpecRunner
from specdecode.errors import SpecdecodeError
from specdecode.methods import METHODS, SHAPES, build_drafter
from specdecode.models.prompt_cache import DEFAULT_PROMPT_CACHE_MB
from specdecode.planner.budget import CostCurve
from specdecode.planner.tuning import DRAFT_MIN_CONFIDENCE
from specdecode.weights.files import load_checkpoint, resolve_source
from specdecode.weights.loading import (
    LoadPlan,
    Models,
    check_same_tokenizer,
    load_draft,
    load_model,
    load_tokenizer,
    use_kv_dtype,
)
from specdecode.weights.vocab_subset import DEFAULT_HEAD_SIZE

BASELINE = "none"
# Reference methods -> the method of ours they mirror (its default k), None for plain decoding.
HF_METHODS: dict[str, str | None] = {"hf": None, "hf-assisted": "draft", "hf-pld": "ngram"}
MIRRORS = HF_METHODS | {"llamacpp": None, "llamacpp-lookup": "ngram"}
# The draft model with a LoRA adapter (`--draft-adapter`), beside the untuned `draft` in the same run.
TUNED_DRAFT = "draft-lora"
REFERENCE_NUM_DRAFT_TOKENS = {"draft": 5, "ngram": 4}


def all_methods() -> list[str]:
    shaped = [f"{m.name}-{shape}" for m in METHODS.values() if m.shaped for shape in SHAPES]
    return list(METHODS) + shaped + [TUNED_DRAFT] + list(HF_METHODS) + list(LLAMACPP_METHODS)


def runner_is_ours(method: str) -> bool:
    return method not in MIRRORS


def with_draft(method: str) -> tuple[str, str | None]:
    """'draft@smollm2-135m-instruct' -> ('draft', that draft model): a method over another draft than --draft, so
    one run compares drafts; 'draft' -> ('draft', None)."""
    name, _, draft = method.partition("@")
    return name, draft or None


def drafter_and_shape(method: str) -> tuple[str, str | None]:
    """'draft-tree' -> ('draft', 'tree'); 'draft' -> ('draft', None: its default shape); 'draft-lora' -> draft."""
    method = with_draft(method)[0]
    if method == TUNED_DRAFT:
        return "draft", None
    name, _, shape = method.rpartition("-")
    if name in METHODS and METHODS[name].shaped and shape in SHAPES:
        return name, shape
    return method, None


def needs_draft_model(method: str) -> bool:
    """Whether a method of ours runs the draft model (or, for hf-assisted, transformers' copy of it)."""
    if method == "hf-assisted":
        return True
    name = drafter_and_shape(method)[0]
    return name in METHODS and METHODS[name].needs_draft_model


def head_of(method: str) -> str | None:
    """The kind of trained head a method of ours runs ('eagle-tree' -> 'eagle'); None for the others."""
    name = drafter_and_shape(method)[0]
    return METHODS[name].head if name in METHODS else None


def parse_methods(text: str) -> list[str]:
    """'none,draft,hf' -> a checked list without duplicates; the baseline `none` is always run (first)."""
    methods = list(dict.fromkeys(m.strip() for m in text.split(",") if m.strip()))
    unknown = [m for m in methods if with_draft(m)[0] not in all_methods()]
    if unknown:
        raise SpecdecodeError(f"unknown method '{unknown[0]}': choose from {', '.join(all_methods())}")
    for method in methods:
        name, draft = with_draft(method)
        if draft is not None and (not runner_is_ours(name) or name == TUNED_DRAFT or not needs_draft_model(name)):
            raise SpecdecodeError(f"'{method}': only our methods that run a draft model take @DRAFT")
    return [BASELINE] + [m for m in methods if m != BASELINE]


def num_draft_tokens(method: str, override: int | None) -> int | None:
    """k for a method: 0 for plain decoding, the override if given, else None (ours: chosen per step) or the
    reference engines' fixed k."""
    mirrored = MIRRORS.get(method, method)
    if mirrored is None or mirrored == BASELINE:
        return 0
    if override is not None:
        return override
    return REFERENCE_NUM_DRAFT_TOKENS[mirrored] if method in MIRRORS else None


@dataclass
class BenchModels:
    ours: Models  # the target, its tokenizer, the draft model (as SpecDecoder.load builds them)
    hf_target: torch.nn.Module | None = None  # transformers CausalLM on the same files
    hf_draft: torch.nn.Module | None = None
    target_gguf: Path | None = None  # the file llama.cpp runs
    tuned_draft: Models | None = None  # the draft with its LoRA adapter (draft-lora)
    drafts: dict[str, Models] = field(default_factory=dict)  # METHOD@DRAFT: each other draft model, loaded once
    trained: dict[str, str] = field(default_factory=dict)  # eagle / medusa -> the folder `specdecode train` wrote
    head_weights: dict[str, torch.nn.Module] = field(default_factory=dict)  # method -> its trained head, once built

    @property
    def target(self) -> torch.nn.Module:
        return self.ours.target

    @property
    def tokenizer(self) -> Any:
        return self.ours.tokenizer

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.target.config.eos_token_ids)


def load_models(target: str, draft: str, methods: list[str], plan: LoadPlan, device: str,
                draft_vocab: int = DEFAULT_HEAD_SIZE, draft_vocab_corpus: list[str] | None = None,
                trained: dict[str, str] | None = None, draft_adapter: str | None = None) -> BenchModels:
    """Our models as SpecDecoder.load builds them (loading.load_draft); transformers' always unquantized.
    `trained`: the head folder of each trained method."""
    model, tokenizer = load_model(target, plan.dtype, device, plan.quantize, plan.weights)
    use_kv_dtype(model, plan.kv_dtype)
    if tokenizer is None:
        raise SpecdecodeError(f"target '{target}' ships no tokenizer; the benchmark needs one to encode prompts")
    models = BenchModels(Models(model, tokenizer, source=target), trained=dict(trained or {}))
    ours = [m for m in methods if m != "hf-assisted"]
    if any(needs_draft_model(m) for m in ours if m != TUNED_DRAFT and with_draft(m)[1] is None):
        models.ours.draft, models.ours.draft_head_tokens, models.ours.draft_bridge = load_draft(
            draft, plan, device, tokenizer, target, None, draft_vocab, draft_vocab_corpus)
    elif "hf-assisted" in methods:
        check_same_tokenizer(tokenizer, load_tokenizer(draft), target, draft, "hf-assisted")
    if TUNED_DRAFT in methods:
        tuned, head, bridge = load_draft(draft, plan, device, tokenizer, target, draft_adapter, draft_vocab,
                                         draft_vocab_corpus)
        models.tuned_draft = Models(model, tokenizer, tuned, head, draft_bridge=bridge, source=target)
    for other in dict.fromkeys(d for m in ours if (d := with_draft(m)[1]) is not None):
        drafted, head, bridge = load_draft(other, plan, device, tokenizer, target, None, draft_vocab,
                                           draft_vocab_corpus)
        models.drafts[other] = Models(model, tokenizer, drafted, head, draft_bridge=bridge, source=target)
    # transformers runs a GGUF file de-quantized to bfloat16; a folder as stored in the activations' dtype
    hf_dtype = torch.bfloat16 if plan.weights == "stored" and resolve_source(target).is_file() else plan.dtype
    if any(m in HF_METHODS for m in methods):
        models.hf_target = load_hf(target, hf_dtype, device)
    if "hf-assisted" in methods:
        models.hf_draft = load_hf(draft, hf_dtype, device)
    if set(LLAMACPP_METHODS) & set(methods):
        import_llama_cpp()  # fail before the long runs when it is missing
        models.target_gguf = resolve_source(target)
        if not models.target_gguf.is_file():
            raise SpecdecodeError(f"llama.cpp runs GGUF files; target '{target}' is a float checkpoint")
    return models


def load_hf(source: str, dtype: torch.dtype, device: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    hf_dir = load_checkpoint(source, dtype).hf_dir  # the folder our loader read (a GGUF's converted copy)
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).to(device).eval()


def build_runners(methods: list[str], models: BenchModels, override_k: int | None = None, max_len: int = 8192,
                  max_ngram: int = 3, costs: CostCurve | None = None,
                  prompt_cache_mb: float = DEFAULT_PROMPT_CACHE_MB) -> dict[str, Runner]:
    """`prompt_cache_mb` > 0: our methods reuse recent prompts' keys and values and llama.cpp its last
    context's common prefix (each engine's default way); 0: every prompt computed in full."""
    runners: dict[str, Runner] = {}
    for method in methods:
        k = num_draft_tokens(method, override_k)
        if method in HF_METHODS:
            runners[method] = HFRunner(models.hf_target, models.eos_token_ids, hf_options(method, models, k, max_ngram))
        elif method in LLAMACPP_METHODS:
            # With prompt lookup a context of at most 4096: it keeps logits for every slot (n_ctx x vocab floats).
            n_ctx = min(max_len, 4096) if k else max_len
            runners[method] = LlamaCppRunner(models.target_gguf, models.eos_token_ids, n_ctx, k, max_ngram,
                                             reuse_prefix=prompt_cache_mb > 0)
        else:
            name, shape = drafter_and_shape(method)
            over = draft_models(method, models)
            drafter = build_drafter(name, replace(over, trained=models.trained.get(name)), shape, max_ngram)
            if (head := drafter.trained_weights) is not None:
                models.head_weights[method] = head
            decoder = SpecDecoder(models.target, models.tokenizer, drafter, method, k, max_len, costs, prompt_cache_mb)
            runners[method] = SpecRunner(decoder, models.target.device)
    return runners


def draft_models(method: str, models: BenchModels) -> Models:
    """The models a method of ours runs over: the tuned draft's, an @DRAFT's, or --draft's."""
    if method == TUNED_DRAFT:
        return models.tuned_draft
    other = with_draft(method)[1]
    return models.drafts[other] if other is not None else models.ours


def hf_options(method: str, models: BenchModels, k: int, max_ngram: int) -> dict[str, Any]:
    if method == "hf-assisted":
        # transformers reads these from the assistant's own generation config: the same k and the same
        # confidence cut-off as our draft method, so both sides speculate alike.
        config = models.hf_draft.generation_config
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = k, "constant"
        config.assistant_confidence_threshold = DRAFT_MIN_CONFIDENCE
        return {"assistant_model": models.hf_draft}
    if method == "hf-pld":
        return {"prompt_lookup_num_tokens": k, "max_matching_ngram_size": max_ngram}
    return {}


def weights_bytes(method: str, models: BenchModels) -> int:
    """Bytes of the weights a method reads (target plus draft), tied tensors counted once; buffers are included
    because quantized layers keep their weights there."""
    if method in LLAMACPP_METHODS:
        return models.target_gguf.stat().st_size
    if method in HF_METHODS:
        used = [models.hf_target] + ([models.hf_draft] if method == "hf-assisted" else [])
    else:
        draft = draft_models(method, models).draft
        used = [models.target] + ([draft] if needs_draft_model(method) else [])
        used += [models.head_weights[method]] if method in models.head_weights else []
    tensors = {t.data_ptr(): t.numel() * t.element_size() for m in used for t in model_tensors(m)}
    return sum(tensors.values())


def model_tensors(model: torch.nn.Module):
    """Parameters, buffers, and the blocks of layers that keep their weights packed (quantize.QuantLinear,
    QuantEmbedding)."""
    yield from model.parameters()
    yield from model.buffers()
    for module in model.modules():
        held = getattr(module, "tensors", None)
        if (packed := getattr(module, "packed", None)) is not None:
            held = (*(held or ()), *packed.tensors())
        yield from (t for t in held or () if isinstance(t, torch.Tensor) and t.numel())
