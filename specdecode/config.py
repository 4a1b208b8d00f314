"""Plain configuration records: the model's shape, how to sample, how to speculate.

`ModelConfig.from_hf` is the one place where a Hugging Face `config.json` is translated into the flags that
`model.py` understands (qkv bias, q/k norm, tied embeddings, rope scaling, Gemma 3's norms, activation and sliding
windows, Qwen3-MoE's experts, gpt-oss's attention sinks and biased experts, Qwen3-Next's linear-attention layers,
gated attention and shared experts); unknown keys are dropped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdecode.errors import SpecdecodeError

# Families model.py implements natively; anything else goes through hf_model.HFModel.
NATIVE_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "qwen3_moe", "gpt_oss", "qwen3_next")
# GGUF `general.architecture` names of the same families (a GGUF's gemma3 is transformers' gemma3_text)
NATIVE_GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3", "qwen3moe", "gpt-oss", "qwen3next")
GEMMA_TYPES = ("gemma3_text",)
MOE_TYPES = ("qwen3_moe",)  # a mixture-of-experts MLP in some layers (models/experts.py)
GPT_OSS_TYPES = ("gpt_oss",)  # experts in every layer, attention sinks, sliding-window layers
# gated DeltaNet layers beside gated full attention, experts with a shared expert (models/deltanet.py)
HYBRID_TYPES = ("qwen3_next",)
NATIVE_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
NATIVE_ROPE_SCALING = ("linear", "llama3", "yarn")
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
    # Gemma 3's differences from the llama layer (the defaults are llama's):
    hidden_act: str = "silu"  # of the gated MLP
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden_size), in the embedding's dtype
    norm_unit_offset: bool = False  # RMSNorm weights applied as (1 + w), in float32 (HF checkpoints; GGUF adds the 1)
    sandwich_norms: bool = False  # four norms a layer: after attention and around the MLP (pre- and post-)
    query_pre_attn_scalar: float | None = None  # attention scale query_pre_attn_scalar**-0.5, not head_dim**-0.5
    sliding_window: int | None = None  # a local layer's query at position p sees keys at (p - window, p]
    local_layers: tuple[int, ...] = ()  # the layers with the sliding window (and their own rope theta)
    rope_local_theta: float | None = None  # those layers' rope theta (None: the global layers' rope, gpt-oss's)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap)
    # Mixture of experts (Qwen3-MoE, models/experts.py): the layers whose MLP is the experts, and their shape
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # the top k weights renormalised to sum to 1
    # gpt-oss's differences (the defaults are Qwen3-MoE's and llama's):
    o_bias: bool = False  # the attention output projection has a bias
    attention_sinks: bool = False  # a learned logit per head joins each softmax's denominator (models/sinks.py)
    expert_bias: bool = False  # the router and every expert matrix have biases
    softmax_after_topk: bool = False  # the router's top k logits picked first, then softmax over those k alone
    swiglu_limit: float | None = None  # clamped SwiGLU: gate <= limit, |up| <= limit, (up + 1) * gate * sigmoid(a gate)
    swiglu_alpha: float = 1.0  # that sigmoid's gain
    gate_up_interleaved: bool = False  # transformers' fused experts: [d, 2I] each, gate and up columns alternating
    # Qwen3-Next's differences (models/deltanet.py; the defaults are the plain attention layer's):
    shared_expert_intermediate_size: int = 0  # an expert every token runs, scaled by a sigmoid gate (0: none)
    attention_output_gate: bool = False  # q_proj also yields a per-head gate: output * sigmoid(gate)
    rotary_dim: int | None = None  # partial rotary: only a head's first rotary_dim dimensions turn (None: all)
    linear_layers: tuple[int, ...] = ()  # the layers whose token mixer is gated DeltaNet, not attention
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0  # the causal convolution's width over q, k and v

    @property
    def llama_layers(self) -> bool:
        """Whether every layer is the plain llama layer, the one the native decode stack (kernels) implements."""
        return (self.hidden_act == "silu" and not self.embed_scale and not self.norm_unit_offset
                and not self.sandwich_norms and self.query_pre_attn_scalar is None and not self.local_layers
                and self.final_logit_softcapping is None and not self.moe_layers and not self.o_bias
                and not self.attention_sinks and not self.linear_layers)

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """The layers with keys and values in the cache (every layer but the linear-attention ones)."""
        linear = set(self.linear_layers)
        return tuple(i for i in range(self.num_layers) if i not in linear)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        model_type = hf.get("model_type", "llama")
        if model_type not in NATIVE_MODEL_TYPES:
            raise SpecdecodeError(f"model type '{model_type}' has no native implementation (loading.load_model runs it "
                                  "through transformers)")
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        gemma = _gemma_flags(hf) if model_type in GEMMA_TYPES else {}
        experts = _moe_flags(hf) if model_type in (*MOE_TYPES, *HYBRID_TYPES) else {}
        if model_type in GPT_OSS_TYPES:
            experts = _gpt_oss_flags(hf)
        if model_type in HYBRID_TYPES:
            experts.update(_hybrid_flags(hf))
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=gemma.pop("rope_theta", None) or _rope_theta(hf),
            rope_scaling=gemma.pop("rope_scaling") if gemma else _rope_scaling(hf),
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and never writes the flag; Llama-style configs say attention_bias.
            qkv_bias=bool(hf.get("attention_bias", model_type in ("qwen2", *GPT_OSS_TYPES))),
            qk_norm=model_type in ("qwen3", *GEMMA_TYPES, *MOE_TYPES, *HYBRID_TYPES),
            eos_token_ids=eos_ids,
            **gemma,
            **experts,
        )


def _moe_flags(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-MoE's fields of ModelConfig: the experts' shape and routing, and which layers have them (every
    decoder_sparse_step-th layer but those in mlp_only_layers, as transformers builds them)."""
    experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
    step, dense = hf.get("decoder_sparse_step") or 1, set(hf.get("mlp_only_layers") or ())
    layers = tuple(i for i in range(hf["num_hidden_layers"]) if experts and i not in dense and (i + 1) % step == 0)
    return dict(moe_layers=layers, num_experts=experts, num_experts_per_tok=hf.get("num_experts_per_tok") or 0,
                moe_intermediate_size=hf.get("moe_intermediate_size") or 0,
                norm_topk_prob=bool(hf.get("norm_topk_prob", False)))


def _hybrid_flags(hf: dict[str, Any]) -> dict[str, Any]:
    """Qwen3-Next's fields of ModelConfig beside its experts: which layers are gated DeltaNet (every
    full_attention_interval-th layer attends), their shape, the gated attention with partial rotary and (1 + w)
    norms, and the shared expert."""
    layers = hf["num_hidden_layers"]
    interval = hf.get("full_attention_interval") or 4
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]
    params = hf.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor") or hf.get("partial_rotary_factor") or 1.0
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    return dict(
        shared_expert_intermediate_size=hf.get("shared_expert_intermediate_size") or 0,
        attention_output_gate=True,
        norm_unit_offset=True,
        rotary_dim=int(head_dim * factor) if factor != 1.0 else None,
        linear_layers=tuple(i for i, kind in enumerate(types) if kind == "linear_attention"),
        linear_key_heads=hf["linear_num_key_heads"],
        linear_value_heads=hf["linear_num_value_heads"],
        linear_key_dim=hf["linear_key_head_dim"],
        linear_value_dim=hf["linear_value_head_dim"],
        linear_conv_kernel=hf.get("linear_conv_kernel_dim") or 4,
    )


def _gpt_oss_flags(hf: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss's fields of ModelConfig: experts in every layer (biased, softmax over the chosen logits, clamped
    SwiGLU), sinks and biases in attention, and the sliding-window layers, which share the global layers' rope."""
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]
    window = hf.get("sliding_window")
    return dict(
        moe_layers=tuple(range(layers)),
        num_experts=hf.get("num_local_experts") or hf.get("num_experts") or 0,
        num_experts_per_tok=hf.get("num_experts_per_tok") or 0,
        moe_intermediate_size=hf["intermediate_size"],
        o_bias=bool(hf.get("attention_bias", True)),
        attention_sinks=True,
        expert_bias=True,
        softmax_after_topk=True,
        swiglu_limit=float(hf.get("swiglu_limit") or 7.0),
        swiglu_alpha=float(hf.get("swiglu_alpha") or 1.702),
        gate_up_interleaved=True,
        sliding_window=int(window) if window else None,
        local_layers=tuple(i for i, kind in enumerate(types) if kind == "sliding_attention") if window else (),
    )


def _gemma_flags(hf: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's fields of ModelConfig: its norms, activation, attention scale, local layers and their rope."""
    if hf.get("attn_logit_softcapping") is not None or hf.get("use_bidirectional_attention"):
        raise SpecdecodeError("attention logit softcapping and bidirectional attention have no native "
                              "implementation (loading.load_model runs such a model through transformers)")
    if (act := hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh") not in NATIVE_ACTIVATIONS:
        raise SpecdecodeError(f"activation '{act}' has no native implementation (loading.load_model runs such a "
                              "model through transformers)")
    params = hf.get("rope_parameters") or {}
    if "full_attention" in params:  # transformers 5: one rope per layer type
        global_rope, local_rope = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    else:  # older configs: the global rope at the top level, the local layers' theta beside it
        global_rope = dict(params, rope_theta=hf.get("rope_theta") or params.get("rope_theta") or 1_000_000.0)
        local_rope = {"rope_theta": hf.get("rope_local_base_freq") or 10_000.0}
    if (local_rope.get("rope_type") or "default") != "default":
        raise SpecdecodeError("rope scaling on sliding-window layers has no native implementation "
                              "(loading.load_model runs such a model through transformers)")
    layers = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [
        "full_attention" if (i + 1) % (hf.get("sliding_window_pattern") or 6) == 0 else "sliding_attention"
        for i in range(layers)]
    window = hf.get("sliding_window")
    scalar = hf.get("query_pre_attn_scalar")
    return dict(
        rope_theta=float(global_rope.get("rope_theta") or 1_000_000.0),
        rope_scaling=_rope_scaling({"rope_scaling": global_rope}),
        hidden_act=act,
        embed_scale=True,
        norm_unit_offset=True,
        sandwich_norms=True,
        query_pre_attn_scalar=float(scalar) if scalar is not None else None,
        sliding_window=int(window) if window else None,
        local_layers=tuple(i for i, kind in enumerate(types) if kind == "sliding_attention") if window else (),
        rope_local_theta=float(local_rope.get("rope_theta") or 10_000.0),
        final_logit_softcapping=hf.get("final_logit_softcapping"),
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
    if hf.get("model_type") in GEMMA_TYPES:
        try:
            _gemma_flags(hf)
        except (SpecdecodeError, KeyError):
            return False
        return True
    scaling = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if hf.get("model_type") in GPT_OSS_TYPES and hf.get("quantization_config"):
        return False  # the published checkpoints' MXFP4 expert blocks: transformers reads them
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
