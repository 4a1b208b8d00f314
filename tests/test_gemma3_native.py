"""Gemma 3 on the native model: parity with transformers' Gemma3ForCausalLM on a tiny random config (sliding-window
layers alternating with global ones, a window shorter than the prompt), and every method's greedy output equal to
plain decoding, tree methods included."""

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
    finish_gguf,
    gguf_writer,
    native,
    run,
)

from specdecode.config import ModelConfig, runs_natively
from specdecode.drafters import DraftModelDrafter, NgramDrafter, NoDrafter
from specdecode.drafters.lookahead import LookaheadDrafter
from specdecode.engine.engine import Engine
from specdecode.models.masks import chain_mask
from specdecode.models.model import Transformer

WINDOW = 4


def gemma_hf(seed: int = 0, kv_heads: int = 2, **overrides):
    """A tiny Gemma3ForCausalLM: head_dim apart from hidden / heads, a query scale apart from head_dim, local
    layers 0 and 2 with their own rope theta, norm weights random (their init, zeros, hides the 1 + w)."""
    import transformers

    kwargs = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=kv_heads, head_dim=16, sliding_window=WINDOW, sliding_window_pattern=2,
                  query_pre_attn_scalar=12, rope_theta=100_000.0, rope_local_base_freq=10_000.0,
                  max_position_embeddings=256, eos_token_id=None, pad_token_id=0, bos_token_id=None)
    config = transformers.Gemma3TextConfig(**dict(kwargs, **overrides))
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.5)
    return model


def test_config_flags_and_routing():
    hf = gemma_hf()
    config = ModelConfig.from_hf(hf.config.to_dict())
    assert type(hf).__name__ == "Gemma3ForCausalLM" and runs_natively(hf.config.to_dict())
    assert config.local_layers == (0, 2) and config.sliding_window == WINDOW and config.head_dim == 16
    assert (config.rope_theta, config.rope_local_theta) == (100_000.0, 10_000.0)
    assert config.tie_word_embeddings and config.qk_norm and not config.llama_layers
    assert not runs_natively(gemma_hf(attn_logit_softcapping=50.0).config.to_dict())  # through transformers


@pytest.mark.parametrize("kv_heads", [1, 2])  # 1: the windowed rows on the native kernel; 2: through torch
@pytest.mark.parametrize("softcap", [None, 5.0])
def test_logits_match_transformers_past_the_window(kv_heads, softcap):
    check_logits_past_the_window(gemma_hf(kv_heads=kv_heads, final_logit_softcapping=softcap))


def test_greedy_tokens_equal_transformers():
    check_greedy_equals_transformers(gemma_hf())


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_tree_forward_sees_each_paths_window(kv_heads):
    check_tree_forward(native(gemma_hf(kv_heads=kv_heads)))


@pytest.mark.parametrize("form", ["python", "kernels", "kernels-bf16-kv"])
def test_every_method_gives_plain_decodings_tokens(form):
    check_every_method(native(gemma_hf(kv_heads=1)), native(gemma_hf(seed=1)), form)


def test_an_hf_folder_loads_natively(tmp_path):
    check_hf_folder_loads_natively(gemma_hf(), tmp_path)


# --- a GGUF written with gguf-py, as llama.cpp's converter writes Gemma 3: norms stored as 1 + w ---



def write_gemma_gguf(path, hf, blocks: str | None = None) -> None:
    import gguf
    import numpy as np

    c = hf.config
    writer = gguf_writer(path, "gemma3", c, c.rope_parameters["full_attention"]["rope_theta"])
    writer.add_sliding_window(c.sliding_window)
    add_gguf_vocabulary(writer)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GEMMA3, c.num_hidden_layers)
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied: no output.weight
        base, suffix = name.rsplit(".", 1)
        values = tensor.numpy().astype(np.float32)
        if "norm" in name:
            values = values + 1  # llama.cpp's converter adds Gemma's 1
        if blocks is not None and values.ndim == 2:
            kind = gguf.GGMLQuantizationType[blocks]
            writer.add_tensor(f"{names.get_name(base)}.{suffix}", gguf.quants.quantize(values, kind), raw_dtype=kind)
        else:
            writer.add_tensor(f"{names.get_name(base)}.{suffix}", values)
    finish_gguf(writer)


def gguf_gemma_hf():
    """Six layers: the fifth of each six is global in a GGUF (no pattern in its metadata, as llama.cpp's); head_dim
    256, where transformers' reading of a GGUF (query_pre_attn_scalar 256) and llama.cpp's (head_dim) agree."""
    return gemma_hf(num_hidden_layers=6, head_dim=256, kv_heads=1, query_pre_attn_scalar=256,
                    sliding_window_pattern=6, rope_theta=1_000_000.0)


@pytest.mark.parametrize("blocks", [None, "Q8_0"])
@torch.no_grad()
def test_a_gguf_runs_as_stored(tmp_path, monkeypatch, blocks):
    import gguf
    import numpy as np

    from specdecode.kernels import cpu_kernels
    from specdecode.weights import hub
    from specdecode.weights.loading import load_model
    from specdecode.weights.quantize import QuantLinear

    if cpu_kernels() is None:
        pytest.skip("weights as stored run on the CPU kernels")
    monkeypatch.setattr(hub, "cache_dir", lambda: tmp_path)  # the unpacked folder
    hf = gguf_gemma_hf()
    path = tmp_path / "tiny-gemma3.gguf"
    write_gemma_gguf(path, hf, blocks)
    if blocks is not None:  # the reference on the weights the file holds
        kind = gguf.GGMLQuantizationType[blocks]
        for p in hf.parameters():
            if p.dim() == 2:
                held = gguf.quants.dequantize(gguf.quants.quantize(p.numpy(), kind), kind)
                p.copy_(torch.from_numpy(np.array(held)))
    model, tokenizer = load_model(str(path), torch.float32, weights="stored")
    assert isinstance(model, Transformer) and not model.config.norm_unit_offset  # the file's 1 + w, as stored
    assert model.config.local_layers == (0, 1, 2, 3, 4) and tokenizer is not None
    assert (blocks is not None) == isinstance(model.model.layers[0].mlp.up_proj, QuantLinear)
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
