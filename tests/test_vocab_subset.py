"""The draft's LM head restricted to frequent tokens: which ids are chosen, how they are counted and cached, and
that the restricted head's logits are the full head's at those ids (float, float kernel, and blocks)."""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from test_blocks import packed as random_packed
from tiny import tiny_native

from specdecode.errors import SpecdecodeError
from specdecode.kernels import cpu_kernels
from specdecode.models.masks import chain_mask
from specdecode.weights.blocks import FORMATS, quantize_float
from specdecode.weights.gguf_stored import PACKED_FIELDS, stored_dir
from specdecode.weights.quantize import KernelLinear, QuantLinear, quantize_
from specdecode.weights.vocab_subset import (
    by_merge_rank,
    count_tokens,
    frequent_tokens,
    load_or_build,
    restrict_lm_head,
    stored_head,  # fmt: skip
    subset_path,
    texts_from_jsonl,
)

kernels = cpu_kernels()
needs_kernel = pytest.mark.skipif(kernels is None, reason="the native CPU kernel needs AVX2, FMA and a C++ compiler")
WIDE = dict(hidden_size=256, intermediate_size=512)  # whole Q4_K superblocks along every input dimension
TOKENS = torch.tensor([[5, 9, 2, 7, 1, 3]])


def logits_of(model) -> torch.Tensor:
    with torch.inference_mode():
        cache = model.new_cache(1, 16)
        logits, _ = model(TOKENS, torch.arange(6)[None], cache, chain_mask(0, 6), decode=True)
    return logits  # [1, 6, vocab or subset]


def test_frequent_tokens_rank_by_count_then_id():
    counts = torch.tensor([5, 9, 9, 0, 7, 1, 9, 2])
    assert frequent_tokens(counts, 3, multiple=1).tolist() == [1, 2, 6]  # the three 9s
    assert frequent_tokens(counts, 2, multiple=1).tolist() == [1, 2]  # tie: lower ids first
    assert frequent_tokens(counts, 4, always=[3, 1], multiple=1).tolist() == [1, 2, 3, 4, 6]
    assert frequent_tokens(counts, 0, always=[7, 7], multiple=1).tolist() == [7]
    assert frequent_tokens(counts, 3).dtype == torch.int64


def test_subsets_are_padded_with_the_next_most_frequent_ids():
    counts = torch.tensor([5, 9, 9, 0, 7, 1, 9, 2])
    assert frequent_tokens(counts, 3, multiple=4).tolist() == [1, 2, 4, 6]  # 7 comes next
    assert frequent_tokens(counts, 3, always=[4], multiple=4).tolist() == [1, 2, 4, 6]  # already whole
    ids = frequent_tokens(counts, 3, always=[3], multiple=3)  # {1, 2, 6, 3} + 4 (7) and 0 (5)
    assert ids.tolist() == [0, 1, 2, 3, 4, 6]
    assert frequent_tokens(counts, 7, multiple=16).tolist() == list(range(8))  # never more than the vocabulary
    assert by_merge_rank(1000, 100, always=[999]).numel() == 112


def test_merge_rank_takes_the_lowest_ids():
    assert by_merge_rank(10, 3, always=[9], multiple=1).tolist() == [0, 1, 2, 9]
    assert by_merge_rank(10, 3, always=[9], multiple=3).tolist() == [0, 1, 2, 3, 4, 9]
    with pytest.raises(ValueError):
        by_merge_rank(10, 3, always=[10])


class WordTokenizer:
    """A fake Hugging Face tokenizer: one id per whitespace word, from a fixed table."""

    vocab = {"a": 0, "b": 1, "c": 2, "d": 3}

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, texts, add_special_tokens=True):
        assert isinstance(texts, list) and add_special_tokens is False
        self.calls += 1
        return {"input_ids": [[self.vocab[w] for w in text.split()] for text in texts]}


def test_count_tokens_in_batches():
    tokenizer = WordTokenizer()
    texts = ["a b b", "", "c b", "a", "b"]
    counts = count_tokens(tokenizer, iter(texts), vocab_size=6, batch_size=2, progress=False)
    assert counts.tolist() == [2, 4, 1, 0, 0, 0] and counts.dtype == torch.int64
    assert tokenizer.calls == 3
    with pytest.raises(ValueError):
        count_tokens(tokenizer, ["d"], vocab_size=3, progress=False)


def test_texts_from_jsonl_walks_every_string(tmp_path):
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "n": 3}
    alpaca = {"instruction": "add", "input": "", "output": "2", "tags": [["x"], {"y": "z"}]}
    first, second = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    first.write_text(json.dumps(chat) + "\n\n")
    second.write_text(json.dumps(alpaca) + "\n" + json.dumps(chat) + "\n")
    texts = list(texts_from_jsonl([first, second]))
    assert texts == ["user", "hi", "assistant", "yo", "add", "", "2", "x", "z", "user", "hi", "assistant", "yo"]
    assert list(texts_from_jsonl([first, second], limit=2)) == texts[:9]


@pytest.mark.parametrize("suffix", [".pt", ".npy"])
def test_subset_cache_round_trip(tmp_path, monkeypatch, suffix):
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path / "cache"))
    model_file = tmp_path / "draft.gguf"
    model_file.write_bytes(b"GGUF")
    path = subset_path(model_file, 32, "code+chat/v1").with_suffix(suffix)
    assert path.parent == tmp_path / "cache" / "converted" and "draft-" in path.name and "/" not in path.name
    built = []
    ids = load_or_build(path, lambda: built.append(1) or torch.tensor([3, 1, 4]))
    again = load_or_build(path, lambda: built.append(1) or torch.tensor([0]))
    assert built == [1] and ids.tolist() == again.tolist() == [3, 1, 4] and again.dtype == torch.int64
    assert subset_path(model_file, 64, "code+chat/v1") != subset_path(model_file, 32, "code+chat/v1")


@pytest.mark.parametrize("tied", [False, True])
def test_float_head_logits_match_the_full_heads_at_those_ids(tied):
    model = tiny_native("qwen2", seed=0, tie_word_embeddings=tied)
    embedding = model.model.embed_tokens.weight.detach().clone()
    full = logits_of(model)
    ids = torch.tensor([0, 3, 7, 8, 20, 33, 63])
    head_tokens = restrict_lm_head(model, ids)
    assert isinstance(model.lm_head, torch.nn.Linear) and head_tokens.tolist() == ids.tolist()
    # PyTorch's own GEMM blocks by output width, so the last bit may differ; the native kernel below is exact.
    assert torch.allclose(logits_of(model), full[..., ids], atol=1e-6, rtol=1e-5)
    assert torch.equal(model.model.embed_tokens.weight, embedding)  # the tied embedding keeps every row
    with pytest.raises(SpecdecodeError):
        restrict_lm_head(model, ids)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_head_logits_equal_the_full_heads_at_those_ids(dtype):
    model = quantize_(tiny_native("qwen2", seed=0, dtype=dtype, tie_word_embeddings=True), "none")
    full = logits_of(model)
    ids = by_merge_rank(64, 20, always=[63])
    restrict_lm_head(model, ids)
    assert isinstance(model.lm_head, KernelLinear) and ids.numel() == 32
    assert torch.equal(logits_of(model), full[..., ids])


@needs_kernel
@pytest.mark.parametrize("mode", ["q8_0", "q4_k"])
@pytest.mark.parametrize("size", [32, 20])  # 32: the 16-channel kernel for both heads; 20: the row kernel
def test_block_head_logits_equal_the_full_heads_at_those_ids(mode, size):
    model = quantize_(tiny_native("qwen2", seed=0, **WIDE), mode)
    full = logits_of(model)
    stored = quantize_float(tiny_native("qwen2", seed=0, **WIDE).lm_head.weight, mode)  # what quantize_ wrote
    ids = torch.randperm(64, generator=torch.Generator().manual_seed(size))[:size]
    if model.lm_head.packed is None:  # repacked to 16 channels: the rows must come from the stored blocks
        with pytest.raises(SpecdecodeError):
            restrict_lm_head(model, ids)
    restrict_lm_head(model, ids, stored=stored)
    assert isinstance(model.lm_head, QuantLinear) and model.lm_head.format.name == mode
    same_kernel = size % 16 == 0
    check = torch.equal if same_kernel else lambda a, b: torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    assert check(logits_of(model), full[..., ids])


@needs_kernel
@pytest.mark.parametrize("type_name", [name.upper() for name in FORMATS])
def test_restricted_gguf_blocks_compute_the_same_rows(type_name):
    packed = random_packed(type_name, out=64, inp=512)
    full_head = QuantLinear(packed, None, kernels, keep_rows=True)
    model = torch.nn.Module()
    model.lm_head, model.device, model.config = full_head, torch.device("cpu"), SimpleNamespace(vocab_size=64)
    x = torch.randn(3, 512)
    ids = torch.tensor([1, 2, 5, 8, 13, 21, 34, 55, 0, 3, 4, 6, 7, 9, 10, 63])
    restrict_lm_head(model, ids)
    assert torch.equal(model.lm_head(x), full_head(x)[:, ids])
    assert model.lm_head.weight_bytes * 4 == full_head.weight_bytes


@pytest.mark.parametrize("tied", [False, True])
def test_stored_head_reads_the_output_rows_from_the_unpacked_folder(tmp_path, tied):
    gguf = tmp_path / "draft.gguf"
    gguf.write_bytes(b"GGUF")
    packed = random_packed("Q5_0", out=32, inp=64)
    name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    tensors = {f"{name}:{f}": getattr(packed, f) for f in PACKED_FIELDS if getattr(packed, f).numel()}
    tensors["model.norm.weight"] = torch.ones(64)
    folder = stored_dir(gguf, tmp_path)
    folder.mkdir(parents=True)
    save_file(tensors, folder / "model.safetensors", {"block_formats": json.dumps({name: "q5_0"})})
    head = stored_head(gguf, tmp_path)
    assert head.format.name == "q5_0"
    assert all(np.array_equal(getattr(head, f).numpy(), getattr(packed, f).numpy()) for f in PACKED_FIELDS)


def test_the_shipped_frequency_lists_are_found():
    """The package's resources/ ships the Qwen2 vocabulary's list: where the draft's head cut reads it from."""
    from specdecode.weights.vocab_subset import shipped_rankings

    assert [p.name for p in shipped_rankings()] == ["frequent-tokens-qwen2.npz"]


def test_cut_draft_head_needs_a_matching_frequency_list():
    from specdecode.weights.vocab_subset import cut_draft_head, packaged_ranking

    class Vocab:
        all_special_ids = [0]

        def get_vocab(self):
            return {chr(65 + i): i for i in range(64)}

    model = tiny_native("qwen2", seed=0)
    assert packaged_ranking(Vocab()) is None
    head = model.lm_head
    assert cut_draft_head(model, Vocab(), "tiny", size=32) is None  # no list for this vocabulary: the head stays whole
    assert model.lm_head is head
    assert cut_draft_head(model, Vocab(), "tiny", size=0) is None
