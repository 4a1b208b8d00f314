"""Tiny random-weight models for the unit tier: built in memory, nothing downloaded."""

from __future__ import annotations

import torch

from specdecode.config import ModelConfig
from specdecode.models.model import Transformer

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0)


def hf_config(model_type: str = "qwen2", **overrides):
    import transformers

    classes = {"qwen2": transformers.Qwen2Config, "llama": transformers.LlamaConfig,
               "qwen3": transformers.Qwen3Config, "mistral": transformers.MistralConfig}
    kwargs = dict(TINY, **overrides)
    if model_type == "qwen3":
        kwargs.setdefault("head_dim", 8)
    return classes[model_type](**kwargs)


def hf_model(model_type: str = "qwen2", seed: int = 0, **overrides):
    import transformers

    torch.manual_seed(seed)
    config = hf_config(model_type, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if model_type == "qwen2":  # random init leaves biases at zero; make them count
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.data.normal_(0, 0.1)
    return model


def native_from_hf(hf) -> Transformer:
    config = ModelConfig.from_hf(hf.config.to_dict())
    model = Transformer(config)
    missing, unexpected = model.load_state_dict(hf.state_dict(), strict=False)
    assert not unexpected, unexpected
    assert all(k == "lm_head.weight" for k in missing), missing  # tied embeddings share the tensor
    return model.eval()


def tiny_native(model_type: str = "qwen2", seed: int = 0, dtype: torch.dtype = torch.float32,
                **overrides) -> Transformer:
    return native_from_hf(hf_model(model_type, seed, **overrides)).to(dtype)
