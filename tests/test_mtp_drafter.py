"""The multi-token-prediction drafter (drafters/mtp.py) on a tiny Qwen3-Next whose checkpoint carries `mtp.*`
layers: the module's logits against a reference built from transformers' own Qwen3-Next layer and norms, every
shape of it (and `hybrid-mtp`) giving plain decoding's tokens, and the one-line refusals where a checkpoint has no
MTP layers."""

import numpy as np
import pytest
import torch
from native_families import PROMPT, VOCAB, run
from safetensors.torch import load_file, save_file
from test_qwen3_next_native import next_hf

from specdecode.config import SamplingParams
from specdecode.drafters import NoDrafter
from specdecode.drafters.mtp import MissingMtp, MtpDrafter, MtpHead, carries_mtp, check_mtp_source, load_mtp_head
from specdecode.engine.engine import Engine
from specdecode.errors import SpecdecodeError
from specdecode.methods import METHODS
from specdecode.models.masks import chain_mask
from specdecode.weights.loading import LoadPlan, load_models


def reference_layer(hf, seed: int = 5):
    """A one-layer Qwen3NextModel (full gated attention, experts and the shared expert): the MTP module's decoder
    layer and final norm, random, its norms and gates random too."""
    import transformers

    config = hf.config.to_dict()
    config.update(num_hidden_layers=1, layer_types=["full_attention"], mlp_only_layers=[])
    config = transformers.Qwen3NextConfig(**{k: v for k, v in config.items() if k != "model_type"})
    torch.manual_seed(seed)
    model = transformers.Qwen3NextModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("gate.weight"):
                p.normal_(0, 0.3)
    return model


def mtp_tensors(hf, layer) -> dict[str, torch.Tensor]:
    """The checkpoint's `mtp.*` tensors: fc and the two input norms random, the layer and the norm `layer`'s."""
    g = torch.Generator().manual_seed(6)
    d = hf.config.hidden_size
    tensors = {"mtp.fc.weight": torch.randn(d, 2 * d, generator=g) * 0.15,
               "mtp.pre_fc_norm_embedding.weight": torch.randn(d, generator=g) * 0.3,
               "mtp.pre_fc_norm_hidden.weight": torch.randn(d, generator=g) * 0.3}
    for name, tensor in layer.state_dict().items():
        if name.startswith("layers.0.") or name == "norm.weight":
            tensors["mtp." + name] = tensor.clone()
    return tensors


def save_with_mtp(hf, folder, tensors) -> None:
    hf.save_pretrained(folder)
    weights = load_file(folder / "model.safetensors")
    save_file({**weights, **tensors}, folder / "model.safetensors", {"format": "pt"})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(the transformers model, its reference MTP layer, a folder holding both, a folder without MTP layers)."""
    hf = next_hf(seed=1)
    layer = reference_layer(hf)
    folder = tmp_path_factory.mktemp("with-mtp")
    save_with_mtp(hf, folder, mtp_tensors(hf, layer))
    plain = tmp_path_factory.mktemp("without-mtp")
    hf.save_pretrained(plain)
    return hf, layer, folder, plain


def loaded(folder):
    return load_models(str(folder), None, LoadPlan(torch.float32, "float", "none", "float", "none"))


@torch.no_grad()
def test_head_matches_transformers_layer(checkpoint):
    """Six rows of (the target's hidden state, the next token) -> the module's logits, as the reference computes
    them: transformers' Qwen3-Next norms on both inputs, fc, its decoder layer and final norm, the target's head."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    hf, layer, folder, _ = checkpoint
    models = loaded(folder)
    target, head = models.target, load_mtp_head(folder, models.target)
    assert carries_mtp(folder) and isinstance(head, MtpHead)
    ids = torch.tensor([PROMPT[:7]])
    _, hidden = target(ids, torch.arange(7)[None], target.new_cache(1, 16), chain_mask(0, 7))
    hidden, nxt = hidden[0, :6], ids[0, 1:7]  # row i: the hidden state at i with the token at i + 1
    embeds = target.model.embed_tokens(nxt[None])[0]
    ours = head.logits(head.step(embeds, hidden, torch.arange(6), head.new_cache(16), chain_mask(0, 6)[0, 0]))

    tensors = mtp_tensors(hf, layer)
    norms = []
    for name in ("embedding", "hidden"):
        norm = Qwen3NextRMSNorm(hf.config.hidden_size, eps=hf.config.rms_norm_eps)
        norm.weight.copy_(tensors[f"mtp.pre_fc_norm_{name}.weight"])
        norms.append(norm)
    x = torch.cat((norms[0](hf.model.embed_tokens(nxt)), norms[1](hidden)), dim=-1) @ tensors["mtp.fc.weight"].T
    out = layer(inputs_embeds=x[None], position_ids=torch.arange(6)[None], use_cache=False).last_hidden_state
    assert torch.allclose(ours, hf.lm_head(out)[0], atol=1e-4)


def test_every_shape_equals_plain_decoding(checkpoint):
    """mtp (tree and chain) and hybrid-mtp, 1 and 4 tokens a step, and the head drafting whatever its confidence
    (random layers rarely hit): the tokens of plain decoding; drafts were made and verified."""
    _, _, folder, _ = checkpoint
    models = loaded(folder)
    target = models.target
    reference = run(Engine(target, NoDrafter()), PROMPT)
    for k in (1, 4):
        for name, tree in (("mtp", True), ("mtp", False), ("hybrid-mtp", True)):
            drafter = METHODS[name].build(models, tree, 3)
            assert run(Engine(target, drafter, num_draft_tokens=k), PROMPT) == reference, (name, tree, k)
    eager = MtpDrafter.load(folder, target, min_confidence=0.0)
    steps = list(Engine(target, eager, num_draft_tokens=4).generate(PROMPT, SamplingParams(max_new_tokens=30)))
    assert [t for s in steps for t in s.tokens] == reference
    assert sum(s.num_drafted for s in steps) > 0


def test_sampling_with_mtp_is_seeded_and_valid(checkpoint):
    """Sampling through the MTP drafter runs (its draft probabilities feed the rejection rule): tokens in range,
    and the same seed gives the same tokens."""
    _, _, folder, _ = checkpoint
    models = loaded(folder)
    params = SamplingParams(temperature=0.8, max_new_tokens=20, seed=3)
    outs = []
    for _ in range(2):
        drafter = MtpDrafter.load(folder, models.target, min_confidence=0.0)
        steps = Engine(models.target, drafter, num_draft_tokens=3).generate(PROMPT, params)
        outs.append([t for s in steps for t in s.tokens])
    assert outs[0] == outs[1] and all(0 <= t < VOCAB for t in outs[0])


def test_checkpoint_without_mtp_says_so(checkpoint):
    _, _, _, plain = checkpoint
    models = loaded(plain)
    assert not carries_mtp(plain)
    with pytest.raises(MissingMtp, match="no multi-token-prediction layers"):
        METHODS["mtp"].build(models, True, 3)
    assert issubclass(MissingMtp, SpecdecodeError)


def test_a_gguf_says_what_it_carries(tmp_path, checkpoint):
    """A GGUF without `nextn` blocks has no MTP layers; one of a family whose blocks are not read says so."""
    import gguf

    models = loaded(checkpoint[3])
    for architecture, nextn in (("qwen3next", 0), ("glm4moe", 1)):
        path = tmp_path / f"model-{nextn}.gguf"
        writer = gguf.GGUFWriter(str(path), architecture)
        if nextn:
            writer.add_uint32(f"{architecture}.nextn_predict_layers", nextn)
        writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with pytest.raises(MissingMtp, match="does not read" if nextn else "no `nextn` blocks"):
            check_mtp_source(str(path))
        with pytest.raises(MissingMtp, match="does not read" if nextn else "no `nextn` blocks"):
            load_mtp_head(path, models.target)


@torch.no_grad()
def test_a_qwen3_next_gguf_drafts_with_its_nextn_block(tmp_path, monkeypatch):
    """llama.cpp's converter keeps the MTP layers as a `nextn` block after the others: read as stored, the head
    gives the HF checkpoint's head's logits on the same rows, and drafting with it gives plain decoding's tokens."""
    from native_families import load_gguf_as_stored
    from test_qwen3_next_gguf import gguf_hf, write_next_gguf

    from specdecode.weights.loading import Models

    hf = gguf_hf()
    tensors = mtp_tensors(hf, reference_layer(hf))
    folder = tmp_path / "hf"
    save_with_mtp(hf, folder, tensors)
    target, _ = load_gguf_as_stored(tmp_path, monkeypatch, "next-mtp.gguf", hf,
                                    lambda path, hf: write_next_gguf(path, hf, None, tensors))
    path = tmp_path / "next-mtp.gguf"
    assert target.config.num_layers == 4 and not any("mtp" in n for n, _ in target.named_parameters())
    check_mtp_source(str(path))  # carried: not refused
    logits = []
    for source, model in ((path, target), (folder, loaded(folder).target)):
        head = load_mtp_head(source, model)
        ids = torch.tensor([PROMPT[:7]])
        _, hidden = model(ids, torch.arange(7)[None], model.new_cache(1, 16), chain_mask(0, 7))
        embeds = model.model.embed_tokens(ids[0, 1:7][None])[0]
        out = head.step(embeds, hidden[0, :6], torch.arange(6), head.new_cache(16), chain_mask(0, 6)[0, 0])
        logits.append(head.logits(out))
    assert torch.allclose(logits[0], logits[1], atol=1e-4)
    models = Models(target, None, source=str(path))
    reference = run(Engine(target, NoDrafter()), PROMPT)
    for name in ("mtp", "hybrid-mtp"):
        assert run(Engine(target, METHODS[name].build(models, True, 3), num_draft_tokens=4), PROMPT) == reference


def test_refused_before_anything_loads(checkpoint, monkeypatch):
    """A local folder without MTP layers is refused by SpecDecoder.load before a model is read."""
    import specdecode.api as api

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(api, "load_models", no_loading)
    with pytest.raises(MissingMtp, match="no multi-token-prediction layers"):
        api.SpecDecoder.load(str(checkpoint[3]), method="hybrid-mtp")


def test_api_generates_ids_without_a_tokenizer(checkpoint):
    """The tiny folder ships no tokenizer: ids in, ids out (no text), mtp's equal to none's; a text prompt is one
    clear error."""
    from specdecode.api import SpecDecoder

    outs = []
    for method in ("none", "mtp"):
        decoder = SpecDecoder.load(str(checkpoint[2]), method=method, dtype="float32", num_draft_tokens=3)
        result = decoder.generate(PROMPT, SamplingParams(max_new_tokens=16))
        outs.append(result.token_ids)
        assert result.text == ""
    assert outs[0] == outs[1]
    with pytest.raises(SpecdecodeError, match="needs a tokenizer"):
        decoder.generate("hello", SamplingParams(max_new_tokens=4))


def test_advise_tries_mtp_where_the_checkpoint_carries_it(checkpoint, capsys):
    import argparse

    from specdecode.advise.cli import candidate_list

    def candidates(folder):
        return candidate_list(argparse.Namespace(candidates=None, target=str(folder), draft=[], head=[]))

    assert "mtp" in candidates(checkpoint[2])
    assert "mtp" not in candidates(checkpoint[3])
    assert "saved without its multi-token-prediction layers" in capsys.readouterr().err


def test_bench_runs_mtp_by_default_only_where_the_target_has_the_layers(checkpoint):
    import argparse

    from specdecode.bench.cli import default_methods

    def defaults(folder):
        return default_methods(argparse.Namespace(target=str(folder), eagle=None, medusa=None, draft_adapter=None))

    assert {"mtp", "hybrid-mtp", "mtp-tree", "mtp-chain"} <= set(defaults(checkpoint[2]))
    assert not [m for m in defaults(checkpoint[3]) if "mtp" in m]


def test_requests_batched_with_mtp_give_their_own_tokens(checkpoint):
    """Requests joining a running batch, each drafting with its fork of the MTP drafter (its own MTP cache, the
    target's features of its own rows), give plain decoding's tokens."""
    from test_batch import run_batch

    models = loaded(checkpoint[2])
    target = models.target
    prompts = [PROMPT, [5, 9, 5, 9, 5, 9, 3], list(range(20, 40))]
    params = SamplingParams(max_new_tokens=12)
    alone = [run(Engine(target, NoDrafter()), p, 12) for p in prompts]
    engine = Engine(target, MtpDrafter.load(checkpoint[2], target, min_confidence=0.0), num_draft_tokens=3)
    assert run_batch(engine, [(p, params) for p in prompts], arrivals=[0, 1, 3]) == alone


def test_a_gguf_ships_mtp_only_with_its_block(tmp_path, monkeypatch):
    """bench and advise offer mtp for a Qwen3-Next GGUF with its nextn block, not for one without it."""
    from test_qwen3_next_gguf import gguf_hf, write_next_gguf

    from specdecode.drafters.mtp import ships_mtp

    hf = gguf_hf()
    with_block, without = tmp_path / "with.gguf", tmp_path / "without.gguf"
    write_next_gguf(with_block, hf, None, mtp_tensors(hf, reference_layer(hf)))
    write_next_gguf(without, hf)
    assert ships_mtp(str(with_block)) is True and ships_mtp(str(without)) is False
    (tmp_path / "junk.gguf").write_bytes(b"no")
    assert ships_mtp(str(tmp_path / "junk.gguf")) is None


@pytest.mark.parametrize("width", [1, 2])
def test_sampled_outputs_with_mtp_follow_the_targets_distribution(width):
    """Sampling with the MTP drafter (a chain at temperature 1, a tree of top-3 at 0.6), over four tokens: every
    output of three tokens enumerated exactly, drafts rejected often enough to matter."""
    from native_families import native
    from test_qwen3_next_native import SAMPLED_TRIALS
    from test_sampling_new_families import EOS, exact_outputs, seeded
    from toy import assert_exact_distribution

    from specdecode.weights.quantize import quantize_

    hf = next_hf(0, vocab_size=4)
    with torch.no_grad():  # random tiny models give near-uniform logits: sharpened, drafts get rejected
        hf.model.norm.weight.copy_(8.0 * (1 + hf.model.norm.weight) - 1)
    target = quantize_(native(hf), "none")
    target.config.eos_token_ids = (EOS,)
    torch.manual_seed(4)
    head = MtpHead(target)
    with torch.no_grad():
        for name, p in head.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3)
    head = quantize_(head.eval(), "none")
    params = (SamplingParams(temperature=1.0, max_new_tokens=3) if width == 1
              else SamplingParams(temperature=0.6, top_k=3, max_new_tokens=3))
    prompt = [0, 1, 2, 1, 0, 2]
    exact = exact_outputs(target, prompt, params)
    engine = Engine(target, MtpDrafter(head, target, width=width, min_confidence=0.0), num_draft_tokens=3)
    counts: dict[tuple, int] = {}
    rejected = 0
    for i in range(SAMPLED_TRIALS):
        out = tuple(t for step in engine.generate(prompt, seeded(params, i)) for t in step.tokens)
        counts[out] = counts.get(out, 0) + 1
        rejected += sum(engine.last.stats.accepted_at) < sum(engine.last.stats.drafted_at)
    assert rejected > SAMPLED_TRIALS / 20, rejected  # rollbacks happened
    assert_exact_distribution(counts, exact)
