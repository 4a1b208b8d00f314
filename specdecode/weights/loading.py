"""Build a ready-to-run model from any source: the native Transformer when the family is known, else transformers.

`weights.load_checkpoint` finds the tensors (packaged name, GGUF file, HF folder, hub id); this module picks the
implementation, the dtype and the device. `load_models` is the one builder of what a method runs over (the
target, its tokenizer, a draft model ready to draft), for the API and the benchmark alike.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Any

import torch

from specdecode.config import NATIVE_GGUF_ARCHITECTURES, ModelConfig, runs_natively
from specdecode.devices import check_device
from specdecode.errors import SpecdecodeError
from specdecode.kernels import cpu_flags, cpu_kernels
from specdecode.models.hf_model import HFModel
from specdecode.models.kv_cache import KV_DTYPES
from specdecode.models.model import Transformer
from specdecode.text.token_bridge import TokenBridge
from specdecode.weights.files import gguf_architecture, load_checkpoint, load_tokenizer, resolve_source  # noqa: F401  (re-exported)
from specdecode.weights.quantize import KernelLinear, apply_packed_, quantize_, resolve_mode, widen_embedding_
from specdecode.weights.vocab_subset import DEFAULT_HEAD_SIZE, cut_draft_head

log = logging.getLogger(__name__)
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
HALF_DTYPES = (torch.bfloat16, torch.float16)
WEIGHT_FORMS = ("auto", "stored", "float")
# A GGUF draft's layers stored in more bits per weight than this are written again in it, once (cached): a guess of
# the Qwen2.5-Coder-0.5B Q4_K_M draft (Q5_0, Q6_K, Q8_0 layers) reads 219 MB instead of 279, its forward 9.0 ms
# instead of 10.9, and `hybrid` went from 1.62-1.66x to 1.74-1.75x `none` on the dev sets, acceptance 56% against
# 58-60% (BENCHMARKS.md, "The draft model in 4-bit blocks")
STORED_DRAFT_BLOCKS = "q4_0"
# GGUF architectures whose float form (--weights float) comes from our own reader: transformers' converter does not
# map gpt-oss's expert tensors (it reported the file incomplete) and refuses Qwen3-Next's architecture
OWN_FLOAT_READER = ("gpt-oss", "qwen3next")


def resolve_weights(form: str, source: str, device: str = "cpu", quantize: str = "none") -> str:
    """'stored': the checkpoint's weights as they are, on specdecode's CPU kernels: a GGUF file's blocks on the
    integer kernels, its or an HF folder's 16-bit matrices on the float kernels, activations float32; 'float': the
    weights in --dtype. 'auto' = stored wherever the kernels run the model natively (unless --quantize asks for
    other blocks)."""
    if form not in WEIGHT_FORMS:
        raise SpecdecodeError(f"unknown weights form '{form}': choose one of {', '.join(WEIGHT_FORMS)}")
    path = resolve_source(source)
    if form == "stored":
        if resolve_mode(quantize) != "none":
            raise SpecdecodeError("--weights stored runs the checkpoint's own weights; --quantize needs --weights "
                                  "float")
        if device != "cpu" or cpu_kernels() is None:
            raise SpecdecodeError("--weights stored runs on specdecode's CPU kernel (x86-64 with AVX2 and a C++ "
                                  "compiler); use --weights float here")
        if not path.is_file() and not native_folder(path):
            raise SpecdecodeError(f"--weights stored runs the native model, which does not implement {source}'s "
                                  "architecture; use --weights float")
        return form
    if form == "auto":
        runs = device == "cpu" and resolve_mode(quantize) == "none" and cpu_kernels() is not None
        native = native_gguf(path) if path.is_file() else native_folder(path, sixteen_bits=True)
        return "stored" if runs and native else "float"
    return form


def resolve_draft_weights(source: str, device: str) -> str:
    """A draft's form: a GGUF file's blocks as stored where the kernels run it (its wider layers narrowed); a float
    checkpoint's weights written in blocks (resolve_draft_quantize): a draft's precision changes only its guesses,
    and fewer bytes make each guess cheaper."""
    return resolve_weights("auto", source, device) if resolve_source(source).is_file() else "float"


def native_gguf(gguf) -> bool:
    """Whether the native model runs this GGUF file's architecture (others go through transformers, in float)."""
    architecture = gguf_architecture(gguf)
    return architecture is None or architecture in NATIVE_GGUF_ARCHITECTURES


def native_folder(folder, sixteen_bits: bool = False) -> bool:
    """Whether the native model runs an HF folder's architecture (read from its config.json alone); with
    `sixteen_bits`, only where its config says its weights are bfloat16 or float16 (a float32 checkpoint keeps
    following --dtype under 'auto': as stored it would read twice the bytes)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return False
    saved = config.get("dtype") or config.get("torch_dtype")
    return runs_natively(config) and (not sixteen_bits or saved in ("bfloat16", "float16"))


def resolve_dtype(name: str, device: str = "cpu", weights: str = "float") -> torch.dtype:
    """'auto' is bfloat16 where bf16 weights are fast: CUDA, and CPUs where specdecode's kernel runs (it reads
    bf16 weights, half the bytes of float32, and accumulates in float32) or that have AVX-512 BF16 / AMX.
    With weights as stored the dtype is that of activations and KV cache: 'auto' = float32, as llama.cpp."""
    if name == "auto" and weights == "stored":
        return torch.float32
    if name == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        fast_bf16 = bool({"avx512_bf16", "amx_bf16"} & set(cpu_flags()))
        return torch.bfloat16 if fast_bf16 or cpu_kernels() is not None else torch.float32
    if name not in DTYPES:
        raise SpecdecodeError(f"unknown dtype '{name}': choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_draft_quantize(mode: str, device: str, weights: str = "float") -> str:
    """The draft's blocks. Its precision changes only its guesses, never the output. 'auto' on a CPU where the
    kernel runs: a float draft in q8_0 (each guess cheaper than in float); a GGUF draft run as stored gets its
    wider layers in q4_0 (STORED_DRAFT_BLOCKS); elsewhere none."""
    if mode != "auto":
        return resolve_mode(mode)
    if device != "cpu" or cpu_kernels() is None:
        return "none"
    return STORED_DRAFT_BLOCKS if weights == "stored" else "q8_0"


@dataclass(frozen=True)
class LoadPlan:
    """How the target and the draft will run, decided once from the user's options (API, CLI and bench alike)."""

    dtype: torch.dtype  # activations and KV cache (and float weights)
    weights: str  # the target's: 'stored' (GGUF blocks as they are) or 'float'
    quantize: str  # the target's blocks written from float weights: none, q8_0 or q4_k
    draft_weights: str
    draft_quantize: str
    kv_dtype: torch.dtype | None = None  # the KV caches' where not the activations' dtype (resolve_kv_dtype)

    def describe(self) -> str:
        draft = self.draft_quantize
        if self.draft_weights == "stored":
            draft = "as stored" + ("" if draft == "none" else f", wider layers in {draft}")
        return f"target weights {self.target_form()}, draft weights {draft}, {self.activations()}"

    def describe_target(self) -> str:
        """The target as loaded, the draft left out (what a target forward's cost depends on)."""
        return f"target weights {self.target_form()}, {self.activations()}"

    def target_form(self) -> str:
        return "as stored" if self.weights == "stored" else self.quantize if self.quantize != "none" else "float"

    def activations(self) -> str:
        """The activations' dtype, and the KV cache's where it differs."""
        kv = "" if self.kv_dtype in (None, self.dtype) else f", {str(self.kv_dtype).removeprefix('torch.')} KV cache"
        return f"{str(self.dtype).removeprefix('torch.')} activations{kv}"


def plan_load(target: str, draft: str | None, dtype: str = "auto", device: str = "cpu", quantize: str = "none",
              draft_quantize: str = "auto", weights: str = "auto", kv_dtype: str = "auto") -> LoadPlan:
    """The target's form decides the dtype: weights as stored run with float32 activations (as llama.cpp does),
    float weights in --dtype. A GGUF draft runs as stored whenever the kernel runs (its precision changes only
    the guesses, never the output). A device torch cannot use here is refused first, before any download."""
    check_device(device)
    target_form = resolve_weights(weights, target, device, quantize)
    draft_form = resolve_draft_weights(draft, device) if draft else "float"
    activations = resolve_dtype(dtype, device, target_form)
    return LoadPlan(activations, target_form, resolve_mode(quantize), draft_form,
                    resolve_draft_quantize(draft_quantize, device, draft_form),
                    resolve_kv_dtype(kv_dtype, device, activations, target_form))


def resolve_kv_dtype(name: str, device: str, activations: torch.dtype, weights: str = "stored") -> torch.dtype | None:
    """The KV caches' dtype (None: the activations'). 'bfloat16' under float32 activations rounds keys and values
    as they are stored: half the bytes attention reads, and on CPUs with AMX its products in tiles (a verify
    forward's extra rows and a prompt's chunks at ~2x the speed over 1,000-4,000 cached tokens); speculative output
    stays identical to plain decoding with the same cache dtype. 'auto' is bfloat16 where the native CPU kernels
    run under float32 activations (weights as stored), else the activations' dtype."""
    if name == "auto":
        stored = weights == "stored" and device == "cpu" and activations == torch.float32
        return torch.bfloat16 if stored and cpu_kernels() is not None else None
    if name not in KV_DTYPES:
        raise SpecdecodeError(f"unknown KV cache dtype '{name}': choose auto, {', '.join(KV_DTYPES)}")
    chosen = KV_DTYPES[name]
    if chosen == activations:
        return None
    if device != "cpu" or cpu_kernels() is None:
        raise SpecdecodeError(f"--kv-dtype {name} under {str(activations).removeprefix('torch.')} activations "
                              "needs the CPU kernels (device cpu); leave it at auto")
    return chosen


def load_model(source: str, dtype: torch.dtype, device: str = "cpu", quantize: str = "none",
               weights: str = "float", tokenizer_like: Any = None) -> tuple[torch.nn.Module, object]:
    """-> (model with the engine's forward contract, tokenizer). `weights` = 'stored' runs a GGUF file's blocks
    as they are (resolve_weights), its linear layers stored in more bits per weight than `quantize`'s blocks
    written again in them (a draft's, blocks.narrowed); else `quantize` = none, q8_0, q4_0 or q4_k blocks written
    from the float weights.
    `tokenizer_like`: a tokenizer already loaded, returned as this model's where its files are the same."""
    if weights == "stored" and resolve_source(source).is_file():
        return _stored(resolve_source(source), dtype, tokenizer_like, quantize)
    if weights == "stored":  # an HF folder's 16-bit matrices as they are, under float32 activations
        ckpt = load_checkpoint(source, dtype, keep_16bit=True)
        model = widen_embedding_(_native(ckpt.config, ckpt.state_dict, device))
        ckpt.state_dict.clear()  # the model holds the only references: each matrix freed once repacked into tiles
        return say_float16(quantize_(model, "none"), source), ckpt.tokenizer
    if resolve_source(source).is_file() and gguf_architecture(resolve_source(source)) in OWN_FLOAT_READER:
        return _float_from_stored(resolve_source(source), dtype, device, quantize)
    ckpt = load_checkpoint(source, dtype)
    if runs_natively(ckpt.config):
        # Every linear layer on the CPU kernel (where it runs), so verify forwards are cheap and exact.
        return quantize_(_native(ckpt.config, ckpt.state_dict, device), quantize), ckpt.tokenizer
    log.warning("specdecode: %s (%s) has no native implementation here: it runs through transformers, in float "
                "(%s), draft chains only", ckpt.name, ckpt.config.get("model_type", "unknown architecture"),
                "de-quantized from the file" if ckpt.path.is_file() else "its weights as saved")
    model = _transformers(ckpt.config, ckpt.state_dict, dtype, device)
    return (quantize_(model, quantize) if quantize != "none" else model), ckpt.tokenizer


def _native(hf_config: dict, state_dict: dict[str, torch.Tensor], device: str, gguf_norms: bool = False
            ) -> Transformer:
    """`gguf_norms`: norm weights as a GGUF holds them (1 + w already added where the family adds it)."""
    config = ModelConfig.from_hf(hf_config)
    if gguf_norms:
        config = dataclasses.replace(config, norm_unit_offset=False)
    with torch.device("meta"):  # no random init of weights that are replaced at once
        model = Transformer(config)
    model.load_state_dict(state_dict, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise SpecdecodeError(f"checkpoint lacks {len(missing)} weights (first: {missing[0]}): the file is incomplete")
    return model.to(device).eval()


def drop_mtp_layers(ckpt) -> None:
    """A stored checkpoint's multi-token-prediction tensors (`mtp.*`, a GGUF's `nextn` block) taken out, in place."""
    for table in (ckpt.floats, ckpt.packed):
        for name in [n for n in table if n.startswith("mtp.")]:
            del table[name]


def _float_from_stored(gguf, dtype: torch.dtype, device: str, quantize: str) -> tuple[Transformer, object]:
    """A GGUF in float that transformers' converter cannot read: our own reader's tensors (gguf_stored.py), the
    blocks de-quantized, on the native model."""
    from specdecode.weights.gguf_stored import load_stored

    ckpt = load_stored(gguf)
    drop_mtp_layers(ckpt)
    state = {name: t.to(dtype) for name, t in ckpt.floats.items()}
    state.update((name, packed.dequantize().to(dtype)) for name, packed in ckpt.packed.items())
    ckpt.floats.clear()
    ckpt.packed.clear()
    return quantize_(_native(ckpt.config, state, device, gguf_norms=True), quantize), ckpt.tokenizer


def _stored(gguf, dtype: torch.dtype, tokenizer_like: Any = None, narrow: str = "none") -> tuple[Transformer, object]:
    from specdecode.weights.gguf_stored import load_stored

    ckpt = load_stored(gguf, tokenizer_like=tokenizer_like, narrow=narrow)
    drop_mtp_layers(ckpt)  # read by the MTP drafter alone, when asked for (drafters/mtp.py)
    if not runs_natively(ckpt.config):
        raise SpecdecodeError(f"{gguf.name}: weights as stored run on the native llama-family model only; "
                              "use --weights float for this architecture")
    # A GGUF's Gemma norms hold 1 + w already (llama.cpp's converter adds the 1; the folder keeps the file's
    # values): run as plain multipliers, as llama.cpp runs them
    config = dataclasses.replace(ModelConfig.from_hf(ckpt.config), norm_unit_offset=False)
    with torch.device("meta"):
        model = Transformer(config)
    model.load_state_dict({name: as_run(t, dtype) for name, t in ckpt.floats.items()}, strict=False, assign=True)
    packed, ckpt.packed = ckpt.packed, {}  # consumed layer by layer below: each row layout freed once repacked
    if "lm_head.weight" not in packed and "lm_head.weight" not in ckpt.floats:  # tied: the output matrix is the
        if "model.embed_tokens.weight" in packed:  # embedding, in whichever form the file stores it
            packed["lm_head.weight"] = packed["model.embed_tokens.weight"]
        else:
            model.lm_head.weight = model.model.embed_tokens.weight
    ckpt.floats.clear()  # as for the blocks: a float matrix freed once repacked (peak memory: one copy, not two)
    widen_embedding_(model)
    apply_packed_(model, packed)
    if missing := [name for name, p in model.named_parameters() if p.is_meta]:
        raise SpecdecodeError(f"{gguf.name} lacks {len(missing)} weights (first: {missing[0]}): the file is incomplete")
    return say_float16(model.eval(), gguf.name), ckpt.tokenizer


def say_float16(model: torch.nn.Module, source: str) -> torch.nn.Module:
    """One line where float16 matrices run on the vector units while this CPU has bfloat16 tiles: converting them
    is the user's choice (another model), not ours."""
    kernels = cpu_kernels()
    halves = any(isinstance(m, KernelLinear) and m.tiles is None and m.weight.dtype == torch.float16
                 for m in model.modules())
    if halves and kernels is not None and kernels.bf16_tiles_on():
        log.warning("specdecode: %s has float16 matrices: they run on the vector units (this CPU has no float16 "
                    "tiles); --weights float --dtype bfloat16 runs them rounded to bfloat16 on its AMX tiles, a "
                    "model of its own", source)
    return model


def as_run(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of weights as stored in the dtype it runs in: bfloat16 and float16 matrices keep their 16 bits
    under float32 activations (the linear layers read them on the kernels, the embedding widens the rows it looks
    up: half the bytes of float32, the same values); everything else in `dtype`."""
    keeps = tensor.dim() == 2 and tensor.dtype in HALF_DTYPES and dtype == torch.float32
    return tensor if keeps else tensor.to(dtype)


def _transformers(hf_config: dict, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                  device: str) -> HFModel:
    import transformers

    config = transformers.AutoConfig.for_model(**hf_config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(state_dict, strict=False, assign=True)
    if any(b.is_meta for b in model.buffers()):  # tables built at init (rotary), in no checkpoint: build them
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.load_state_dict(state_dict, strict=False)
    model.tie_weights()
    return HFModel(model.to(device))


@dataclass
class Models:
    """What a method's drafter is built over (methods.py), loaded once."""

    target: torch.nn.Module  # the engine's forward contract (native or transformers)
    tokenizer: Any
    draft: torch.nn.Module | None = None  # the draft model, for methods that run one
    draft_head_tokens: torch.Tensor | None = None  # the vocabulary id of each logit of its cut LM head
    draft_bridge: Any = None  # a draft with another tokenizer: the text between the two (token_bridge.TokenBridge)
    trained: str | None = None  # the folder `specdecode train` wrote, for methods that run a trained head
    suffix_pool: Any = None  # earlier answers suffix decoding drafts from (drafters/suffix_pool.py); None: a fresh one
    source: str | None = None  # what the target was loaded from (its checkpoint's MTP layers are read from there)


def load_models(target: str, draft: str | None, plan: LoadPlan, device: str = "cpu", adapter: str | None = None,
                draft_vocab: int = DEFAULT_HEAD_SIZE, draft_vocab_corpus: list[str] | None = None,
                trained: str | None = None) -> Models:
    """The target as `plan` runs it and, when `draft` is given, the draft model (`load_draft`)."""
    model, tokenizer = load_model(target, plan.dtype, device, plan.quantize, plan.weights)
    use_kv_dtype(model, plan.kv_dtype)
    models = Models(model, tokenizer, trained=trained, source=target)
    if draft is not None:
        models.draft, models.draft_head_tokens, models.draft_bridge = load_draft(
            draft, plan, device, tokenizer, target, adapter, draft_vocab, draft_vocab_corpus)
    return models


def use_kv_dtype(model: torch.nn.Module, kv_dtype: torch.dtype | None) -> None:
    """Caches in `kv_dtype` for a native model (one through transformers keeps its own)."""
    if kv_dtype is not None and hasattr(model, "kv_dtype"):
        model.kv_dtype = kv_dtype


def load_draft(source: str, plan: LoadPlan, device: str, target_tokenizer: Any, target: str,
               adapter: str | None = None, vocab: int = DEFAULT_HEAD_SIZE, corpus: list[str] | None = None
               ) -> tuple[torch.nn.Module, torch.Tensor | None, TokenBridge | None]:
    """A draft model ready to draft: a LoRA adapter (`specdecode train draft`) applied, its LM head cut to the
    `vocab` most frequent tokens of its tokenizer (counted on `corpus`) -> (the model, the vocabulary id of each
    logit of its head or None when it scores them all, the bridge to the target's tokens when its tokenizer is
    another's, else None)."""
    # Each draft's own form: a benchmark or `advise` loads several, and an architecture the native model lacks
    # runs in float through transformers even where another draft runs as stored.
    weights = resolve_draft_weights(source, device) if plan.draft_weights == "stored" else plan.draft_weights
    model, tokenizer = load_model(source, plan.dtype, device, plan.draft_quantize, weights, target_tokenizer)
    use_kv_dtype(model, plan.kv_dtype)
    # The draft's own tokenizer comes with it: loading it separately first cost a second at every start.
    tokenizer = tokenizer or load_tokenizer(source)
    bridge = None
    if not same_tokenizer(target_tokenizer, tokenizer):
        if adapter is not None:
            raise SpecdecodeError(f"a LoRA adapter is trained on the target's tokens; draft '{source}' has "
                                  "another tokenizer")
        if tokenizer is None or target_tokenizer is None:
            raise SpecdecodeError(f"draft '{source}' and target '{target}' use different vocabularies and one of "
                                  "them ships no tokenizer to map text between them")
        bridge = TokenBridge.between(target_tokenizer, tokenizer, target, source)
    elif adapter is not None:
        from specdecode.weights.lora import apply_adapter

        apply_adapter(model, adapter, source)
    narrow = plan.draft_quantize if weights == "stored" else "none"
    return model, cut_draft_head(model, tokenizer if bridge else target_tokenizer, source, vocab, corpus,
                                 narrow), bridge


def same_tokenizer(target_tok, draft_tok) -> bool:
    if target_tok is not None and target_tok is draft_tok:  # a draft whose files are the target's (load_stored)
        return True
    return target_tok is not None and draft_tok is not None and target_tok.get_vocab() == draft_tok.get_vocab()


def check_same_tokenizer(target_tok, draft_tok, target: str, draft: str, why: str = "this") -> None:
    """For what needs the target's own tokens in the draft (a LoRA adapter, transformers' assisted generation)."""
    if not same_tokenizer(target_tok, draft_tok):
        raise SpecdecodeError(
            f"draft '{draft}' and target '{target}' use different tokenizers, and {why} needs the same: pick a "
            "draft of the same family (same vocabulary), or run it with --method draft, which maps text between them"
        )
