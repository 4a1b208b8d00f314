"""Penalties, biases, min_tokens, min_p, logprobs and n > 1 under speculation: exactly what plain decoding does."""

import math

import pytest
import torch
from tiny import tiny_native
from toy import (
    BigramModel,
    ScriptedDrafter,
    ScriptedTreeDrafter,
    assert_exact_distribution,
    exact_rule_probs,
    random_chain,
    sampled_outputs,
)

from specdecode.config import SamplingParams
from specdecode.drafters import DraftModelDrafter, HybridDrafter, NgramDrafter, NoDrafter
from specdecode.engine.engine import Engine
from specdecode.errors import SpecdecodeError
from specdecode.planner.budget import CostCurve
from specdecode.planner.planner import Planner
from specdecode.sampling import to_probs

PROMPT = [1, 2, 3, 4, 5, 6, 1, 2, 3, 9, 9, 1, 2]
RULES = dict(presence_penalty=0.7, frequency_penalty=0.4, repetition_penalty=1.3, logit_bias={5: 3.0, 7: -2.0},
             min_tokens=6)


@pytest.fixture(autouse=True)
def costs_as_given(monkeypatch):
    monkeypatch.setattr(Planner, "observe", lambda self, rows, seconds, *more: None)


@pytest.fixture(scope="module")
def target():
    return tiny_native("qwen2", seed=0)


def run(engine: Engine, prompt: list[int], params: SamplingParams) -> list[int]:
    return [t for step in engine.generate(prompt, params) for t in step.tokens]


def drafters(target, full):
    return {
        "draft-model": DraftModelDrafter(tiny_native("qwen2", seed=1), vocab_size=64),
        "draft-model-tree": DraftModelDrafter(tiny_native("qwen2", seed=1), vocab_size=64, width=3),
        "self-draft": DraftModelDrafter(target, vocab_size=64),
        "ngram-tree": NgramDrafter(branches=4),
        "hybrid": HybridDrafter(DraftModelDrafter(tiny_native("qwen2", seed=1), vocab_size=64)),
        "always-right": ScriptedDrafter(lambda toks, k: full[len(toks): len(toks) + k]),
        "scripted-tree": ScriptedTreeDrafter(lambda toks, k: full[len(toks): len(toks) + k], vocab=64),
    }


@pytest.mark.parametrize("k", [3, None])
def test_greedy_with_penalties_is_token_identical_to_plain_decoding(target, k):
    params = SamplingParams(max_new_tokens=30, **RULES)
    reference = run(Engine(target, NoDrafter()), PROMPT, params)
    assert reference != run(Engine(target, NoDrafter()), PROMPT, SamplingParams(max_new_tokens=30))
    full = PROMPT + reference
    for name, drafter in drafters(target, full).items():
        engine = Engine(target, drafter, num_draft_tokens=k, costs=CostCurve((1.0, 1.05, 1.1, 1.15, 1.2, 1.25)))
        assert run(engine, PROMPT, params) == reference, name
        if name == "always-right":
            assert engine.last.stats.acceptance_rate == 1.0  # a penalty at depth i saw the draft before it


def naive_penalised(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams,
                    eos: int) -> torch.Tensor:
    """The definition, one token at a time (what vLLM and OpenAI document)."""
    out = logits.clone().double()
    for token, bias in params.logit_bias.items():
        out[token] += bias
    if len(output) < params.min_tokens:
        out[eos] = -math.inf
    for token in set(prompt) | set(output):
        if out[token] > 0:
            out[token] /= params.repetition_penalty
        else:
            out[token] *= params.repetition_penalty
    for token in set(output):
        out[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    return out.float()


def test_penalties_mean_what_openai_and_vllm_document():
    vocab, eos = 8, 7
    chain = random_chain(vocab, 3, sharpness=3.0)
    params = SamplingParams(max_new_tokens=12, **{**RULES, "logit_bias": {5: 1.5, 2: -1.0}, "min_tokens": 4})
    prompt = [0, 1, 2]
    expected, prev = [], prompt[-1]
    while len(expected) < params.max_new_tokens:
        token = int(naive_penalised(chain[prev].log(), prompt, expected, params, eos).argmax())
        expected.append(token)
        if token == eos:
            break
        prev = token
    engine = Engine(BigramModel(chain, eos=(eos,)), NgramDrafter(), num_draft_tokens=4)
    assert run(engine, prompt, params) == expected


def test_sampling_with_penalties_keeps_the_penalised_targets_distribution(width=1):
    """Every output of three tokens, its exact probability under the penalised target, against 6000 runs with
    a draft model's chain, its rows penalised too (test_grammar.py's sampling test drafts a tree)."""
    vocab, eos, length, trials = 4, 3, 3, 6000
    target_chain, draft_chain = random_chain(vocab, 10), random_chain(vocab, 11, sharpness=2.0)
    params = SamplingParams(temperature=0.9, max_new_tokens=length, presence_penalty=0.8, frequency_penalty=0.5,
                            repetition_penalty=1.5, logit_bias={1: 0.7}, min_tokens=2, min_p=0.05)
    prompt = [0, 2]
    exact = exact_rule_probs(vocab, length, eos, prompt[-1], lambda prev, output: to_probs(
        naive_penalised(target_chain[prev].log(), prompt, output, params, eos), params))
    drafter = DraftModelDrafter(BigramModel(draft_chain), vocab_size=vocab, width=width)
    engine = Engine(BigramModel(target_chain, eos=(eos,)), drafter, num_draft_tokens=3)
    counts = sampled_outputs(engine, prompt, params, trials)
    assert engine.last.stats.drafted_tokens > 0
    assert_exact_distribution(counts, exact)


def test_min_p_drops_tokens_below_its_share_of_the_likeliest():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = to_probs(logits, SamplingParams(temperature=1.0, min_p=0.2))
    assert probs[0, 3] == 0 and probs[0, 2] > 0  # 0.05 < 0.2 * 0.5 <= 0.15
    assert torch.allclose(probs[0, :3], torch.tensor([0.5, 0.3, 0.15]) / 0.95)


def assert_same_logprobs(got, expected):
    """The chosen tokens' logprobs and the alternatives' ids agree; values to float32 rounding (a float model's
    torch matmuls may round a row differently with more rows beside it; the stored-block kernels do not, and the
    end-to-end tests check those bit for bit)."""
    assert len(got) == len(expected)
    for (value, top), (ref_value, ref_top) in zip(got, expected):
        assert value == pytest.approx(ref_value, abs=1e-5)
        assert [t for t, _ in top] == [t for t, _ in ref_top]
        assert [v for _, v in top] == pytest.approx([v for _, v in ref_top], abs=1e-5)


def test_logprobs_match_with_and_without_speculation(target):
    params = SamplingParams(max_new_tokens=25, logprobs=3, prompt_logprobs=2)
    plain = Engine(target, NoDrafter())
    steps = list(plain.generate(PROMPT, params))
    tokens = [t for s in steps for t in s.tokens]
    reference = [lp for s in steps for lp in s.logprobs]
    prompt_reference = plain.last.prompt_logprobs
    full = PROMPT + tokens
    for name, drafter in drafters(target, full).items():
        engine = Engine(target, drafter, num_draft_tokens=4)
        steps = list(engine.generate(PROMPT, params))
        assert [t for s in steps for t in s.tokens] == tokens, name
        assert_same_logprobs([lp for s in steps for lp in s.logprobs], reference)
        assert engine.last.prompt_logprobs == prompt_reference, name  # prompt rows: one chunk either way
    # and they are the model's: log-softmax of a whole forward over prompt + output
    with torch.inference_mode():
        cache = target.new_cache(1, 64)
        ids = torch.tensor([full])
        logits, _ = target(ids, torch.arange(len(full))[None], cache,
                           torch.ones(1, 1, len(full), len(full), dtype=torch.bool).tril(), 0, True)
    logp = logits[0].log_softmax(-1)
    for i, (value, top) in enumerate(reference):
        row = logp[len(PROMPT) - 1 + i]
        assert value == pytest.approx(float(row[tokens[i]]), abs=1e-4)
        assert [t for t, _ in top] == row.topk(3).indices.tolist()
        assert max(v for _, v in top) >= value  # the chosen token is greedy here: it is the top one
    assert prompt_reference[0] is None and len(prompt_reference) == len(PROMPT)
    for i, (value, top) in enumerate(prompt_reference[1:], start=1):
        assert value == pytest.approx(float(logp[i - 1, PROMPT[i]]), abs=1e-4) and len(top) == 2


def test_n_choices_share_one_prefill_and_each_is_its_own_run(target):
    """Followers copy the leader's prompt cache instead of a prefill forward; each choice is what it would be
    alone with its seed."""
    params = [SamplingParams(temperature=0.9, max_new_tokens=12, seed=40 + i, **RULES) for i in range(3)]
    alone = [run(Engine(target, DraftModelDrafter(tiny_native("qwen2", seed=1), vocab_size=64),
                        num_draft_tokens=3), PROMPT, p) for p in params]
    engine = Engine(target, DraftModelDrafter(tiny_native("qwen2", seed=1), vocab_size=64), num_draft_tokens=3)
    leader = engine.add(PROMPT, params[0])
    followers = [engine.add(PROMPT, p, leader=leader) for p in params[1:]]
    assert all(f.leader is leader for f in followers)
    out = {id(s): [] for s in [leader, *followers]}
    prefill_rows = []
    while engine.running:
        for seq, step in engine.step():
            out[id(seq)] += step.tokens
        prefill_rows.append(engine.last_step.prefill_rows)
    assert [out[id(s)] for s in [leader, *followers]] == alone
    assert sum(prefill_rows) == len(PROMPT)  # one prefill for three choices


def test_a_follower_whose_leader_leaves_prefills_itself(target):
    engine = Engine(target, NoDrafter())
    leader = engine.add(PROMPT, SamplingParams(max_new_tokens=5))
    follower = engine.add(PROMPT, SamplingParams(max_new_tokens=5), leader=leader)
    engine.remove(leader)
    tokens = []
    while engine.running:
        for _, step in engine.step():
            tokens += step.tokens
    assert tokens == run(Engine(target, NoDrafter()), PROMPT, SamplingParams(max_new_tokens=5))
    assert follower.finish_reason == "length"


@pytest.mark.parametrize("bad, message", [
    (dict(presence_penalty=3.0), "presence_penalty must be in"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logit_bias={3: 101.0}), "logit_bias"),
    (dict(min_p=1.5), "min_p"),
    (dict(logprobs=21), "logprobs must be in"),
])
def test_bad_settings_are_one_clear_error(bad, message):
    with pytest.raises(SpecdecodeError, match=message):
        SamplingParams(**bad)


def test_a_logit_bias_outside_the_vocabulary_is_refused(target):
    with pytest.raises(SpecdecodeError, match="outside the vocabulary"):
        Engine(target, NoDrafter()).check(PROMPT, SamplingParams(logit_bias={64: 1.0}))
