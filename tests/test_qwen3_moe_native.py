"""Qwen3-MoE on the native model: parity with transformers' Qwen3MoeForCausalLM on a tiny random config (expert
layers beside a dense one), each verify row computed as its own one-token forward whatever rows share the forward,
and every method's greedy output equal to plain decoding, tree methods included."""

import numpy as np
import pytest
import torch
from native_families import (
    PROMPT,
    add_gguf_tensors,
    add_gguf_vocabulary,
    check_every_method,
    check_greedy_equals_transformers,
    check_hf_folder_loads_natively,
    check_tree_forward,
    check_verify_rows,
    finish_gguf,
    gguf_writer,
    load_gguf_as_stored,
    native,
    run,
)

from specdecode.config import ModelConfig, runs_natively
from specdecode.drafters import DraftModelDrafter, NgramDrafter, NoDrafter
from specdecode.drafters.lookahead import LookaheadDrafter
from specdecode.engine.engine import Engine
from specdecode.models.experts import SparseMoE, expert_groups
from specdecode.models.masks import chain_mask
from specdecode.models.model import Transformer
from specdecode.weights.quantize import quantize_


def moe_hf(seed: int = 0, **overrides):
    """A tiny Qwen3MoeForCausalLM: 8 experts, 2 a token, layer 1 dense (mlp_only_layers), norms random."""
    import transformers

    kwargs = dict(vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                  decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True, max_position_embeddings=256,
                  eos_token_id=None, pad_token_id=0, bos_token_id=None)
    config = transformers.Qwen3MoeConfig(**dict(kwargs, **overrides))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1, 0.3)
            elif name.endswith("gate.weight"):  # the router: spread its logits, so routes differ between tokens
                p.normal_(0, 0.5)
    return model


def test_config_flags_and_routing():
    hf = moe_hf()
    config = ModelConfig.from_hf(hf.config.to_dict())
    assert type(hf).__name__ == "Qwen3MoeForCausalLM" and runs_natively(hf.config.to_dict())
    assert config.moe_layers == (0, 2) and config.num_experts == 8 and config.num_experts_per_tok == 2
    assert config.moe_intermediate_size == 16 and config.norm_topk_prob and config.qk_norm
    assert not config.llama_layers  # the native decode stack is the dense layer's
    assert ModelConfig.from_hf(moe_hf(decoder_sparse_step=2, mlp_only_layers=[]).config.to_dict()).moe_layers == (1,)
    model = native(hf)
    assert isinstance(model.model.layers[0].mlp, SparseMoE) and not isinstance(model.model.layers[1].mlp, SparseMoE)


def test_expert_groups_in_ascending_order():
    assert expert_groups([[3, 1], [1, 0]]) == [(0, [1], [1]), (1, [0, 1], [1, 0]), (3, [0], [0])]


@torch.no_grad()
def test_every_expert_path_gives_the_routed_sum():
    """The path a CUDA graph captures (no host read of the routes) against the routed one."""
    moe = native(moe_hf()).model.layers[0].mlp
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(1))
    weights, chosen = moe.route(x)
    assert len({e for row in chosen.tolist() for e in row}) > 2  # the rows do not all read the same experts
    assert torch.allclose(moe.every_expert(x, weights, chosen), moe(x), atol=1e-6)


def test_blocks_leave_the_router_in_float():
    from specdecode.weights.quantize import KernelLinear, QuantLinear

    model = quantize_(native(moe_hf(moe_intermediate_size=32)), "q8_0")
    moe = model.model.layers[2].mlp
    if not isinstance(model.lm_head, QuantLinear):
        pytest.skip("blocks run on the CPU kernels")
    assert isinstance(moe.gate, KernelLinear) and isinstance(moe.experts[7].down_proj, QuantLinear)


@pytest.mark.parametrize("norm_topk_prob", [True, False])
@torch.no_grad()
def test_logits_match_transformers(norm_topk_prob):
    hf = moe_hf(norm_topk_prob=norm_topk_prob)
    model = native(hf)
    ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(0))
    ref = hf(ids).logits
    for decode in (False, True):
        out, _ = model(ids, torch.arange(16)[None], model.new_cache(1, 32), chain_mask(0, 16), decode=decode)
        assert torch.allclose(out, ref, atol=1e-5), (decode, (out - ref).abs().max())
    cache, pieces = model.new_cache(1, 32), []
    for start, end in [(0, 3), (3, 4), (4, 9), (9, 16)]:
        out, _ = model(ids[:, start:end], torch.arange(start, end)[None], cache, chain_mask(start, end - start),
                       decode=True)
        cache.truncate(end)
        pieces.append(out)
    assert torch.allclose(torch.cat(pieces, dim=1), ref, atol=1e-5)


def test_greedy_tokens_equal_transformers():
    check_greedy_equals_transformers(moe_hf())


@pytest.mark.parametrize("form", ["python", "none", "q8_0"])
def test_verify_rows_equal_one_row_at_a_time(form):
    """k rows in one forward (experts grouped across them) against each row alone: the same argmax; on the
    kernels (float or blocks) the same bits."""
    check_verify_rows(native(moe_hf(moe_intermediate_size=32)), form)


def test_tree_forward_equals_each_path():
    check_tree_forward(native(moe_hf()))


@pytest.mark.parametrize("form", ["python", "kernels", "kernels-bf16-kv"])
def test_every_method_gives_plain_decodings_tokens(form):
    check_every_method(native(moe_hf()), native(moe_hf(seed=1)), form)


def test_an_hf_folder_loads_natively(tmp_path):
    check_hf_folder_loads_natively(moe_hf(), tmp_path)


# --- a GGUF written with gguf-py, as llama.cpp's converter writes Qwen3-MoE: 3-D expert tensors, a float router ---



def gguf_moe_hf():
    """Every layer with experts (llama.cpp's qwen3moe has no dense layers); matrices whose inputs fill Q8_0's
    32-weight blocks."""
    return moe_hf(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, mlp_only_layers=[])


def gguf_tensors(hf) -> dict[str, np.ndarray]:
    """The model's tensors under llama.cpp's names, each expert tensor [experts, out, in] as the converter stacks
    them."""
    c, sd = hf.config, {k: v.numpy().astype(np.float32) for k, v in hf.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
           "output.weight": sd["lm_head.weight"]}
    for i in range(c.num_hidden_layers):
        layer = f"model.layers.{i}."
        half = sd[layer + "mlp.experts.gate_up_proj"].shape[1] // 2
        out.update({
            f"blk.{i}.attn_norm.weight": sd[layer + "input_layernorm.weight"],
            f"blk.{i}.ffn_norm.weight": sd[layer + "post_attention_layernorm.weight"],
            f"blk.{i}.attn_q.weight": sd[layer + "self_attn.q_proj.weight"],
            f"blk.{i}.attn_k.weight": sd[layer + "self_attn.k_proj.weight"],
            f"blk.{i}.attn_v.weight": sd[layer + "self_attn.v_proj.weight"],
            f"blk.{i}.attn_output.weight": sd[layer + "self_attn.o_proj.weight"],
            f"blk.{i}.attn_q_norm.weight": sd[layer + "self_attn.q_norm.weight"],
            f"blk.{i}.attn_k_norm.weight": sd[layer + "self_attn.k_norm.weight"],
            f"blk.{i}.ffn_gate_inp.weight": sd[layer + "mlp.gate.weight"],
            f"blk.{i}.ffn_gate_exps.weight": sd[layer + "mlp.experts.gate_up_proj"][:, :half],
            f"blk.{i}.ffn_up_exps.weight": sd[layer + "mlp.experts.gate_up_proj"][:, half:],
            f"blk.{i}.ffn_down_exps.weight": sd[layer + "mlp.experts.down_proj"],
        })  # fmt: skip
    return out


def write_moe_gguf(path, hf, blocks: str | None = None) -> None:

    c = hf.config
    writer = gguf_writer(path, "qwen3moe", c, c.rope_parameters["rope_theta"], c.num_experts, c.moe_intermediate_size)
    add_gguf_vocabulary(writer)
    # the router stays float, as llama.cpp's quantizer keeps it
    add_gguf_tensors(writer, gguf_tensors(hf), blocks,
                     lambda name, values: values.ndim >= 2 and "ffn_gate_inp" not in name)
    finish_gguf(writer)


@pytest.mark.parametrize("blocks", [None, "Q8_0"])
@torch.no_grad()
def test_a_gguf_runs_as_stored(tmp_path, monkeypatch, blocks):
    import gguf

    from specdecode.weights.quantize import KernelLinear, QuantLinear

    hf = gguf_moe_hf()
    model, tokenizer = load_gguf_as_stored(tmp_path, monkeypatch, "tiny-qwen3moe.gguf", hf,
                                           lambda path, hf: write_moe_gguf(path, hf, blocks))
    if blocks is not None:  # the reference on the weights the file holds (blocks run along each matrix's rows)
        kind = gguf.GGMLQuantizationType[blocks]
        for name, p in hf.named_parameters():
            if p.dim() >= 2 and not name.endswith("mlp.gate.weight"):
                held = gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), kind), kind)
                p.copy_(torch.from_numpy(np.array(held)).reshape(p.shape))
    assert isinstance(model, Transformer) and tokenizer is not None
    assert model.config.moe_layers == (0, 1, 2) and model.config.moe_intermediate_size == 32
    moe = model.model.layers[0].mlp
    assert isinstance(moe, SparseMoE) and isinstance(moe.gate, KernelLinear)  # the router in float
    assert (blocks is not None) == isinstance(moe.experts[5].down_proj, QuantLinear)  # one block matrix an expert
    ids = torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(5))
    out, _ = model(ids, torch.arange(12)[None], model.new_cache(1, 16), chain_mask(0, 12), decode=True)
    ref = hf(ids).logits
    # float matrices: float arithmetic; blocks: the integer kernels round activations to 8 bits, as llama.cpp does
    assert torch.allclose(out, ref, atol=1e-4 if blocks is None else 0.05), (out - ref).abs().max()
    if blocks is not None:
        reference = run(Engine(model, NoDrafter()), PROMPT)
        for name, drafter in {"lookahead": LookaheadDrafter(), "ngram-tree": NgramDrafter(branches=4),
                              "self-draft-tree": DraftModelDrafter(model, vocab_size=64, width=2)}.items():
            assert run(Engine(model, drafter, num_draft_tokens=4), PROMPT) == reference, name


@torch.no_grad()
def test_a_gguf_runs_in_float(tmp_path, monkeypatch):
    """--weights float: the file de-quantized through transformers' reader (the expert width read from the file,
    where transformers reads none), then the native model."""
    from specdecode.weights import hub
    from specdecode.weights.loading import load_model

    monkeypatch.setattr(hub, "cache_dir", lambda: tmp_path)
    hf = gguf_moe_hf()
    path = tmp_path / "tiny-qwen3moe.gguf"
    write_moe_gguf(path, hf)
    model, _ = load_model(str(path), torch.float32, weights="float")
    assert isinstance(model, Transformer) and model.config.moe_intermediate_size == 32
    ids = torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(6))
    out, _ = model(ids, torch.arange(12)[None], model.new_cache(1, 16), chain_mask(0, 12), decode=True)
    assert torch.allclose(out, hf(ids).logits, atol=1e-4)
