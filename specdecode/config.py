"""Plain configuration records: the model's shape, how to sample, how to speculate.

`ModelConfig.from_hf` is the one place where a Hugging Face `config.json` is translated into the flags that
`model.py` understands (qkv bias, q/k norm, tied embeddings, rope scaling); unknown keys are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdecode.errors import SpecdecodeError

# Families model.py implements natively; anything else goes through hf_model.HFModel.
NATIVE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
NATIVE_ROPE_SCALING = ("linear", "llama3")
MAX_TOP_LOGPROBS = 20  # alternatives per token OpenAI allows


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        model_type = hf.get("model_type", "llama")
        if model_type not in NATIVE_MODEL_TYPES:
            raise SpecdecodeError(f"model type '{model_type}' has no native implementation (loading.load_model runs it "
                                  "through transformers)")
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=_rope_theta(hf),
            rope_scaling=_rope_scaling(hf),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and never writes the flag; Llama-style configs say attention_bias.
            qkv_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type == "qwen3",
            eos_token_ids=eos_ids,
        )


def _rope_theta(hf: dict[str, Any]) -> float:
    params = hf.get("rope_parameters") or {}
    return float(hf.get("rope_theta") or params.get("rope_theta") or 10000.0)


def _rope_scaling(hf: dict[str, Any]) -> dict[str, Any] | None:
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters")
    if not scaling:
        return None
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return None
    if kind not in NATIVE_ROPE_SCALING:
        raise SpecdecodeError(f"rope scaling '{kind}' has no native implementation (loading.load_model runs such a "
                              "model through transformers)")
    return dict(scaling, rope_type=kind)


def runs_natively(hf: dict[str, Any]) -> bool:
    """Whether the native model (model.py) implements this HF config; the others run through transformers."""
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    return hf.get("model_type") in NATIVE_MODEL_TYPES and kind in ("default", *NATIVE_ROPE_SCALING)


@dataclass
class SamplingParams:
    """How the target's next-token distribution is turned into tokens. temperature 0 means greedy."""

    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # The target's distribution is defined after these, drafts or not (rules/): OpenAI's and vLLM's meanings.
    presence_penalty: float = 0.0  # subtracted once from each token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides a positive logit (multiplies a negative) of a token in prompt or output
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    min_p: float = 0.0  # after temperature: drop tokens below min_p times the likeliest token's probability
    min_tokens: int = 0  # EOS is impossible before this many new tokens
    logprobs: int | None = None  # report each new token's log-probability and this many alternatives (None: off)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first (echo)
    grammar: Any = None  # a compiled constraint (rules/grammar.py): only text it accepts can be sampled

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise SpecdecodeError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise SpecdecodeError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise SpecdecodeError(f"top_k must be >= 0 (0 turns it off), got {self.top_k}")
        if self.max_new_tokens < 1:
            raise SpecdecodeError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise SpecdecodeError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 < self.repetition_penalty <= 10:
            raise SpecdecodeError(f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}")
        if not 0 <= self.min_p <= 1:
            raise SpecdecodeError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0:
            raise SpecdecodeError(f"min_tokens must be >= 0, got {self.min_tokens}")
        for token, bias in self.logit_bias.items():
            if not isinstance(token, int) or token < 0:
                raise SpecdecodeError(f"logit_bias: token ids are integers >= 0, got {token!r}")
            if not -100 <= bias <= 100:
                raise SpecdecodeError(f"logit_bias: a bias must be in [-100, 100], got {bias} for token {token}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
                raise SpecdecodeError(f"{name} must be in [0, {MAX_TOP_LOGPROBS}], got {value}")

    @property
    def shapes_logits(self) -> bool:
        """Whether anything but temperature, top-k, top-p and min-p defines the distribution (rules/)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens or self.grammar is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def choice_seed(seed: int | None, choice: int) -> int | None:
    """n > 1: choice i of a seeded request draws from seed + i (within a generator's 64 bits); choice 0 is the
    request a single answer with that seed would be."""
    return seed if seed is None or choice == 0 else (seed + choice) % 2**64
