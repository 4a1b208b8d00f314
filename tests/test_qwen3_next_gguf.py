"""A Qwen3-Next GGUF as llama.cpp's converter writes one (the DeltaNet projection split into attn_qkv and attn_gate,
ssm_a = -exp(A_log), the convolution squeezed, norms as 1 + w, experts stacked), written with gguf-py from a tiny
random transformers model: as stored on the native model it gives transformers' logits, float matrices and Q8_0
blocks alike, and every method's greedy output equals plain decoding's."""

import numpy as np
import pytest
import torch
from native_families import (
    PROMPT,
    add_gguf_tensors,
    add_gguf_vocabulary,
    drafters,
    finish_gguf,
    gguf_writer,
    load_gguf_as_stored,
    run,
)
from test_qwen3_next_native import next_hf

from specdecode.drafters import NoDrafter
from specdecode.engine.engine import Engine
from specdecode.models.masks import chain_mask
from specdecode.models.model import Transformer


def gguf_hf():
    """Every layer with experts (llama.cpp's qwen3next has no dense layer); inputs of 32, Q8_0's block."""
    return next_hf(seed=2, mlp_only_layers=[])


def gguf_tensors(hf, mtp: dict | None = None) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names, changed as its converter changes them; `mtp` (a checkpoint's
    `mtp.*` tensors) as the block after the others, its fc and norms as `nextn.*`."""
    c, sd = hf.config, {k: v.numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"] + 1,
           "output.weight": sd["lm_head.weight"]}
    for i, kind in enumerate(c.layer_types):
        out.update(layer_tensors(c, sd, f"model.layers.{i}.", f"blk.{i}.", kind))
    if mtp is not None:
        sd = {k: v.numpy().astype(np.float32) for k, v in mtp.items()}
        blk = f"blk.{c.num_hidden_layers}."
        out.update(layer_tensors(c, sd, "mtp.layers.0.", blk, "full_attention"))
        out[blk + "nextn.eh_proj.weight"] = sd["mtp.fc.weight"]
        for ours, theirs in (("enorm", "pre_fc_norm_embedding"), ("hnorm", "pre_fc_norm_hidden"),
                             ("shared_head_norm", "norm")):
            out[f"{blk}nextn.{ours}.weight"] = sd[f"mtp.{theirs}.weight"] + 1
    return out


def layer_tensors(c, sd: dict, at: str, blk: str, kind: str) -> dict[str, np.ndarray]:
    """One decoder layer's tensors (HF names under `at`) under llama.cpp's (under `blk`)."""
    heads, dk = c.linear_num_key_heads, c.linear_key_head_dim
    group = c.linear_num_value_heads // heads * c.linear_value_head_dim
    out = {blk + "attn_norm.weight": sd[at + "input_layernorm.weight"] + 1,
           blk + "post_attention_norm.weight": sd[at + "post_attention_layernorm.weight"] + 1}
    if kind == "full_attention":
        for ours, theirs in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"),
                             ("attn_output", "o_proj")):
            out[f"{blk}{ours}.weight"] = sd[f"{at}self_attn.{theirs}.weight"]
        out[blk + "attn_q_norm.weight"] = sd[at + "self_attn.q_norm.weight"] + 1
        out[blk + "attn_k_norm.weight"] = sd[at + "self_attn.k_norm.weight"] + 1
    else:
        lin = at + "linear_attn."
        per_head = sd[lin + "in_proj_qkvz.weight"].reshape(heads, 2 * dk + 2 * group, -1)
        q, k, v, z = np.split(per_head, [dk, 2 * dk, 2 * dk + group], axis=1)
        d = per_head.shape[-1]
        out[blk + "attn_qkv.weight"] = np.concatenate([q.reshape(-1, d), k.reshape(-1, d), v.reshape(-1, d)])
        out[blk + "attn_gate.weight"] = z.reshape(-1, d)
        out[blk + "ssm_ba.weight"] = sd[lin + "in_proj_ba.weight"]
        out[blk + "ssm_conv1d.weight"] = sd[lin + "conv1d.weight"][:, 0]
        out[blk + "ssm_dt.bias"] = sd[lin + "dt_bias"]
        out[blk + "ssm_a"] = -np.exp(sd[lin + "A_log"])
        out[blk + "ssm_norm.weight"] = sd[lin + "norm.weight"]  # applied as is: no 1 added
        out[blk + "ssm_out.weight"] = sd[lin + "out_proj.weight"]
    mlp = at + "mlp."
    half = sd[mlp + "experts.gate_up_proj"].shape[1] // 2
    out[blk + "ffn_gate_inp.weight"] = sd[mlp + "gate.weight"]
    out[blk + "ffn_gate_exps.weight"] = sd[mlp + "experts.gate_up_proj"][:, :half]
    out[blk + "ffn_up_exps.weight"] = sd[mlp + "experts.gate_up_proj"][:, half:]
    out[blk + "ffn_down_exps.weight"] = sd[mlp + "experts.down_proj"]
    out[blk + "ffn_gate_inp_shexp.weight"] = sd[mlp + "shared_expert_gate.weight"].reshape(-1)
    for name in ("gate", "up", "down"):
        out[f"{blk}ffn_{name}_shexp.weight"] = sd[f"{mlp}shared_expert.{name}_proj.weight"]
    return out


def write_next_gguf(path, hf, blocks: str | None = None, mtp: dict | None = None) -> None:
    """`mtp`: a checkpoint's `mtp.*` tensors, written as the converter writes them (one block more, `nextn`)."""
    import types

    c = hf.config
    written = types.SimpleNamespace(**{**c.to_dict(), "num_hidden_layers": c.num_hidden_layers + bool(mtp)})
    writer = gguf_writer(path, "qwen3next", written, c.rope_parameters["rope_theta"], c.num_experts,
                         c.moe_intermediate_size)
    if mtp:
        writer.add_uint32("qwen3next.nextn_predict_layers", 1)
    writer.add_rope_dimension_count(int(c.head_dim * c.rope_parameters["partial_rotary_factor"]))
    writer.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    writer.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    writer.add_ssm_state_size(c.linear_key_head_dim)
    writer.add_ssm_group_count(c.linear_num_key_heads)
    writer.add_ssm_time_step_rank(c.linear_num_value_heads)
    writer.add_ssm_inner_size(c.linear_value_head_dim * c.linear_num_value_heads)
    writer.add_full_attention_interval(2)
    add_gguf_vocabulary(writer)
    # matrices whose inputs fill Q8_0's blocks; the router, vectors and the convolution stay float
    add_gguf_tensors(writer, gguf_tensors(hf, mtp), blocks, lambda name, values: values.ndim >= 2 and
                     values.shape[-1] % 32 == 0 and "ffn_gate_inp" not in name and "conv1d" not in name)
    finish_gguf(writer)


@pytest.mark.parametrize("blocks", [None, "Q8_0"])
@torch.no_grad()
def test_a_gguf_runs_as_stored(tmp_path, monkeypatch, blocks):
    from specdecode.weights.quantize import QuantLinear

    hf = gguf_hf()
    model, tokenizer = load_gguf_as_stored(tmp_path, monkeypatch, "tiny-qwen3-next.gguf", hf,
                                           lambda path, hf: write_next_gguf(path, hf, blocks))
    assert isinstance(model, Transformer) and tokenizer is not None
    c = model.config
    assert c.linear_layers == (0, 2) and c.moe_layers == (0, 1, 2, 3) and c.rotary_dim == 4
    qkvz = model.model.layers[0].linear_attn.in_proj_qkvz
    assert isinstance(qkvz, QuantLinear) == (blocks is not None)  # the two parts' blocks gathered, not re-rounded
    ids = torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(5))
    out, _ = model(ids, torch.arange(12)[None], model.new_cache(1, 16), chain_mask(0, 12), decode=True)
    ref = hf(ids).logits
    # float matrices: float arithmetic (A_log back from -exp(A_log): a last bit); blocks: Q8_0's weights and the
    # kernels' 8-bit activations
    assert torch.allclose(out, ref, atol=1e-4 if blocks is None else 0.05), (out - ref).abs().max()
    if blocks is not None:
        reference = run(Engine(model, NoDrafter()), PROMPT)
        for name in ("lookahead", "ngram-tree", "self-draft-tree"):
            drafter = drafters(model, model)[name]
            assert run(Engine(model, drafter, num_draft_tokens=4), PROMPT) == reference, name


@torch.no_grad()
def test_a_gguf_runs_in_float(tmp_path, monkeypatch):
    """--weights float on a Qwen3-Next GGUF (transformers refuses its architecture): our reader's tensors."""
    from specdecode.weights import hub
    from specdecode.weights.loading import load_model

    monkeypatch.setattr(hub, "cache_dir", lambda: tmp_path)
    hf = gguf_hf()
    path = tmp_path / "tiny-qwen3-next.gguf"
    write_next_gguf(path, hf)
    model, _ = load_model(str(path), torch.float32, weights="float")
    ids = torch.randint(3, 64, (1, 10), generator=torch.Generator().manual_seed(6))
    out, _ = model(ids, torch.arange(10)[None], model.new_cache(1, 16), chain_mask(0, 10), decode=True)
    assert torch.allclose(out, hf(ids).logits, atol=1e-4)
