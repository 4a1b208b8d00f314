"""Structured output under speculation: grammar masks walk the draft tree exactly, drafts are cut where the
grammar rejects them, forced tokens are free drafts, and the output is exactly constrained plain decoding's."""

import json

import pytest
import torch
from test_cross_tokenizer import byte_level
from tiny import tiny_native
from toy import BigramModel, assert_exact_distribution, exact_rule_probs, random_chain, sampled_outputs

from specdecode.config import SamplingParams
from specdecode.drafters import DraftModelDrafter, HybridDrafter, NgramDrafter, NoDrafter
from specdecode.engine.engine import Engine
from specdecode.errors import SpecdecodeError
from specdecode.planner.planner import Planner
from specdecode.rules import OutputRules
from specdecode.rules.grammar import GrammarCompiler
from specdecode.sampling import to_probs

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "ok"],
          "properties": {"name": {"type": "string", "maxLength": 12}, "ok": {"type": "boolean"}}}


@pytest.fixture(autouse=True)
def costs_as_given(monkeypatch):
    monkeypatch.setattr(Planner, "observe", lambda self, rows, seconds, *more: None)


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level(300)


@pytest.fixture(scope="module")
def compiler(tokenizer):
    return GrammarCompiler(tokenizer, len(tokenizer), (tokenizer.eos_token_id,))


def run(engine, prompt, params):
    return [t for step in engine.generate(prompt, params) for t in step.tokens]


def fresh_mask(constraint, path: list[int], vocab: int) -> torch.Tensor:
    """What a matcher fed `path` from scratch allows next."""
    state = constraint.matcher()
    state.advance(path)
    logits = torch.zeros(1, vocab)
    state.mask(logits, [], [], [-1])
    return logits[0] > float("-inf")


def test_masks_of_a_draft_tree_are_each_paths_own(tokenizer, compiler):
    vocab = len(tokenizer)
    constraint = compiler.json_schema(SCHEMA)
    text = tokenizer.encode('{"name": "ab", "ok": true}', add_special_tokens=False)
    wrong = tokenizer.encode("x", add_special_tokens=False)[0]
    params = SamplingParams(grammar=constraint)
    rules = OutputRules(params, [1, 2], (tokenizer.eos_token_id,))
    rules.emitted(text[:2])
    # a tree under the output so far: the true next tokens as a chain, a wrong sibling at depth 1, a wrong child
    tokens = [text[2], wrong, text[3], text[4], wrong]
    parents = [-1, -1, 0, 2, 2]
    kept = rules.cut(tokens, parents)
    assert kept == [0, 2, 3]  # the wrong nodes go; nothing under a dropped node stays
    before = fresh_mask(constraint, text[:2], vocab)
    kept_tokens, kept_parents = [tokens[i] for i in kept], [-1, 0, 1]
    shaped = rules.shape(torch.zeros(4, vocab), torch.tensor(kept_tokens), torch.tensor(kept_parents))
    paths = [text[:2], text[:3], text[:4], text[:5]]
    for row, path in enumerate(paths):
        assert torch.equal(shaped[row] > float("-inf"), fresh_mask(constraint, path, vocab)), row
    after = rules.shape(torch.zeros(1, vocab))[0] > float("-inf")
    assert torch.equal(before, after)  # the walk left the request's state where it was


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_constrained_output_is_plain_constrained_decodings_for_every_drafter(tokenizer, compiler, temperature):
    vocab = len(tokenizer)
    target = tiny_native("qwen2", seed=0, vocab_size=vocab)
    prompt = tokenizer.encode("Give JSON:", add_special_tokens=False)
    params = SamplingParams(max_new_tokens=40, temperature=temperature, seed=7, grammar=compiler.json_schema(SCHEMA))
    reference = run(Engine(target, NoDrafter()), prompt, params)
    text = tokenizer.decode(reference, skip_special_tokens=True)
    assert text.startswith("{")
    drafters = {
        "draft-model": DraftModelDrafter(tiny_native("qwen2", seed=1, vocab_size=vocab), vocab_size=vocab),
        "draft-model-tree": DraftModelDrafter(tiny_native("qwen2", seed=1, vocab_size=vocab), vocab_size=vocab,
                                              width=3),
        "self-draft": DraftModelDrafter(target, vocab_size=vocab),
        "subset-head": subset_head(vocab),
        "ngram-tree": NgramDrafter(branches=3),
        "hybrid": HybridDrafter(DraftModelDrafter(tiny_native("qwen2", seed=1, vocab_size=vocab), vocab_size=vocab)),
    }
    for name, drafter in drafters.items():
        engine = Engine(target, drafter, num_draft_tokens=4)
        out = run(engine, prompt, params)
        if temperature == 0:
            assert out == reference, name
        else:  # a sampled run draws its random numbers differently: its distribution is tested on a toy below
            assert params.grammar.matcher().matcher.validate_tokens(out) == len(out), name
        if name == "self-draft":  # its drafts follow the same mask: the target accepts all of them (greedy)
            assert engine.last.stats.drafted_tokens > 0
            assert temperature > 0 or engine.last.stats.acceptance_rate == 1.0


def test_forced_tokens_are_free_drafts(tokenizer, compiler):
    vocab = len(tokenizer)
    target = tiny_native("qwen2", seed=0, vocab_size=vocab)
    schema = {"type": "object", "required": ["status"], "additionalProperties": False,
              "properties": {"status": {"const": "all good and done"}},
              "x-guidance": {"whitespace_flexible": False}}  # no blank space: everything after "{" is forced
    params = SamplingParams(max_new_tokens=40, grammar=compiler.json_schema(schema))
    prompt = tokenizer.encode("JSON:", add_special_tokens=False)
    reference = run(Engine(target, NoDrafter()), prompt, params)
    engine = Engine(target, NoDrafter(), num_draft_tokens=4)
    assert run(engine, prompt, params) == reference
    assert json.loads(tokenizer.decode(reference, skip_special_tokens=True)) == {"status": "all good and done"}
    drafted, accepted = engine.last.stats.by_drafter["grammar"]
    assert accepted == drafted > 5  # the grammar's forced tokens, every one accepted


def subset_head(vocab: int) -> DraftModelDrafter:
    """A draft whose LM head scores every third token only: rows where the grammar allows none of them get no
    children (their argmax would be a token the grammar rejects)."""
    from specdecode.weights.vocab_subset import restrict_lm_head

    model = tiny_native("qwen2", seed=1, vocab_size=vocab)
    return DraftModelDrafter(model, vocab_size=vocab, width=2,
                             head_tokens=restrict_lm_head(model, torch.arange(0, vocab, 3)))


class NoRepeatGrammar:
    """A toy grammar: a token may not follow itself, and token 3 (EOS) is allowed only after token 0."""

    def matcher(self):
        return NoRepeatState()


class NoRepeatState:
    def __init__(self) -> None:
        self.last = -1

    @staticmethod
    def allows(last: int, token: int) -> bool:
        return token != last and (token != 3 or last == 0)

    def path_end(self, tokens, parents, node):
        return self.last if node < 0 else tokens[node]

    def legal_nodes(self, tokens, parents):
        legal = []
        for node, (token, parent) in enumerate(zip(tokens, parents)):
            if (parent < 0 or parent in legal) and self.allows(self.path_end(tokens, parents, parent), token):
                legal.append(node)
        return legal

    def mask(self, logits, tokens, parents, rows):
        for row, node in enumerate(rows):
            last = self.path_end(tokens, parents, node)
            for token in range(logits.shape[1]):
                if not self.allows(last, token):
                    logits[row, token] = float("-inf")

    def forced(self, limit):
        return [0] if self.last == 2 else []  # not truly forced: a draft all the same, verified like any other

    def advance(self, tokens):
        if tokens:
            self.last = tokens[-1]


def test_sampling_under_a_grammar_keeps_the_masked_targets_distribution(width=2):
    """A draft model's tree (siblings drawn without replacement from masked, penalised rows); test_rules.py's
    sampling test drafts a chain."""
    vocab, eos, length, trials = 4, 3, 3, 6000
    target_chain, draft_chain = random_chain(vocab, 10), random_chain(vocab, 11, sharpness=2.0)
    params = SamplingParams(temperature=1.0, max_new_tokens=length, grammar=NoRepeatGrammar(), presence_penalty=0.5)

    def next_probs(prev: int, output: list[int]) -> torch.Tensor:
        logits = target_chain[prev].log().clone()
        for t in set(output):
            logits[t] -= 0.5
        for t in range(vocab):
            if not NoRepeatState.allows(output[-1] if output else -1, t):
                logits[t] = float("-inf")
        return to_probs(logits, params)

    exact = exact_rule_probs(vocab, length, eos, 1, next_probs)
    drafter = DraftModelDrafter(BigramModel(draft_chain), vocab_size=vocab, width=width)
    engine = Engine(BigramModel(target_chain, eos=(eos,)), drafter, num_draft_tokens=3)
    counts = sampled_outputs(engine, [0, 1], params, trials)
    assert_exact_distribution(counts, {s: p for s, p in exact.items() if p > 0})


def test_unsupported_schemas_are_one_clear_error(compiler):
    with pytest.raises(SpecdecodeError, match="not supported: Invalid type"):
        compiler.json_schema({"type": "nope"})
    with pytest.raises(SpecdecodeError, match="not supported"):
        compiler.json_schema({"type": "string", "minLength": 5, "maxLength": 2})



@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("vocab", [64, 100, 1000])
def test_a_bitmask_keeps_exactly_its_tokens(monkeypatch, native, vocab):
    """Bit j of word w allows token 32 w + j, on the native kernel and off it, a vocabulary of whole words or not."""
    from specdecode.rules import grammar

    if not native:
        monkeypatch.setattr(grammar, "cpu_kernels", lambda: None)
    g = torch.Generator().manual_seed(vocab)
    bits = torch.randint(-(2**31), 2**31 - 1, (3, (vocab + 31) // 32), generator=g, dtype=torch.int32)
    bits[1] = -1  # every token allowed
    logits = torch.randn(3, vocab, generator=g)
    out = logits.clone()
    grammar.apply_bitmask(out, bits)
    allowed = torch.tensor([[bool((int(bits[r, t // 32]) >> (t % 32)) & 1) for t in range(vocab)] for r in range(3)])
    assert torch.equal(out, logits.masked_fill(~allowed, float("-inf")))


def test_drafts_past_the_end_of_the_text_leave_the_grammar_where_it_was(tokenizer, compiler):
    """A tree with EOS twice on a path and a branch beside it: cut and masks neither fail nor move the request's
    state (an EOS on a stopped matcher counts no token, so walks never go past one)."""
    vocab, eos = len(tokenizer), tokenizer.eos_token_id
    constraint = compiler.json_schema(SCHEMA)
    rules = OutputRules(SamplingParams(grammar=constraint), [1], (eos,))
    text = tokenizer.encode('{"name": "ab", "ok": true}', add_special_tokens=False)
    rules.emitted(text[:-1])
    close = text[-1]
    tokens, parents = [close, eos, eos, close, eos], [-1, 0, 1, -1, 3]
    kept = rules.cut(tokens, parents)
    assert kept == [0, 1, 3, 4]  # nothing after an EOS
    kept_parents = [-1, 0, -1, 2]
    shaped = rules.shape(torch.zeros(5, vocab), torch.tensor([tokens[i] for i in kept]), torch.tensor(kept_parents))
    for row in (2, 4):  # after EOS: only EOS
        assert (shaped[row] > float("-inf")).nonzero().flatten().tolist() == [eos]
    assert torch.equal(shaped[0] > float("-inf"), fresh_mask(constraint, text[:-1], vocab))
    assert torch.equal(rules.shape(torch.zeros(1, vocab))[0] > float("-inf"), fresh_mask(constraint, text[:-1], vocab))


def test_min_tokens_cannot_keep_a_finished_grammar_from_ending(tokenizer, compiler):
    vocab = len(tokenizer)
    target = tiny_native("qwen2", seed=0, vocab_size=vocab, eos_token_id=tokenizer.eos_token_id)
    schema = {"type": "object", "required": ["s"], "additionalProperties": False, "properties": {"s": {"const": "x"}},
              "x-guidance": {"whitespace_flexible": False}}
    params = SamplingParams(max_new_tokens=40, min_tokens=30, grammar=compiler.json_schema(schema))
    engine = Engine(target, NoDrafter())
    out = run(engine, tokenizer.encode("JSON:", add_special_tokens=False), params)
    assert json.loads(tokenizer.decode(out, skip_special_tokens=True)) == {"s": "x"}
    assert engine.last.finish_reason == "stop"
