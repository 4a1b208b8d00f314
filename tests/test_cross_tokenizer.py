"""A draft model with another tokenizer: the text mapping round-trips, greedy output is plain decoding's, and the
sampled output has exactly the target's distribution. Tokenizers are trained here on a few lines (a byte-level BPE
and a SentencePiece-style one with byte fallback); nothing is downloaded."""

from __future__ import annotations

import json
import random

import pytest
from tiny import tiny_native
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from toy import BigramModel, assert_exact_distribution, exact_sequence_probs, random_chain
from transformers import PreTrainedTokenizerFast

from specdecode.config import SamplingParams
from specdecode.drafters import DraftModelDrafter, HybridDrafter, NoDrafter
from specdecode.drafters.cross_tokenizer import CrossTokenizerDrafter
from specdecode.engine.engine import Engine
from specdecode.errors import SpecdecodeError
from specdecode.kernels import cpu_kernels
from specdecode.planner.budget import CostCurve
from specdecode.planner.planner import Planner
from specdecode.text.token_bridge import DraftSide, TokenBridge
from specdecode.weights import hub
from specdecode.weights.quantize import quantize_

CORPUS = ["def add(a, b):\n    return a + b\n", "The quick brown fox jumps over the lazy dog.",
          "naïve café — 東京 🚀", "for i in range(10):\n\tprint(i * i)\n", "{\"key\": [1, 2.5e-3, null]}",
          "Hello, world! Hello again, world."] * 4
ADVERSARIAL = ["  leading spaces and trailing   ", "tabs\t\tand\nnew\n\n\nlines\r\n", "emoji 🚀🚀 and 東京 and é",
               "def f(x):\n    return {'a': [x, x ** 2]}  # code\n", "   \n  \t ", "ünïcödé «quotes» — dash"]


def byte_level(size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=size, special_tokens=["<|end|>"],
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|end|>")


def sentencepiece_like(size: int) -> PreTrainedTokenizerFast:
    """Metaspace words (a dummy space before every text) and bytes spelt <0xNN> for what the vocabulary lacks."""
    trained = Tokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=size))
    spec = json.loads(trained.to_str())["model"]
    vocab = {"<s>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}}
    vocab.update({token: len(vocab) + i for i, token in enumerate(spec["vocab"])})
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in spec["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="always")
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<s>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<s>")


@pytest.fixture(scope="module")
def tokenizers():
    return {"byte-level": byte_level(300), "sentencepiece": sentencepiece_like(200), "byte-level-b": byte_level(420)}


@pytest.fixture(autouse=True)
def costs_as_given(monkeypatch):
    monkeypatch.setattr(Planner, "observe", lambda self, rows, seconds, *more: None)


def bridge_of(tokenizers, target: str, draft: str) -> TokenBridge:
    return TokenBridge.between(tokenizers[target], tokenizers[draft])


PAIRS = [("byte-level", "sentencepiece"), ("sentencepiece", "byte-level"), ("byte-level", "byte-level-b")]


@pytest.mark.parametrize("pair", PAIRS)
def test_the_drafts_view_of_the_context_is_its_text_whichever_way_it_grows(tokenizers, pair):
    """Target tokens arrive a few at a time (split characters included); the draft's tokens always spell the
    text so far, and match tokenizing it whole where the tokenizer's merges allow."""
    bridge = bridge_of(tokenizers, *pair)
    rng = random.Random(0)
    for text in ADVERSARIAL + CORPUS[:6]:
        target_ids = bridge.target.encode(text)
        side, at = DraftSide(bridge), 0
        while at < len(target_ids):
            at = min(len(target_ids), at + rng.randint(1, 3))
            ids = side.update(target_ids[:at])
            prefix = bridge.target.text_of(target_ids[:at])
            if ids is None:  # the text ends inside a character
                with pytest.raises(UnicodeDecodeError):
                    prefix.decode()
                continue
            spelt = bridge.draft.text_of(ids)
            lead = len(spelt) - len(prefix)  # a SentencePiece draft's dummy space before the text
            assert lead in (0, int(bridge.draft.adds_space)) and spelt[lead:] == prefix


@pytest.mark.parametrize("pair", PAIRS)
def test_a_guess_comes_back_as_the_targets_own_tokens(tokenizers, pair):
    bridge = bridge_of(tokenizers, *pair)
    for text in CORPUS[:6]:
        cut = len(text) // 2
        context = bridge.target.encode(text[:cut])
        rest = text[cut:]
        guess, lead = bridge.draft.encode_piece(rest)
        if lead:  # a SentencePiece draft reads text after a word boundary only
            continue
        mapped, owners = bridge.to_target(context, guess)
        full = bridge.target.encode(text)
        assert owners == sorted(owners) and all(0 <= o < len(guess) for o in owners)
        # The context's own tokens may be split differently from the whole text's: compare where they agree.
        if full[: len(context)] == context:
            # The last token may be cut short where the text ends; every one before it is the target's own.
            assert mapped[:-1] == full[len(context):][: len(mapped) - 1]
            assert len(mapped) >= len(full) - len(context) - 1


def test_a_tokenizer_that_changes_text_is_refused(tokenizers):
    lossy = byte_level(300)
    lossy.backend_tokenizer.normalizer = __import__("tokenizers").normalizers.Lowercase()
    with pytest.raises(SpecdecodeError, match="byte for byte"):
        TokenBridge.between(tokenizers["byte-level"], lossy, "t", "lowercasing-draft")


def engines(target, draft_model, bridge, auto: bool):
    def drafter():
        return CrossTokenizerDrafter(DraftModelDrafter(draft_model, vocab_size=len(bridge.draft)), bridge)

    costs = CostCurve(tuple(1.0 + 0.08 * m for m in range(16))) if auto else None
    k = None if auto else 4
    return (Engine(target, drafter(), num_draft_tokens=k, costs=costs),
            Engine(target, HybridDrafter(drafter()), num_draft_tokens=k, costs=costs))


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("auto", [False, True])
def test_greedy_output_is_plain_decodings_with_a_draft_of_another_tokenizer(tokenizers, pair, auto):
    bridge = bridge_of(tokenizers, *pair)
    target = tiny_native("qwen2", seed=0, vocab_size=len(bridge.target))
    draft = tiny_native("llama", seed=1, vocab_size=len(bridge.draft))
    params = SamplingParams(max_new_tokens=40)
    drafted = 0
    for text in CORPUS[:3]:
        prompt = bridge.target.encode(text)
        plain = [t for s in Engine(target, NoDrafter()).generate(prompt, params) for t in s.tokens]
        for engine in engines(target, draft, bridge, auto):
            assert [t for s in engine.generate(prompt, params) for t in s.tokens] == plain
            drafted += engine.last.stats.drafted_tokens
    assert drafted  # the mapped drafts did reach the verifier


@pytest.mark.skipif(cpu_kernels() is None, reason="row-exact batching needs the native CPU kernel")
def test_greedy_output_is_the_same_in_a_batch_with_drafts_of_another_tokenizer(tokenizers):
    """Requests drafted through the text mapping, batched with each other and with plain ones, arriving at
    different steps: each gives plain decoding's tokens."""
    from test_batch import WIDE, cycle, run_batch

    bridge = bridge_of(tokenizers, "byte-level", "sentencepiece")
    target = quantize_(tiny_native("qwen2", seed=0, vocab_size=len(bridge.target), **WIDE), "q8_0")
    draft = quantize_(tiny_native("qwen2", seed=1, vocab_size=len(bridge.draft), **WIDE), "q8_0")
    make = cycle(lambda: CrossTokenizerDrafter(DraftModelDrafter(draft, vocab_size=len(bridge.draft)), bridge),
                 NoDrafter)
    requests = [(bridge.target.encode(text), SamplingParams(max_new_tokens=24)) for text in CORPUS[:4]]
    together = run_batch(Engine(target, make, 3), requests, arrivals=[0, 1, 1, 3])
    for (prompt, params), out in zip(requests, together):
        assert out == [t for s in Engine(target, NoDrafter()).generate(prompt, params) for t in s.tokens]


def test_a_draft_that_knows_the_answer_is_accepted_through_the_text(tokenizers):
    """The target drafting for itself through two tokenizations of the same text: what it guesses is right, so
    the mapped tokens are accepted (the mapping keeps the right tokens, not merely harmless ones)."""
    tok = tokenizers["byte-level"]
    bridge = TokenBridge.between(tok, tok)
    target = tiny_native("qwen2", seed=0, vocab_size=len(bridge.target))
    prompt = bridge.target.encode(CORPUS[0])
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    engine = Engine(target, CrossTokenizerDrafter(DraftModelDrafter(target, vocab_size=len(bridge.draft)), bridge),
                    num_draft_tokens=4)
    out = [t for s in engine.generate(prompt, params) for t in s.tokens]
    assert out == [t for s in Engine(target, NoDrafter()).generate(prompt, params) for t in s.tokens]
    stats = engine.last.stats
    assert stats.drafted_tokens and stats.accepted_tokens >= 0.5 * stats.drafted_tokens


def char_tokenizer(merges: list[str], order: str) -> PreTrainedTokenizerFast:
    """Single characters of `order` (their ids in that order) and merged pairs after them."""
    vocab = {c: i for i, c in enumerate(order)}
    vocab.update({m: len(vocab) + i for i, m in enumerate(merges)})
    tok = Tokenizer(models.BPE(vocab, [tuple(m) for m in merges]))
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


@pytest.mark.parametrize("auto", [False, True])
def test_sampled_output_is_the_targets_distribution_with_a_draft_of_another_tokenizer(auto):
    """Bigram target over the characters a b c d (d ends the answer); the draft's tokenizer orders them otherwise
    and merges 'ab' and 'ca'. Every sampled output of 3 tokens counts against the exact distribution."""
    vocab, eos, trials, length = 4, 3, 6000, 3
    target_tok, draft_tok = char_tokenizer([], "abcd"), char_tokenizer(["ab", "ca"], "dcba")
    bridge = TokenBridge.__new__(TokenBridge)
    from specdecode.text.token_bridge import Vocabulary

    bridge.target, bridge.draft = Vocabulary(target_tok), Vocabulary(draft_tok)
    target_chain = random_chain(vocab, 10)
    draft_chain = random_chain(len(bridge.draft), 11, sharpness=2.0)
    params = SamplingParams(temperature=1.0, max_new_tokens=length)
    exact = exact_sequence_probs(target_chain, start=0, length=length, eos=eos)
    drafter = CrossTokenizerDrafter(DraftModelDrafter(BigramModel(draft_chain), vocab_size=len(bridge.draft)),
                                    bridge)
    engine = Engine(BigramModel(target_chain, eos=(eos,)), drafter, num_draft_tokens=None if auto else 3,
                    costs=CostCurve((1.0, 1.2, 1.4, 1.6)) if auto else None)
    counts: dict[tuple, int] = {}
    drafted = 0
    for seed in range(trials):
        out = tuple(t for s in engine.generate([0], SamplingParams(**{**params.__dict__, "seed": seed}))
                    for t in s.tokens)
        counts[out] = counts.get(out, 0) + 1
        drafted += engine.last.stats.drafted_tokens
    assert drafted > trials / 4  # the draft did propose
    assert_exact_distribution(counts, exact)


def models_present(*names: str) -> bool:
    return all(hub.model_path(n).is_file() for n in names)


@pytest.mark.e2e
@pytest.mark.skipif(not models_present("smollm2-135m-instruct", "qwen2.5-coder-1.5b-instruct"),
                    reason="SmolLM2 and Qwen2.5-Coder-1.5B are not pulled")
def test_smollm2_drafts_for_qwen_and_the_output_is_plain_decodings():
    from specdecode.api import SpecDecoder

    prompt = [{"role": "user", "content": "Write a Python function that reverses a list."}]
    params = SamplingParams(max_new_tokens=24)
    plain = SpecDecoder.load("qwen2.5-coder-1.5b-instruct", method="none").generate(prompt, params, chat=True)
    spec = SpecDecoder.load("qwen2.5-coder-1.5b-instruct", draft="smollm2-135m-instruct", method="draft")
    out = spec.generate(prompt, params, chat=True)
    assert out.token_ids == plain.token_ids
    assert out.stats.accepted_tokens > 0
