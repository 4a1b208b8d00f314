"""The transformers adapter (hf_model.py), for architectures the native model lacks: a Gemma 3 with sliding-window
layers shorter than the prompt, so rollbacks cut windows that have already slid. Speculation through it gives
plain decoding's tokens, and plain decoding gives transformers' own greedy output."""

from __future__ import annotations

import pytest
import torch

from specdecode.config import SamplingParams
from specdecode.drafters import DraftModelDrafter, NgramDrafter, NoDrafter
from specdecode.engine.engine import Engine
from specdecode.models.hf_model import HFModel

PROMPT = [1, 2, 3, 4, 5, 6, 1, 2, 3, 4, 7, 8, 1, 2, 3]


def tiny_gemma3(seed: int) -> HFModel:
    import transformers

    torch.manual_seed(seed)
    config = transformers.Gemma3TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=4, layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=256)
    return HFModel(transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32))


@pytest.fixture(scope="module")
def target():
    return tiny_gemma3(0)


def tokens(engine: Engine, params: SamplingParams) -> list[int]:
    return [t for step in engine.generate(PROMPT, params) for t in step.tokens]


def test_plain_decoding_through_the_adapter_is_transformers_greedy_output(target):
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ours = tokens(Engine(target, NoDrafter()), params)
    theirs = target.model.generate(torch.tensor([PROMPT]), max_new_tokens=20, do_sample=False,
                                   eos_token_id=None, min_new_tokens=20)[0, len(PROMPT):].tolist()
    assert ours == theirs


@pytest.mark.parametrize("k", [2, 5])
def test_drafts_rolled_back_in_sliding_windows_keep_the_plain_output(target, k):
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    plain = tokens(Engine(target, NoDrafter()), params)
    for drafter in (NgramDrafter(max_ngram=2, branches=1), DraftModelDrafter(tiny_gemma3(1), vocab_size=64),
                    DraftModelDrafter(target, vocab_size=64)):
        engine = Engine(target, drafter, num_draft_tokens=k)
        assert tokens(engine, params) == plain
        assert engine.last.stats.drafted_tokens


def test_an_uncovered_family_says_it_runs_through_transformers(tmp_path, caplog):
    """A family the native model lacks (OLMo 2 here) loads through transformers, with one line saying so."""
    import transformers

    from specdecode.weights.loading import load_model

    config = transformers.Olmo2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    with caplog.at_level("WARNING"):
        model, _ = load_model(str(tmp_path), torch.float32)
    assert isinstance(model, HFModel)
    lines = [r.getMessage() for r in caplog.records if "runs through transformers" in r.getMessage()]
    assert len(lines) == 1 and "olmo2" in lines[0], lines
    assert tokens(Engine(model, NoDrafter()), SamplingParams(max_new_tokens=4, ignore_eos=True))
