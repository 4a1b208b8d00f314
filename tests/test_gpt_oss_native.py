"""gpt-oss on the native model: parity with transformers' GptOssForCausalLM on a tiny random config (attention sinks,
sliding-window layers alternating with full ones and a window shorter than the prompt, biased attention and experts,
softmax over the chosen router logits, the clamped SwiGLU, YaRN rope), each verify row computed as its own one-token
forward, and every method's greedy output equal to plain decoding, tree methods included."""

import numpy as np
import pytest
import torch
from native_families import (
    PROMPT,
    add_gguf_vocabulary,
    check_every_method,
    check_greedy_equals_transformers,
    check_hf_folder_loads_natively,
    check_logits_past_the_window,
    check_tree_forward,
    check_verify_rows,
    finish_gguf,
    gguf_writer,
    native,
    run,
)

from specdecode.config import ModelConfig, runs_natively
from specdecode.drafters import DraftModelDrafter, NgramDrafter, NoDrafter
from specdecode.drafters.lookahead import LookaheadDrafter
from specdecode.engine.engine import Engine
from specdecode.models.experts import SparseMoE
from specdecode.models.masks import chain_mask
from specdecode.models.model import Transformer
from specdecode.weights.quantize import quantize_

WINDOW = 4
YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 64, "rope_theta": 10_000.0}


def gpt_oss_hf(seed: int = 0, **overrides):
    """A tiny GptOssForCausalLM: 8 experts, 2 a token, expert width apart from hidden (a transposed matrix shows),
    layers 0 and 2 sliding. Sinks, biases, router and norms random (their init leaves most at zero), the expert
    matrices spread so that the SwiGLU clamp (limit lowered to 1) is reached."""
    import transformers

    kwargs = dict(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
                  sliding_window=WINDOW, swiglu_limit=1.0, rope_parameters=dict(YARN), max_position_embeddings=256,
                  eos_token_id=None, pad_token_id=0, bos_token_id=None)
    config = transformers.GptOssConfig(**dict(kwargs, **overrides))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1, 0.3)
            elif name.endswith("sinks"):
                p.normal_(0, 1.0)
            elif "router" in name:  # spread its logits, so routes differ between tokens
                p.normal_(0, 0.5)
            elif "experts" in name:
                p.normal_(0, 0.3)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    return model


def test_config_flags_and_routing():
    hf = gpt_oss_hf()
    config = ModelConfig.from_hf(hf.config.to_dict())
    assert type(hf).__name__ == "GptOssForCausalLM" and runs_natively(hf.config.to_dict())
    assert config.moe_layers == (0, 1, 2, 3) and config.num_experts == 8 and config.moe_intermediate_size == 16
    assert config.local_layers == (0, 2) and config.sliding_window == WINDOW and config.rope_local_theta is None
    assert config.attention_sinks and config.qkv_bias and config.o_bias and config.expert_bias
    assert config.rope_scaling["rope_type"] == "yarn" and not config.llama_layers
    assert config.swiglu_limit == 1.0 and config.swiglu_alpha == pytest.approx(1.702)
    assert not runs_natively(dict(hf.config.to_dict(), quantization_config={"quant_method": "mxfp4"}))
    model = native(hf)
    assert isinstance(model.model.layers[3].mlp, SparseMoE) and model.model.layers[0].self_attn.sinks is not None


@torch.no_grad()
def test_experts_split_from_the_fused_layout():
    """One expert of the native MLP against transformers' fused expert tensors, computed by hand."""
    hf = gpt_oss_hf()
    experts = hf.model.layers[1].mlp.experts
    moe = native(hf).model.layers[1].mlp
    x = torch.randn(3, 32, generator=torch.Generator().manual_seed(1))
    gate_up = x @ experts.gate_up_proj[5] + experts.gate_up_proj_bias[5]
    gate, up = gate_up[:, ::2].clamp(max=1.0), gate_up[:, 1::2].clamp(-1.0, 1.0)
    ref = ((up + 1) * gate * torch.sigmoid(1.702 * gate)) @ experts.down_proj[5] + experts.down_proj_bias[5]
    assert torch.allclose(moe.experts[5](x), ref, atol=1e-5)


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_logits_match_transformers_past_the_window(kv_heads):
    check_logits_past_the_window(gpt_oss_hf(num_key_value_heads=kv_heads))


@torch.no_grad()
def test_yarn_rope_matches_transformers_beyond_the_original_context():
    """Positions past YaRN's original context (64), truncated correction range (transformers' default)."""
    hf = gpt_oss_hf(rope_parameters=dict(YARN, truncate=True, factor=8.0), num_hidden_layers=2)
    model = native(hf)
    ids = torch.randint(0, 64, (1, 80), generator=torch.Generator().manual_seed(7))
    out, _ = model(ids, torch.arange(80)[None], model.new_cache(1, 96), chain_mask(0, 80))
    assert torch.allclose(out, hf(ids).logits, atol=1e-5)


def test_greedy_tokens_equal_transformers():
    check_greedy_equals_transformers(gpt_oss_hf())


@pytest.mark.parametrize("form", ["python", "none"])
def test_verify_rows_equal_one_row_at_a_time(form):
    """k rows in one forward (sinks and windows per row, experts grouped across rows) against each row alone: the
    same argmax; on the kernels the same bits."""
    check_verify_rows(native(gpt_oss_hf()), form)


def test_tree_forward_sees_each_paths_window():
    check_tree_forward(native(gpt_oss_hf()))


@pytest.mark.parametrize("form", ["python", "kernels", "kernels-bf16-kv"])
def test_every_method_gives_plain_decodings_tokens(form):
    check_every_method(native(gpt_oss_hf()), native(gpt_oss_hf(seed=1)), form)


def test_an_hf_folder_loads_natively(tmp_path):
    check_hf_folder_loads_natively(gpt_oss_hf(), tmp_path)


@pytest.mark.parametrize("form", ["python", "kernels"])
@torch.no_grad()
def test_yarn_on_a_dense_family(form):
    """YaRN is a rope flag of every family: a Llama with it, on the Python layers and on the native decode stack
    (which reads the same scaled rotary tables)."""
    from tiny import hf_model, native_from_hf

    hf = hf_model("llama", rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32})
    assert runs_natively(hf.config.to_dict())
    model = native_from_hf(hf)
    if form == "kernels":
        quantize_(model, "none")
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(8))
    out, _ = model(ids, torch.arange(40)[None], model.new_cache(1, 64), chain_mask(0, 40), decode=True)
    assert torch.allclose(out, hf(ids).logits, atol=1e-5), (out - hf(ids).logits).abs().max()
    assert (form == "kernels") == (model.native is not None and model.native.built is not None)


# --- a GGUF written with gguf-py, as llama.cpp's converter writes gpt-oss: gate and up apart (de-interleaved), each
# expert tensor [experts, out, in], biases [experts, out], the router and the sinks in float ---



def gguf_gpt_oss_hf():
    """Matrices whose inputs fill 32-weight blocks (Q8_0's, MXFP4's), the expert width apart from hidden; the SwiGLU
    limit the real model's (a GGUF does not store it)."""
    return gpt_oss_hf(hidden_size=64, intermediate_size=32, swiglu_limit=7.0)


def gguf_tensors(hf) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names."""
    c, sd = hf.config, {k: v.numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
           "output.weight": sd["lm_head.weight"]}
    for i in range(c.num_hidden_layers):
        layer, blk = f"model.layers.{i}.", f"blk.{i}."
        gate_up, gate_up_bias = sd[layer + "mlp.experts.gate_up_proj"], sd[layer + "mlp.experts.gate_up_proj_bias"]
        out.update({
            blk + "attn_norm.weight": sd[layer + "input_layernorm.weight"],
            blk + "post_attention_norm.weight": sd[layer + "post_attention_layernorm.weight"],
            blk + "attn_sinks.weight": sd[layer + "self_attn.sinks"],
            blk + "ffn_gate_inp.weight": sd[layer + "mlp.router.weight"],
            blk + "ffn_gate_inp.bias": sd[layer + "mlp.router.bias"],
            blk + "ffn_gate_exps.weight": gate_up[:, :, 0::2].transpose(0, 2, 1),
            blk + "ffn_gate_exps.bias": gate_up_bias[:, 0::2],
            blk + "ffn_up_exps.weight": gate_up[:, :, 1::2].transpose(0, 2, 1),
            blk + "ffn_up_exps.bias": gate_up_bias[:, 1::2],
            blk + "ffn_down_exps.weight": sd[layer + "mlp.experts.down_proj"].transpose(0, 2, 1),
            blk + "ffn_down_exps.bias": sd[layer + "mlp.experts.down_proj_bias"],
        })  # fmt: skip
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                             ("attn_output", "o_proj")):
            out[f"{blk}{ours}.weight"] = sd[f"{layer}self_attn.{theirs}.weight"]
            out[f"{blk}{ours}.bias"] = sd[f"{layer}self_attn.{theirs}.bias"]
    return out


def held(values: np.ndarray, kind) -> np.ndarray:
    """What a tensor written in `kind`'s blocks holds."""
    from gguf.quants import dequantize, quantize

    return np.array(dequantize(quantize(np.ascontiguousarray(values), kind), kind)).reshape(values.shape)


def block_kind(name: str, values: np.ndarray, blocks: str | None, expert_blocks: str | None):
    """The block type a tensor is written in (None: float32): the router, sinks, norms and biases (the experts'
    [experts, out] too) stay float."""
    import gguf

    if values.ndim < 2 or name.endswith(".bias") or "ffn_gate_inp" in name:
        return None
    chosen = expert_blocks if "_exps" in name else blocks
    return gguf.GGMLQuantizationType[chosen] if chosen else None


def write_gpt_oss_gguf(path, hf, blocks: str | None = None, expert_blocks: str | None = None) -> None:
    import gguf

    c = hf.config
    writer = gguf_writer(path, "gpt-oss", c, c.rope_parameters["rope_theta"], c.num_local_experts, c.intermediate_size)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(c.rope_parameters["factor"])
    writer.add_rope_scaling_orig_ctx_len(c.rope_parameters["original_max_position_embeddings"])
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_sliding_window(c.sliding_window)
    add_gguf_vocabulary(writer)
    for name, values in gguf_tensors(hf).items():
        values = np.ascontiguousarray(values)
        if (kind := block_kind(name, values, blocks, expert_blocks)) is not None:
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, values)
    finish_gguf(writer)


def hold_as_written(hf, blocks: str | None, expert_blocks: str | None) -> None:
    """hf's weights replaced by what the file holds (the reference runs on the same weights)."""
    sd = hf.state_dict()
    for name, values in gguf_tensors(hf).items():
        if (kind := block_kind(name, values, blocks, expert_blocks)) is None:
            continue
        kept = torch.from_numpy(held(values, kind))
        blk, _, rest = name.partition(".")[2].partition(".")
        layer = f"model.layers.{blk}." if name.startswith("blk.") else ""
        if rest.startswith("ffn_gate_exps") or rest.startswith("ffn_up_exps"):
            first = 0 if rest.startswith("ffn_gate") else 1  # gate columns first, up columns between them
            sd[layer + "mlp.experts.gate_up_proj"][:, :, first::2] = kept.transpose(1, 2)
        elif rest.startswith("ffn_down_exps"):
            sd[layer + "mlp.experts.down_proj"].copy_(kept.transpose(1, 2))
        else:
            target = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight"}.get(name)
            if target is None:
                ours = rest.split(".")[0]
                theirs = {"attn_q": "q_proj", "attn_k": "k_proj", "attn_v": "v_proj", "attn_output": "o_proj"}[ours]
                target = f"{layer}self_attn.{theirs}.weight"
            sd[target].copy_(kept)


@pytest.mark.parametrize("blocks, expert_blocks", [(None, None), ("Q8_0", "Q8_0"), ("Q8_0", "MXFP4")])
@torch.no_grad()
def test_a_gguf_runs_as_stored(tmp_path, monkeypatch, caplog, blocks, expert_blocks):
    from specdecode.kernels import cpu_kernels
    from specdecode.weights import hub
    from specdecode.weights.loading import load_model
    from specdecode.weights.quantize import KernelLinear, QuantLinear

    if cpu_kernels() is None:
        pytest.skip("weights as stored run on the CPU kernels")
    monkeypatch.setattr(hub, "cache_dir", lambda: tmp_path)  # the unpacked folder
    hf = gguf_gpt_oss_hf()
    path = tmp_path / "tiny-gpt-oss.gguf"
    write_gpt_oss_gguf(path, hf, blocks, expert_blocks)
    hold_as_written(hf, blocks, expert_blocks)
    model, tokenizer = load_model(str(path), torch.float32, weights="stored")
    assert isinstance(model, Transformer) and tokenizer is not None
    c = model.config
    assert c.moe_layers == (0, 1, 2, 3) and c.moe_intermediate_size == 32 and c.local_layers == (0, 2)
    assert c.attention_sinks and c.rope_scaling["rope_type"] == "yarn" and c.sliding_window == WINDOW
    moe = model.model.layers[0].mlp
    assert isinstance(moe.gate, KernelLinear)  # the router in float
    # MXFP4 experts run on the integer kernels, as MXFP4 blocks (their outputs fill 16-channel vectors)
    assert (expert_blocks is not None) == isinstance(moe.experts[5].down_proj, QuantLinear)
    if expert_blocks == "MXFP4":
        assert moe.experts[5].down_proj.format.name == "mxfp4"
    assert "no integer kernel" not in caplog.text
    ids = torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(5))
    out, _ = model(ids, torch.arange(12)[None], model.new_cache(1, 16), chain_mask(0, 12), decode=True)
    ref = hf(ids).logits
    # float matrices: float arithmetic; blocks: the integer kernels round activations to 8 bits, as llama.cpp does
    # (MXFP4's coarser experts move the logits twice as far under that rounding: 0.06 here against Q8_0's 0.03)
    atol = 1e-4 if blocks is None else 0.1 if expert_blocks == "MXFP4" else 0.05
    assert torch.allclose(out, ref, atol=atol), (out - ref).abs().max()
    if blocks is not None:
        reference = run(Engine(model, NoDrafter()), PROMPT)
        for name, drafter in {"lookahead": LookaheadDrafter(), "ngram-tree": NgramDrafter(branches=4),
                              "self-draft-tree": DraftModelDrafter(model, vocab_size=64, width=2)}.items():
            assert run(Engine(model, drafter, num_draft_tokens=4), PROMPT) == reference, name


@torch.no_grad()
def test_a_gguf_runs_in_float(tmp_path, monkeypatch):
    """--weights float on a gpt-oss GGUF: transformers' converter cannot read its expert tensors, so our reader's
    are de-quantized onto the native model; transformers' logits on the weights the file holds."""
    from specdecode.kernels import cpu_kernels
    from specdecode.weights import hub
    from specdecode.weights.loading import load_model

    if cpu_kernels() is None:
        pytest.skip("the file's blocks are unpacked by the kernels' reader")
    monkeypatch.setattr(hub, "cache_dir", lambda: tmp_path)
    hf = gguf_gpt_oss_hf()
    path = tmp_path / "tiny-gpt-oss.gguf"
    write_gpt_oss_gguf(path, hf, "Q8_0", "Q8_0")
    hold_as_written(hf, "Q8_0", "Q8_0")
    model, tokenizer = load_model(str(path), torch.float32, weights="float")
    assert isinstance(model, Transformer) and tokenizer is not None
    ids = torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(5))
    out, _ = model(ids, torch.arange(12)[None], model.new_cache(1, 16), chain_mask(0, 12), decode=True)
    assert torch.allclose(out, hf(ids).logits, atol=1e-4)


@pytest.mark.parametrize("out", [16, 6])
def test_mxfp4_blocks_hold_the_file_weights_exactly(out):
    """MXFP4 bytes (every code, scales across float16's range) -> blocks holding gguf-py's own de-quantized values
    bit for bit: MXFP4 blocks on the 16-channel kernel (16 outputs), Q5_0 ones where the outputs do not fill a
    vector (6); the kernel's products those weights' (up to its 8-bit activations); a scale float16 cannot hold
    is refused (the tensor then runs de-quantized)."""
    import gguf
    from gguf.quants import dequantize

    from specdecode.kernels import cpu_kernels
    from specdecode.weights.blocks import from_gguf
    from specdecode.weights.quantize import QuantLinear

    rng = np.random.default_rng(0)
    raw = rng.integers(0, 256, size=(out, 4, 17), dtype=np.uint8)
    raw[..., 0] = rng.integers(104, 140, size=(out, 4))  # 2^-24 .. 2^11 halves
    raw[0, 0, 1:] = np.arange(16, dtype=np.uint8) * 17  # every nibble, low and high
    flat = raw.reshape(out, 4 * 17)
    want = np.array(dequantize(flat, gguf.GGMLQuantizationType.MXFP4), dtype=np.float32).reshape(out, 128)
    packed = from_gguf("MXFP4", flat, (out, 128))
    assert packed.format.name == ("mxfp4" if out == 16 else "q5_0")
    assert torch.equal(packed.dequantize(), torch.from_numpy(want))
    if (kernels := cpu_kernels()) is not None:  # and the kernel computes with them (8-bit activations' rounding)
        x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
        exact = x @ torch.from_numpy(want).T
        assert torch.allclose(QuantLinear(packed, None, kernels)(x), exact, atol=0.01 * exact.abs().max())
    raw[1, 1, 0] = 200
    with pytest.raises(ValueError):
        from_gguf("MXFP4", raw.reshape(out, 4 * 17), (out, 128))
