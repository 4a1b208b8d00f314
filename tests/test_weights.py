"""Loading weights from HF folders and GGUF files, with tiny random checkpoints built in tmp_path.

The real packaged models are only touched by the tests marked `skipif`, and only when their converted
cache already exists (a first conversion takes tens of seconds).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from specdecode.errors import SpecdecodeError
from specdecode.weights import files as weights
from specdecode.weights import hub

CHAT_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
# special tokens, the printable ASCII bytes, the byte-level space and one merge
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(33, 127)] + ["Ġ", "he"]


def _qwen2(vocab_size: int = len(TOKENS), tie: bool = False) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=tie,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    return Qwen2ForCausalLM(config).eval()


def _tokenizer() -> PreTrainedTokenizerFast:
    # Byte-level BPE like Qwen's: a Qwen2 folder's tokenizer is rebuilt by Qwen2Tokenizer from vocab + merges.
    vocab = {token: i for i, token in enumerate(TOKENS)}
    backend = Tokenizer(models.BPE(vocab, [("h", "e")]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>")
    tokenizer.add_special_tokens({"additional_special_tokens": TOKENS[:3]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen2")
    _qwen2().save_pretrained(folder)
    _tokenizer().save_pretrained(folder)
    return folder


def test_hf_folder_round_trip(qwen2_dir: Path) -> None:
    model = _qwen2()
    checkpoint = weights.load_checkpoint(str(qwen2_dir), torch.float32)
    expected = model.state_dict()
    assert set(checkpoint.state_dict) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(checkpoint.state_dict[name], tensor), name
    assert "model.layers.0.self_attn.q_proj.bias" in checkpoint.state_dict
    config = checkpoint.config
    assert config["model_type"] == "qwen2" and config["architectures"] == ["Qwen2ForCausalLM"]
    assert (config["vocab_size"], config["hidden_size"], config["num_hidden_layers"]) == (len(TOKENS), 64, 2)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 16)
    assert config["rope_theta"] == 10000.0 and config["rope_scaling"] is None
    assert config["tie_word_embeddings"] is False and config["eos_token_id"] == 2
    assert checkpoint.name == qwen2_dir.name and checkpoint.path == checkpoint.hf_dir == qwen2_dir


def test_dtype_cast_and_unsupported_dtype(qwen2_dir: Path) -> None:
    checkpoint = weights.load_checkpoint(str(qwen2_dir), torch.bfloat16)
    assert {t.dtype for t in checkpoint.state_dict.values()} == {torch.bfloat16}
    with pytest.raises(SpecdecodeError, match="unsupported dtype torch.int8"):
        weights.load_checkpoint(str(qwen2_dir), torch.int8)


def test_tokenizer_and_chat_template(qwen2_dir: Path) -> None:
    tokenizer = weights.load_checkpoint(str(qwen2_dir), torch.float32).tokenizer
    assert tokenizer is not None and tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer("he he!").input_ids == [len(TOKENS) - 1, len(TOKENS) - 2, len(TOKENS) - 1, 3]
    assert weights.load_tokenizer(str(qwen2_dir)).get_vocab() == tokenizer.get_vocab()


def test_sharded_tied_llama_without_tokenizer(tmp_path: Path) -> None:
    config = LlamaConfig(
        vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, tie_word_embeddings=True,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    checkpoint = weights.load_checkpoint(str(tmp_path), torch.float32)
    assert "lm_head.weight" not in checkpoint.state_dict  # tied: the embedding is the head
    assert set(checkpoint.state_dict) == set(model.state_dict()) - {"lm_head.weight"}
    assert checkpoint.tokenizer is None and checkpoint.config["head_dim"] == 8


def test_generation_config_eos_list_wins(tmp_path: Path, qwen2_dir: Path) -> None:
    shutil.copytree(qwen2_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 0]}')
    assert weights.read_config(tmp_path)["eos_token_id"] == [2, 0]


def test_folder_errors(tmp_path: Path, qwen2_dir: Path) -> None:
    with pytest.raises(SpecdecodeError, match="has no config.json"):
        weights.load_checkpoint(str(tmp_path), torch.float32)
    shutil.copy(qwen2_dir / "config.json", tmp_path)
    with pytest.raises(SpecdecodeError, match="has no \\*.safetensors weights"):
        weights.load_checkpoint(str(tmp_path), torch.float32)


def test_unknown_source_and_offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(SpecdecodeError, match="could not find model 'no-such-model'.*specdecode models list"):
        weights.load_checkpoint("no-such-model", torch.float32, cache=tmp_path)

    def offline(*args: object, **kwargs: object) -> str:
        raise OSError("Name or service not known")

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(SpecdecodeError, match="could not find model 'org/model'.*reachable hub id"):
        weights.load_checkpoint("org/model", torch.float32, cache=tmp_path)


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_text("not a model")
    with pytest.raises(SpecdecodeError, match="no GGUF magic bytes"):
        weights.load_checkpoint(str(path), torch.float32, cache=tmp_path)


# --- GGUF: a tiny Qwen2 written with gguf-py in float32, so de-quantizing is exact ---

def _write_gguf(path: Path, model: Qwen2ForCausalLM, blocks: str | None = None) -> None:
    """`blocks`: a GGUF block type (e.g. 'Q8_0') for every matrix, as llama.cpp's quantizer writes them."""
    config = model.config
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(TOKENS)
    writer.add_token_types([3, 3, 3] + [1] * (len(TOKENS) - 3))
    writer.add_token_merges(["h e"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue  # llama.cpp writes no `output.weight` for tied models
        base, suffix = name.rsplit(".", 1)
        values = tensor.numpy().astype(np.float32)
        if blocks is not None and values.ndim == 2:
            kind = gguf.GGMLQuantizationType[blocks]
            writer.add_tensor(f"{names.get_name(base)}.{suffix}", gguf.quants.quantize(values, kind),
                              raw_dtype=kind)
            continue
        writer.add_tensor(f"{names.get_name(base)}.{suffix}", values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny-qwen2.gguf"
    _write_gguf(path, _qwen2())
    return path


def test_gguf_conversion_is_exact_and_cached(tiny_gguf: Path, tmp_path: Path) -> None:
    expected = _qwen2().state_dict()
    checkpoint = weights.load_checkpoint(str(tiny_gguf), torch.float32, cache=tmp_path)
    assert set(checkpoint.state_dict) == set(expected)  # biases come through, lm_head is kept (untied)
    for name, tensor in expected.items():
        assert torch.equal(checkpoint.state_dict[name], tensor), name
    config = checkpoint.config
    assert config["model_type"] == "qwen2" and config["architectures"] == ["Qwen2ForCausalLM"]
    assert (config["vocab_size"], config["head_dim"], config["rms_norm_eps"]) == (len(TOKENS), 16, 1e-6)
    assert checkpoint.hf_dir == weights.converted_dir(tiny_gguf, torch.float32, tmp_path)
    assert checkpoint.hf_dir.name.startswith("tiny-qwen2-") and checkpoint.hf_dir.name.endswith("-float32")
    assert checkpoint.tokenizer.chat_template == CHAT_TEMPLATE
    assert checkpoint.tokenizer("he!").input_ids == [len(TOKENS) - 1, 3]



def test_gguf_second_load_reads_the_cache(tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = weights.load_checkpoint(str(tiny_gguf), torch.bfloat16, cache=tmp_path)

    def no_conversion(*args: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(weights, "convert_gguf", no_conversion)
    again = weights.load_checkpoint(str(tiny_gguf), torch.bfloat16, cache=tmp_path)
    assert again.hf_dir == first.hf_dir
    for name, tensor in first.state_dict.items():
        assert torch.equal(again.state_dict[name], tensor), name
    assert weights.load_tokenizer(str(tiny_gguf), cache=tmp_path).chat_template == CHAT_TEMPLATE


def test_a_conversion_parses_the_file_once(tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from specdecode.weights.gguf_stored import load_stored

    made: list[str] = []
    plain = gguf.GGUFReader

    class Counted(plain):  # ours, and the readers transformers' config and tokenizer loaders construct
        def __init__(self, path, *args, **kwargs) -> None:
            made.append(str(path))
            super().__init__(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counted)
    load_stored(tiny_gguf, tmp_path / "stored")
    weights.load_checkpoint(str(tiny_gguf), torch.float32, cache=tmp_path / "float")
    assert len(made) == 2 and gguf.GGUFReader is Counted  # one parse per conversion; the reader put back


def test_a_draft_with_the_targets_vocabulary_files_shares_its_tokenizer(tiny_gguf: Path, tmp_path: Path) -> None:
    from specdecode.weights.gguf_stored import load_stored, stored_dir

    own = load_stored(tiny_gguf, tmp_path).tokenizer
    twins = {name: tmp_path / name for name in ("same", "edited", "fewer")}
    for twin in twins.values():
        twin.mkdir()
        for file in stored_dir(tiny_gguf, tmp_path).iterdir():
            if file.name in weights.TOKENIZER_FILES:
                shutil.copy(file, twin / file.name)
    (twins["same"] / "chat_template.jinja").write_text("{{ messages }}")  # chat templates aside
    (twins["edited"] / "tokenizer.json").write_text((twins["edited"] / "tokenizer.json").read_text() + " ")
    (twins["fewer"] / "tokenizer_config.json").unlink()
    like = {name: weights.read_tokenizer(twin) for name, twin in twins.items()}
    assert load_stored(tiny_gguf, tmp_path, tokenizer_like=like["same"]).tokenizer is like["same"]
    for name in ("edited", "fewer"):  # other bytes, another set of files: its own, read from its folder
        read = load_stored(tiny_gguf, tmp_path, tokenizer_like=like[name]).tokenizer
        assert read is not like[name] and read.get_vocab() == own.get_vocab(), name


def test_a_narrowed_draft_gets_its_wider_layers_in_q4_0_once_cached(tmp_path: Path) -> None:
    from specdecode.weights.gguf_stored import load_stored, stored_dir
    from specdecode.weights.vocab_subset import stored_head

    path = tmp_path / "q8.gguf"
    _write_gguf(path, _qwen2(), blocks="Q8_0")
    as_stored = load_stored(path, tmp_path)
    narrow = load_stored(path, tmp_path, narrow="q4_0")
    assert stored_dir(path, tmp_path, "q4_0") != stored_dir(path, tmp_path) and stored_dir(path, tmp_path).is_dir()
    for name, packed in as_stored.packed.items():
        assert packed.format.name == "q8_0", name
        if name == "model.embed_tokens.weight":  # looked up a row at a time: kept as stored
            assert narrow.packed[name].format.name == "q8_0"
            continue
        assert narrow.packed[name].format.name == "q4_0", name
        original = packed.dequantize()  # the same weights, each within a Q4_0 step (1/8 of its block's largest)
        step = original.view(original.shape[0], -1, 32).abs().amax(-1, keepdim=True) / 8
        assert ((narrow.packed[name].dequantize() - original).view_as(step.expand(-1, -1, 32)).abs()
                <= step * 1.01 + 1e-6).all(), name
    assert stored_head(path, tmp_path, narrow="q4_0").format.name == "q4_0"
    assert stored_head(path, tmp_path).format.name == "q8_0"
    again = load_stored(path, tmp_path, narrow="q4_0")  # read from its folder, not converted again
    assert all(torch.equal(again.packed[n].qs, p.qs) for n, p in narrow.packed.items())


def test_gguf_tied_embeddings(tmp_path: Path) -> None:
    path = tmp_path / "tied.gguf"
    model = _qwen2(tie=True)
    _write_gguf(path, model)
    checkpoint = weights.load_checkpoint(str(path), torch.float32, cache=tmp_path)
    assert checkpoint.config["tie_word_embeddings"] is True
    assert set(checkpoint.state_dict) == set(model.state_dict()) - {"lm_head.weight"}
    assert torch.equal(checkpoint.state_dict["model.embed_tokens.weight"], model.lm_head.weight.detach())


def test_truncated_gguf_is_a_clear_error(tiny_gguf: Path, tmp_path: Path) -> None:
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(tiny_gguf.read_bytes()[: tiny_gguf.stat().st_size * 2 // 3])
    with pytest.raises(SpecdecodeError, match="cannot read GGUF file .*truncated.gguf"):
        weights.load_checkpoint(str(truncated), torch.float32, cache=tmp_path)
    assert not (tmp_path / "converted").exists() or not any((tmp_path / "converted").iterdir())


# --- the real packaged models, only when already pulled and converted (see `specdecode models pull`) ---

SMOLLM = hub.cache_dir() / "models" / "smollm2-135m-instruct.gguf"
SMOLLM_READY = SMOLLM.is_file() and weights.converted_dir(SMOLLM, torch.bfloat16).is_dir()


@pytest.mark.skipif(not SMOLLM_READY, reason="smollm2-135m-instruct is not pulled and converted in the cache")
def test_packaged_smollm2_from_cache() -> None:
    checkpoint = weights.load_checkpoint("smollm2-135m-instruct", torch.bfloat16)
    assert checkpoint.config["model_type"] == "llama" and checkpoint.config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in checkpoint.state_dict and len(checkpoint.state_dict) == 272
    assert checkpoint.tokenizer.chat_template and "<|im_start|>" in checkpoint.tokenizer.chat_template


@pytest.mark.skipif(not SMOLLM.is_file(), reason="smollm2-135m-instruct is not pulled")
def test_truncated_real_gguf(tmp_path: Path) -> None:
    truncated = tmp_path / "smollm2-truncated.gguf"
    with SMOLLM.open("rb") as src, truncated.open("wb") as dst:
        dst.write(src.read(20_000_000))
    with pytest.raises(SpecdecodeError, match="cannot read GGUF file"):
        weights.load_checkpoint(str(truncated), torch.bfloat16, cache=tmp_path)


def test_the_kv_cache_dtype_is_checked_before_any_model_loads():
    from specdecode.kernels import cpu_kernels
    from specdecode.weights.loading import resolve_kv_dtype

    kernels = cpu_kernels() is not None
    assert resolve_kv_dtype("auto", "cpu", torch.float32) == (torch.bfloat16 if kernels else None)
    assert resolve_kv_dtype("auto", "cpu", torch.bfloat16) is None  # already the activations'
    assert resolve_kv_dtype("auto", "cuda", torch.float32) is None
    assert resolve_kv_dtype("auto", "cpu", torch.float32, "float") is None  # float weights: as the user's --dtype
    assert resolve_kv_dtype("float32", "cpu", torch.float32) is None  # the activations' own: nothing to change
    with pytest.raises(SpecdecodeError, match="unknown KV cache dtype 'int8'"):
        resolve_kv_dtype("int8", "cpu", torch.float32)
    with pytest.raises(SpecdecodeError, match="needs the CPU kernels"):
        resolve_kv_dtype("bfloat16", "cuda", torch.float32)


@pytest.mark.parametrize("blocks", ["BF16", "F16"])
def test_a_16_bit_gguf_runs_as_stored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
                                      blocks: str) -> None:
    """A BF16 or F16 GGUF file (as llama.cpp's quantizer writes one): its matrices kept in 16 bits on the float
    kernels (bfloat16 on tiles where the CPU has AMX), the embedding widened row by row; logits as the float model's
    with those weights, and speculation token-identical to plain decoding."""
    from specdecode.kernels import cpu_kernels
    from specdecode.models.masks import chain_mask
    from specdecode.weights.loading import load_model
    from specdecode.weights.quantize import HalfEmbedding, KernelLinear

    if cpu_kernels() is None:
        pytest.skip("weights as stored run on the native CPU kernel")
    monkeypatch.setattr(hub, "cache_dir", lambda: tmp_path)
    path, reference = tmp_path / f"{blocks}.gguf", _qwen2()
    _write_gguf(path, reference, blocks=blocks)
    with caplog.at_level("WARNING"):
        model, _ = load_model(str(path), torch.float32, weights="stored")
    half = torch.bfloat16 if blocks == "BF16" else torch.float16
    said = "has float16 matrices: they run on the vector units" in caplog.text
    assert said == (blocks == "F16" and cpu_kernels().bf16_tiles_on())
    linears = [m for m in model.modules() if isinstance(m, KernelLinear)]
    assert len(linears) == 15 and all(m.weight.dtype == half for m in linears)
    assert isinstance(model.model.embed_tokens, HalfEmbedding) and model.dtype == torch.float32
    with torch.no_grad():  # the reference runs the 16-bit weights in float32
        for p in reference.parameters():
            if p.dim() == 2:
                p.copy_(p.to(half).float())
        ids = torch.tensor([[5, 9, 2, 7, 1, 3, 3, 8]])
        expected = reference(ids).logits[0]
        logits, _ = model(ids, torch.arange(8)[None], model.new_cache(1, 16), chain_mask(0, 8))
    assert (logits[0] - expected).abs().max() < 0.02 * expected.abs().max()
    _speculation_equals_plain_decoding(model)


def test_a_bfloat16_hf_folder_runs_as_stored(tmp_path: Path) -> None:
    """An HF folder in bfloat16 (as models ship): `auto` keeps its matrices in bfloat16 under float32 activations,
    as a BF16 GGUF runs; a float32 draft folder is still written in blocks; speculation equals plain decoding."""
    from specdecode.kernels import cpu_kernels
    from specdecode.weights.loading import load_model, plan_load
    from specdecode.weights.quantize import HalfEmbedding, KernelLinear

    if cpu_kernels() is None:
        pytest.skip("weights as stored run on the native CPU kernel")
    folder, draft = tmp_path / "bf16", tmp_path / "draft"
    _qwen2().to(torch.bfloat16).save_pretrained(folder)
    _qwen2().save_pretrained(draft)
    plan = plan_load(str(folder), str(draft))
    assert (plan.weights, plan.dtype, plan.draft_weights, plan.draft_quantize) == ("stored", torch.float32,
                                                                                    "float", "q8_0")
    assert plan.describe().startswith("target weights as stored")
    model, _ = load_model(str(folder), plan.dtype, weights=plan.weights)
    linears = [m for m in model.modules() if isinstance(m, KernelLinear)]
    assert len(linears) == 15 and all(m.weight.dtype == torch.bfloat16 for m in linears)
    assert isinstance(model.model.embed_tokens, HalfEmbedding) and model.dtype == torch.float32
    _speculation_equals_plain_decoding(model)


def test_weights_stored_refuses_an_architecture_the_native_model_lacks(tmp_path: Path) -> None:
    from transformers import Gemma2Config, Gemma2ForCausalLM  # Gemma 3 runs natively; Gemma 2 does not

    from specdecode.kernels import cpu_kernels
    from specdecode.weights.loading import resolve_weights

    config = Gemma2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    Gemma2ForCausalLM(config).save_pretrained(tmp_path)
    assert resolve_weights("auto", str(tmp_path)) == "float"
    if cpu_kernels() is not None:
        with pytest.raises(SpecdecodeError, match="does not implement .* architecture; use --weights float"):
            resolve_weights("stored", str(tmp_path))


def _speculation_equals_plain_decoding(model) -> None:
    """Greedy output of prompt lookup and of the model drafting for itself, both plain decoding's."""
    from specdecode.config import SamplingParams
    from specdecode.drafters import DraftModelDrafter, NgramDrafter, NoDrafter
    from specdecode.engine.engine import Engine

    prompt, params = [5, 9, 2, 7, 5, 9], SamplingParams(max_new_tokens=16)
    plain = [t for s in Engine(model, NoDrafter()).generate(prompt, params) for t in s.tokens]
    for drafter in (NgramDrafter(), DraftModelDrafter(model, vocab_size=len(TOKENS))):
        engine = Engine(model, drafter, num_draft_tokens=3)
        assert [t for s in engine.generate(prompt, params) for t in s.tokens] == plain


def test_a_float32_hf_folder_keeps_following_dtype(qwen2_dir: Path) -> None:
    from specdecode.weights.loading import resolve_weights

    assert resolve_weights("auto", str(qwen2_dir)) == "float"  # saved in float32: --dtype decides, as before
