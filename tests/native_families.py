"""What every family's native-model test checks the same way (tests/test_<family>_native.py): a tiny random
transformers model loaded into the native Transformer, a tree forward against each of its paths run alone, every
method's greedy output against plain decoding's, and an HF folder loading natively. Each family's file keeps what
is its own (its config, its parity details, its GGUF layout)."""

from __future__ import annotations

import torch

from specdecode.config import ModelConfig, SamplingParams
from specdecode.drafters import DraftModelDrafter, NgramDrafter, NoDrafter
from specdecode.drafters.lookahead import LookaheadDrafter
from specdecode.drafters.recycle import RecycleDrafter
from specdecode.engine.engine import Engine
from specdecode.models.masks import chain_mask, depths, tree_mask
from specdecode.models.model import Transformer
from specdecode.weights.quantize import quantize_

PROMPT = [1, 2, 3, 4, 5, 6, 1, 2, 3, 9, 9, 1, 2]  # repeats, so that the copying drafters find something
VOCAB = 64  # every family's tiny config


def native(hf) -> Transformer:
    """The transformers model's weights in the native model, every tensor used and none missing."""
    model = Transformer(ModelConfig.from_hf(hf.config.to_dict()))
    missing, unexpected = model.load_state_dict(hf.state_dict(), strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return model.eval()


def run(engine: Engine, prompt: list[int], max_new: int = 30) -> list[int]:
    return [t for step in engine.generate(prompt, SamplingParams(max_new_tokens=max_new)) for t in step.tokens]


def drafters(target, draft) -> dict:
    """One of each drafter shape: copying chains and trees, lookahead, a draft model's chain and tree, a self-draft."""
    return {
        "ngram": NgramDrafter(),
        "ngram-tree": NgramDrafter(branches=4),
        "recycle": RecycleDrafter(VOCAB),
        "lookahead": LookaheadDrafter(),
        "draft-model": DraftModelDrafter(draft, vocab_size=VOCAB),
        "draft-model-tree": DraftModelDrafter(draft, vocab_size=VOCAB, width=3),
        "self-draft-tree": DraftModelDrafter(target, vocab_size=VOCAB, width=2),
    }


@torch.no_grad()
def check_tree_forward(model: Transformer, atol: float = 1e-5) -> None:
    """A tree verified in one forward (masked and as decode rows) gives each node the logits of its path run alone;
    the paths go deeper than a window of 4, where the family has windows."""
    prefix = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(3))
    root, nodes = 7, torch.tensor([10, 11, 12, 13, 14, 15, 16])
    parents = torch.tensor([-1, -1, 0, 0, 2, 4, 5])  # 0 -> 2 -> 4 -> 5 -> 6 is five deep
    ids = torch.cat((torch.tensor([root]), nodes))[None]
    positions = (6 + torch.cat((torch.zeros(1, dtype=torch.long), depths(parents))))[None]
    for decode in (False, True):
        cache = model.new_cache(1, 32)
        model(prefix, torch.arange(6)[None], cache, chain_mask(0, 6), decode=decode)
        cache.truncate(6)
        tree_logits, _ = model(ids, positions, cache, tree_mask(6, parents), decode=decode)
        for node, path in {6: [0, 2, 4, 5, 6], 3: [0, 3], 1: [1]}.items():
            seq = torch.cat((prefix[0], torch.tensor([root]), nodes[path]))[None]
            solo, _ = model(seq, torch.arange(seq.shape[1])[None], model.new_cache(1, 32),
                            chain_mask(0, seq.shape[1]))
            assert torch.allclose(tree_logits[0, node + 1], solo[0, -1], atol=atol), (decode, node)


def check_every_method(target: Transformer, draft: Transformer, form: str) -> None:
    """Every drafter, drafting 1 and 4 tokens a step, gives plain decoding's tokens. `form`: "python" (torch
    layers), "kernels" (the linear layers on the CPU kernels, as a loaded model runs them) or "kernels-bf16-kv"."""
    if form != "python":
        quantize_(target, "none")
        quantize_(draft, "none")
    if form == "kernels-bf16-kv":
        target.kv_dtype = draft.kv_dtype = torch.bfloat16
    reference = run(Engine(target, NoDrafter()), PROMPT)
    for k in (1, 4):
        for name, drafter in drafters(target, draft).items():
            assert run(Engine(target, drafter, num_draft_tokens=k), PROMPT) == reference, (form, name, k)


@torch.no_grad()
def check_hf_folder_loads_natively(hf, folder) -> None:
    """The model saved as an HF folder loads as the native model, with transformers' logits."""
    from specdecode.weights.loading import load_model

    hf.save_pretrained(folder)
    model, _ = load_model(str(folder), torch.float32)
    assert isinstance(model, Transformer)
    ids = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(4))
    out, _ = model(ids, torch.arange(12)[None], model.new_cache(1, 16), chain_mask(0, 12), decode=True)
    assert torch.allclose(out, hf(ids).logits, atol=1e-5)


@torch.no_grad()
def check_verify_rows(model: Transformer, form: str) -> None:
    """k rows in one forward against each row alone after the same prefix: the same argmax; on the kernels (`form`
    "none" or a block type, as quantize_ takes it) the same bits, whatever rows share the forward."""
    if form != "python":
        quantize_(model, form)
    prefix = torch.randint(0, VOCAB, (1, 6), generator=torch.Generator().manual_seed(2))
    rows = torch.randint(0, VOCAB, (1, 8), generator=torch.Generator().manual_seed(3))
    cache = model.new_cache(1, 32)
    model(prefix, torch.arange(6)[None], cache, chain_mask(0, 6), decode=True)
    cache.truncate(6)
    together, _ = model(rows, torch.arange(6, 14)[None], cache, chain_mask(6, 8), decode=True)
    alone = []
    for j in range(8):
        out, _ = model(rows[:, j : j + 1], torch.tensor([[6 + j]]), cache, chain_mask(6 + j, 1), decode=True)
        cache.truncate(7 + j)
        alone.append(out)
    alone = torch.cat(alone, dim=1)
    assert torch.equal(together.argmax(-1), alone.argmax(-1))
    if form != "python":
        assert torch.equal(together, alone)
    else:
        assert torch.allclose(together, alone, atol=1e-5)


@torch.no_grad()
def check_greedy_equals_transformers(hf, new_tokens: int = 20) -> None:
    """Plain decoding on the native model gives transformers' own greedy tokens."""
    prompt = torch.tensor([PROMPT])
    ref = hf.generate(prompt, max_new_tokens=new_tokens, do_sample=False, min_new_tokens=new_tokens)
    assert run(Engine(native(hf), NoDrafter()), PROMPT, max_new=new_tokens) == ref[0, len(PROMPT) :].tolist()


# --- GGUF files written with gguf-py for the families' as-stored tests ---

GGUF_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "\u2581"] + [chr(c) for c in range(33, 92)]  # VOCAB tokens


def add_gguf_vocabulary(writer) -> None:
    """A sentencepiece-style vocabulary of VOCAB tokens (pad, eos, bos, unk, then characters) on a GGUFWriter."""
    writer.add_tokenizer_model("llama")
    writer.add_token_list(GGUF_TOKENS)
    writer.add_token_scores([0.0] * len(GGUF_TOKENS))
    writer.add_token_types([3, 3, 3, 2] + [1] * (len(GGUF_TOKENS) - 4))
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)


def gguf_writer(path, architecture: str, c, rope_theta: float, experts: int = 0, expert_width: int = 0):
    """A GGUFWriter for `architecture` with the keys every family writes from its transformers config `c`
    (layers, widths, heads, rope base, norm epsilon; expert count and width where given)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    if experts:
        writer.add_expert_feed_forward_length(expert_width)
        writer.add_expert_count(experts)
        writer.add_expert_used_count(c.num_experts_per_tok)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    return writer


def add_gguf_tensors(writer, tensors: dict, blocks: str | None, in_blocks) -> None:
    """Each of `tensors` (llama.cpp's names -> float arrays) on a GGUFWriter: in `blocks` where `in_blocks(name,
    values)` says so (a family keeps its router, vectors and the like float, as llama.cpp's quantizer does), else
    float32."""
    import gguf
    import numpy as np

    for name, values in tensors.items():
        values = np.ascontiguousarray(values)
        if blocks is not None and in_blocks(name, values):
            kind = gguf.GGMLQuantizationType[blocks]
            writer.add_tensor(name, gguf.quants.quantize(values, kind), raw_dtype=kind)
        else:
            writer.add_tensor(name, values)


def load_gguf_as_stored(tmp_path, monkeypatch, name: str, hf, write):
    """`write(path, hf)` a GGUF in tmp_path, then load it as stored (its unpacked folder in tmp_path too) -> (the
    native model, its tokenizer); skips where the CPU kernels do not build."""
    import pytest

    from specdecode.kernels import cpu_kernels
    from specdecode.weights import hub
    from specdecode.weights.loading import load_model

    if cpu_kernels() is None:
        pytest.skip("weights as stored run on the CPU kernels")
    monkeypatch.setattr(hub, "cache_dir", lambda: tmp_path)  # the unpacked folder
    path = tmp_path / name
    write(path, hf)
    return load_model(str(path), torch.float32, weights="stored")


def finish_gguf(writer) -> None:
    """Write the header, the metadata and the tensors added to a GGUFWriter, and close the file."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@torch.no_grad()
def check_logits_past_the_window(hf, atol: float = 1e-5) -> None:
    """transformers' logits over 16 tokens (past a window of 4) from the native model three ways: one masked
    forward, rows one at a time as the engine runs them, and cached in pieces that straddle the window."""
    model = native(hf)
    ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    ref = hf(ids).logits
    for decode in (False, True):
        out, _ = model(ids, torch.arange(16)[None], model.new_cache(1, 32), chain_mask(0, 16), decode=decode)
        assert torch.allclose(out, ref, atol=atol), (decode, (out - ref).abs().max())
    cache, pieces = model.new_cache(1, 32), []
    for start, end in [(0, 3), (3, 4), (4, 9), (9, 16)]:
        out, _ = model(ids[:, start:end], torch.arange(start, end)[None], cache, chain_mask(start, end - start),
                       decode=True)
        cache.truncate(end)
        pieces.append(out)
    assert torch.allclose(torch.cat(pieces, dim=1), ref, atol=atol)
