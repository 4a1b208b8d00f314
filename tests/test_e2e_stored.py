"""A real GGUF file (SmolLM2-135M: Q4_1 layers, a Q8_0 embedding) run with its blocks as stored: the weights are
the file's, the logits agree with the de-quantized float model, and greedy speculation is token-identical to plain
decoding on this path. With llama-cpp-python installed, llama.cpp's greedy output is compared too."""

import pytest
import torch

from specdecode.api import SpecDecoder
from specdecode.config import SamplingParams
from specdecode.kernels import cpu_kernels
from specdecode.methods import build_drafter
from specdecode.models.masks import chain_mask
from specdecode.weights import hub
from specdecode.weights.loading import Models, load_model, plan_load
from specdecode.weights.quantize import QuantEmbedding, QuantLinear

SMOL = "smollm2-135m-instruct"
pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(cpu_kernels() is None, reason="weights as stored run on the native CPU kernel")]
PROMPT = [{"role": "user", "content": "Write a Python function that returns the largest of three numbers."}]


@pytest.fixture(scope="module")
def stored():
    hub.pull(SMOL)
    return load_model(SMOL, torch.float32, weights="stored")


def test_auto_runs_a_gguf_file_as_stored():
    plan = plan_load(SMOL, SMOL)
    assert (plan.weights, plan.draft_weights, plan.dtype) == ("stored", "stored", torch.float32)
    assert plan.quantize == "none" and plan.draft_quantize == "q4_0"  # the draft's wider layers narrowed
    assert "draft weights as stored, wider layers in q4_0" in plan.describe()
    assert plan_load(SMOL, SMOL, draft_quantize="none").describe().startswith("target weights as stored, draft "
                                                                               "weights as stored,")
    assert plan_load(SMOL, None, weights="float").weights == "float"


def test_a_narrowed_draft_guesses_and_the_output_stays_the_targets(stored):
    model, tokenizer = stored
    draft, _ = load_model(SMOL, torch.float32, quantize="q4_0", weights="stored", tokenizer_like=tokenizer)
    formats = {m.format.name for m in draft.model.layers.modules() if isinstance(m, QuantLinear)}
    assert formats == {"q4_0"}  # the file's Q4_1 layers (5 bits a weight)
    assert draft.lm_head.format.name == "q8_0"  # tied to the embedding, which is looked up: kept as stored
    params = SamplingParams(max_new_tokens=48)
    plain = SpecDecoder(model, tokenizer, build_drafter("none", Models(model, tokenizer)), "none", 0)
    drafter = build_drafter("draft", Models(model, tokenizer, draft), "tree")
    drafting = SpecDecoder(model, tokenizer, drafter, "draft", 5)
    assert drafting.generate(PROMPT, params).token_ids == plain.generate(PROMPT, params).token_ids
    assert drafting.stats.acceptance_rate > 0.5  # the same model in fewer bits mostly guesses the target's tokens


def test_blocks_are_kept_and_logits_match_the_float_model(stored):
    model, tokenizer = stored
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == 30 * 7 + 1  # every projection and the (tied, Q8_0) output matrix
    assert isinstance(model.model.embed_tokens, QuantEmbedding)
    float_model, _ = load_model(SMOL, torch.float32, weights="float")
    ids = torch.tensor([prompt_ids(tokenizer)])
    with torch.inference_mode():
        ours, _ = model(ids, torch.arange(ids.shape[1])[None], model.new_cache(1, 128), chain_mask(0, ids.shape[1]))
        ref, _ = float_model(ids, torch.arange(ids.shape[1])[None], float_model.new_cache(1, 128),
                             chain_mask(0, ids.shape[1]))
    # int8 activations against float ones, through 30 layers: close on average, the same top token nearly always
    assert (ours - ref).abs().mean() < 0.06 * ref.abs().mean()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_greedy_speculation_is_token_identical_on_the_stored_path(stored):
    model, tokenizer = stored
    params = SamplingParams(max_new_tokens=48)
    outputs = {}
    for method, shape, k in (("none", "chain", 0), ("ngram", "tree", 4), ("draft", "chain", 5), ("draft", "tree", 5)):
        drafter = build_drafter(method, Models(model, tokenizer, model if method == "draft" else None), shape)
        decoder = SpecDecoder(model, tokenizer, drafter, method, k)
        outputs[method, shape] = decoder.generate(PROMPT, params).token_ids
        if method == "draft" and shape == "chain":  # the draft is the target, computed the same way: always right
            assert decoder.stats.acceptance_rate == 1.0
    for key, tokens in outputs.items():
        assert tokens == outputs["none", "chain"], key


def test_llamacpp_reads_the_same_file_and_mostly_agrees(stored):
    pytest.importorskip("llama_cpp")
    from specdecode.bench.llamacpp import LlamaCppRunner

    model, tokenizer = stored
    ids = prompt_ids(tokenizer)
    params = SamplingParams(max_new_tokens=24)
    ours = SpecDecoder(model, tokenizer, build_drafter("none", Models(model, tokenizer)), "none", 0
                       ).generate(ids, params).token_ids
    theirs = LlamaCppRunner(hub.pull(SMOL), list(model.config.eos_token_ids), 512, threads=1).run(ids, params)
    same = next((i for i, (a, b) in enumerate(zip(ours, theirs.token_ids)) if a != b), len(ours))
    assert same >= 8, (ours, theirs.token_ids)  # different rounding: near-identical, not identical


def prompt_ids(tokenizer) -> list[int]:
    text = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)
