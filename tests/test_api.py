"""The text layer over the engine: stop strings inside drafts, clear errors for bad input."""

import pytest
from test_text import ByteTokenizer
from tiny import tiny_native
from toy import ScriptedDrafter

from specdecode.api import SpecDecoder
from specdecode.config import SamplingParams
from specdecode.drafters import NoDrafter
from specdecode.errors import SpecdecodeError
from specdecode.weights.loading import check_same_tokenizer


class SmallByteTokenizer(ByteTokenizer):
    """Bytes folded into the tiny model's 64-token vocabulary (printable ASCII from '0')."""

    def encode(self, text: str) -> list[int]:
        return [max(0, min(63, b - 48)) for b in text.encode()]

    def decode(self, ids, skip_special_tokens=True) -> str:
        return bytes(i + 48 for i in ids).decode()

    def get_vocab(self) -> dict[str, int]:
        return {chr(i + 48): i for i in range(64)}


def decoder(drafter, k=4):
    return SpecDecoder(tiny_native("qwen2", seed=0), SmallByteTokenizer(), drafter, "test", k, max_len=64)


def test_stop_string_inside_a_draft_cuts_exactly():
    plain = decoder(NoDrafter()).generate("123", SamplingParams(max_new_tokens=20))
    stop = plain.text[5:7]
    expect = plain.text[: plain.text.index(stop)]
    full = [t for t in plain.token_ids]
    right = ScriptedDrafter(lambda toks, k: full[len(toks) - 3: len(toks) - 3 + k])
    for drafter in (NoDrafter(), right):
        sd = decoder(drafter, k=6)
        out = sd.generate("123", SamplingParams(max_new_tokens=20, stop=[stop]))
        assert out.text == expect and out.finish_reason == "stop"
        assert out.token_ids == full[: len(expect) + len(stop)]  # up to the token that completes the stop
        assert sd.stats.new_tokens == len(out.token_ids)


def test_prompt_longer_than_the_context_is_a_clear_error():
    with pytest.raises(SpecdecodeError, match="context window"):
        decoder(NoDrafter()).generate("1" * 80, SamplingParams(max_new_tokens=4))


def test_mismatched_tokenizers_are_refused():
    class Other(SmallByteTokenizer):
        def get_vocab(self):
            return {"a": 0}

    with pytest.raises(SpecdecodeError, match="different tokenizers"):
        check_same_tokenizer(SmallByteTokenizer(), Other(), "t", "d")


def test_generating_on_another_thread_than_the_models_were_loaded_on_warns_once():
    import threading
    import warnings

    sd = decoder(NoDrafter())
    caught: list = []

    def generate_twice() -> None:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            sd.generate("12", SamplingParams(max_new_tokens=2))
            sd.generate("12", SamplingParams(max_new_tokens=2))
        caught.extend(w for w in seen if issubclass(w.category, RuntimeWarning))

    thread = threading.Thread(target=generate_twice)
    thread.start()
    thread.join()
    assert len(caught) == 1 and "thread" in str(caught[0].message)


def test_n_answers_are_each_what_generate_gives_with_its_seed():
    params = SamplingParams(max_new_tokens=12, temperature=0.9, seed=5, logprobs=2, stop=["9"])
    drafter = ScriptedDrafter(lambda toks, k: [1] * k)  # a sampled run's numbers depend on its drafts: the same
    alone = [decoder(drafter).generate("123", SamplingParams(**{**params.__dict__, "seed": 5 + i})) for i in range(3)]
    many = decoder(drafter).generate_n("123", params, 3)
    assert [(g.text, g.token_ids, g.finish_reason) for g in many] == [(g.text, g.token_ids, g.finish_reason)
                                                                       for g in alone]
    assert all(len(g.logprobs) == len(g.token_ids) for g in many)  # cut with the text at a stop string
    with pytest.raises(SpecdecodeError, match="n must be"):
        decoder(NoDrafter()).generate_n("123", params, 0)
