"""Build a ready-to-run model from any source: the native Transformer when the family is known, else transformers.

`weights.load_checkpoint` finds the tensors (packaged name, GGUF file, HF folder, hub id); this module picks the
implementation, the dtype and the device.
"""

from __future__ import annotations

import torch

from specdecode.config import NATIVE_MODEL_TYPES, ModelConfig
from specdecode.errors import SpecdecodeError
from specdecode.hf_model import HFModel
from specdecode.kernels import cpu_flags, cpu_kernels
from specdecode.model import Transformer, rope_inv_freq
from specdecode.quantize import quantize_
from specdecode.weights import load_checkpoint, load_tokenizer  # noqa: F401  (load_tokenizer: re-exported)

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def resolve_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """'auto' is bfloat16 where bf16 weights are fast: CUDA, and CPUs where specdecode's kernel runs (it reads
    bf16 weights, half the bytes of float32, and accumulates in float32) or that have AVX-512 BF16 / AMX."""
    if name == "auto":
        if device.startswith("cuda"):
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        fast_bf16 = bool({"avx512_bf16", "amx_bf16"} & set(cpu_flags()))
        return torch.bfloat16 if fast_bf16 or cpu_kernels() is not None else torch.float32
    if name not in DTYPES:
        raise SpecdecodeError(f"unknown dtype '{name}': choose auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_draft_quantize(mode: str, device: str) -> str:
    """'auto' = int8 on CPU where the kernel runs: the draft's precision changes only its guesses, never the
    output, and int8 weights make each guess about 1.6x cheaper than bf16 (int4 decodes slower on AVX2)."""
    if mode != "auto":
        return mode
    return "int8" if device == "cpu" and cpu_kernels() is not None else "none"


def load_model(source: str, dtype: torch.dtype, device: str = "cpu",
               quantize: str = "none") -> tuple[torch.nn.Module, object]:
    """-> (model with the engine's forward contract, tokenizer); `quantize` = none, int8 or int4 weights."""
    ckpt = load_checkpoint(source, dtype)
    if ckpt.config.get("model_type") in NATIVE_MODEL_TYPES:
        # Every linear layer on the CPU kernel (where it runs), so verify forwards are cheap and exact.
        return quantize_(_native(ckpt.config, ckpt.state_dict, device), quantize), ckpt.tokenizer
    model = _transformers(ckpt.config, ckpt.state_dict, dtype, device)
    return (quantize_(model, quantize) if quantize != "none" else model), ckpt.tokenizer


def _native(hf_config: dict, state_dict: dict[str, torch.Tensor], device: str) -> Transformer:
    config = ModelConfig.from_hf(hf_config)
    with torch.device("meta"):  # no random init of weights that are replaced at once
        model = Transformer(config)
    model.load_state_dict(state_dict, strict=False, assign=True)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise SpecdecodeError(f"checkpoint lacks {len(missing)} weights (first: {missing[0]}): the file is incomplete")
    model.inv_freq = rope_inv_freq(config)  # buffers built on the meta device hold no values
    return model.to(device).eval()


def _transformers(hf_config: dict, state_dict: dict[str, torch.Tensor], dtype: torch.dtype,
                  device: str) -> HFModel:
    import transformers

    config = transformers.AutoConfig.for_model(**hf_config)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.load_state_dict(state_dict, strict=False, assign=True)
    model.tie_weights()
    return HFModel(model.to(device))
