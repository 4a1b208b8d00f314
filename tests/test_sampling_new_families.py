"""Sampling stays lossless on the native mixture-of-experts and sliding-window models: the whole loop's outputs follow
the target's own distribution (test_engine.py's chi-by-L1 bound at a fixed seed per trial) on a tiny Qwen3-MoE and a
tiny Gemma 3 whose window is shorter than the prompt, for a draft model's chain and its tree, and with two requests
in one batch. The vocabulary is four tokens (one of them EOS), so every output of three tokens can be enumerated."""

import pytest
import torch
from native_families import native
from test_batch import run_batch
from test_engine import run
from test_gemma3_native import gemma_hf
from test_qwen3_moe_native import moe_hf
from toy import Cycling, assert_exact_distribution

from specdecode.config import SamplingParams
from specdecode.drafters import DraftModelDrafter
from specdecode.engine.engine import Engine
from specdecode.models.masks import chain_mask
from specdecode.sampling import to_probs
from specdecode.weights.quantize import quantize_

VOCAB, EOS, LENGTH, TRIALS = 4, 3, 3, 2400
WINDOW = 3
PROMPT = [0, 1, 2, 1, 0, 2]  # longer than the window: local layers cut every row's keys
SHARPNESS = 8.0  # random tiny models give near-uniform logits: sharpened, drafts get rejected often enough
EXPERT_SCALE = 3.0  # at their init scale the experts barely move the logits: scaled, a wrong route would show
CASES = {"chain": (1, SamplingParams(temperature=1.0, max_new_tokens=LENGTH)),
         "tree": (2, SamplingParams(temperature=0.6, top_k=3, max_new_tokens=LENGTH))}


def family_model(family: str, seed: int, **overrides):
    """A tiny native model of the family, two layers (an expert layer then a dense one; a local layer then a global
    one), its final norm scaled by SHARPNESS, its linear layers on the CPU kernels (as a loaded model runs: the
    experts' rows grouped on them). Gemma's norms after attention and MLP already make each layer count."""
    if family == "qwen3-moe":
        hf = moe_hf(seed, vocab_size=VOCAB, num_hidden_layers=2, mlp_only_layers=[1], **overrides)
        with torch.no_grad():
            hf.model.norm.weight.mul_(SHARPNESS)
            for name, p in hf.named_parameters():
                if ".experts." in name:
                    p.mul_(EXPERT_SCALE)
        model = native(hf)
    else:
        hf = gemma_hf(seed, vocab_size=VOCAB, num_hidden_layers=2, sliding_window=WINDOW, **overrides)
        with torch.no_grad():  # Gemma's norm multiplies by 1 + w
            hf.model.norm.weight.copy_(SHARPNESS * (1 + hf.model.norm.weight) - 1)
        model = native(hf)
    return quantize_(model, "none")


@pytest.fixture(scope="module", params=["qwen3-moe", "gemma3"])
def models(request):
    """(target, draft): the target with EOS; Gemma's target with one KV head (the native kernel's windowed rows),
    its draft with two (through torch)."""
    family = request.param
    target = family_model(family, 0, **({"kv_heads": 1} if family == "gemma3" else {}))
    target.config.eos_token_ids = (EOS,)
    if family == "qwen3-moe":
        assert target.config.moe_layers == (0,)
    else:
        assert target.config.local_layers == (0,) and target.config.sliding_window < len(PROMPT)
    return target, family_model(family, 1)


def exact_outputs(target, prompt: list[int], params: SamplingParams) -> dict[tuple, float]:
    """Probability of every output (cut after EOS or at max_new_tokens), token by token from one masked forward
    over the whole context each time (not the engine's cached decode rows)."""
    exact, done = {(): 1.0}, {}
    for _ in range(params.max_new_tokens):
        grown = {}
        for out, p in exact.items():
            ids = torch.tensor([prompt + list(out)])
            with torch.inference_mode():
                logits, _ = target(ids, torch.arange(ids.shape[1])[None], target.new_cache(1, ids.shape[1]),
                                   chain_mask(0, ids.shape[1]), logits_from=ids.shape[1] - 1)
            q = torch.as_tensor(to_probs(logits[0, -1], params))
            for t in q.nonzero().flatten().tolist():
                (done if t == EOS else grown)[out + (t,)] = p * float(q[t])
        exact = grown
    return {**exact, **done}


def seeded(params: SamplingParams, seed: int) -> SamplingParams:
    return SamplingParams(**{**params.__dict__, "seed": seed})


@pytest.mark.parametrize("shape", list(CASES))
def test_output_distribution_is_the_targets(models, shape):
    """A draft model's chain (temperature 1) and its tree (siblings drawn without replacement; top-3 at 0.6, so
    some drafted tokens lie outside the target's support); four drafts a step, so EOS and the token budget land
    inside drafts."""
    target, draft = models
    width, params = CASES[shape]
    exact = exact_outputs(target, PROMPT, params)
    engine = Engine(target, DraftModelDrafter(draft, vocab_size=VOCAB, width=width), num_draft_tokens=4)
    counts: dict[tuple, int] = {}
    drafted = rejected = 0
    for i in range(TRIALS):
        out = tuple(run(engine, PROMPT, seeded(params, i)))
        counts[out] = counts.get(out, 0) + 1
        stats = engine.last.stats
        drafted += stats.drafted_tokens
        rejected += sum(stats.accepted_at) < sum(stats.drafted_at)  # some step kept less than its draft's depth
    assert drafted > TRIALS / 2 and rejected > TRIALS / 20, (drafted, rejected)  # verified drafts, some rejected
    assert_exact_distribution(counts, exact)


def test_output_distribution_is_the_targets_two_requests_in_a_batch(models):
    """Two requests in every batch, one drafting a chain and the other a tree, each with its own seed; the first
    joins a step late every other trial, so its prompt rows share a forward with the other's verify rows."""
    target, draft = models
    params = CASES["chain"][1]
    exact = exact_outputs(target, PROMPT, params)
    make = Cycling(lambda: DraftModelDrafter(draft, vocab_size=VOCAB),
                   lambda: DraftModelDrafter(draft, vocab_size=VOCAB, width=2))
    engine = Engine(target, make, num_draft_tokens=4)
    counts: dict[tuple, int] = {}
    for i in range(TRIALS // 2):
        requests = [(PROMPT, seeded(params, 2 * i + j)) for j in range(2)]
        for out in run_batch(engine, requests, arrivals=[i % 2, 0]):
            counts[tuple(out)] = counts.get(tuple(out), 0) + 1
    assert_exact_distribution(counts, exact)
