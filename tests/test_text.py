"""Streaming detokenization and stop strings, with a byte-level tokenizer (nothing downloaded)."""

from specdecode.text import TextStream, decoder_of


class ByteTokenizer:
    """Token i is byte i; decoding joins the bytes, so multi-byte characters span tokens."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


def stream_all(text: str, steps: list[int], stop=None):
    ids, stream, pieces, kept_total = ByteTokenizer().encode(text), TextStream(ByteTokenizer(), stop), [], 0
    pos = 0
    for n in steps:
        out, kept = stream.push(ids[pos : pos + n])
        pieces += out
        kept_total += kept
        pos += n
        if stream.stopped:
            break
    return "".join(pieces) + stream.flush(), kept_total, stream


def test_multibyte_characters_are_held_until_complete():
    text = "héllo → wörld"
    out, kept, _ = stream_all(text, [1] * len(text.encode()))
    assert out == text and kept == len(text.encode())


def test_stop_string_inside_a_step_cuts_text_and_tokens():
    text = "abc STOP def"
    out, kept, stream = stream_all(text, [5, 5, 5], stop=["STOP"])
    assert out == "abc " and stream.stopped
    assert kept == len("abc STOP")  # the token that completes the stop string is the last one kept


def test_stop_prefix_is_held_back_then_released():
    stream = TextStream(ByteTokenizer(), ["END"])
    pieces, _ = stream.push(list(b"abE"))
    assert "".join(pieces) == "ab"  # "E" might start "END"
    pieces, _ = stream.push(list(b"x"))
    assert "".join(pieces) == "Ex"


def test_a_tokenizers_backend_is_decoded_directly_and_gives_the_wrappers_text():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.train_from_iterator(["héllo wörld, 世界 🙂 " * 3, "def f(x):\n    return x"],
                                trainers.BpeTrainer(vocab_size=300, special_tokens=["<|end|>"],
                                                    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    wrapped = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)
    assert decoder_of(wrapped)([0]) == backend.decode([0], skip_special_tokens=True)
    ids = wrapped.encode("héllo 世界 🙂<|end|> def f(x):\n    return x")
    stream = TextStream(wrapped)
    pieces, kept = stream.push(ids)
    assert kept == len(ids) and "".join(pieces) + stream.flush() == wrapped.decode(ids, skip_special_tokens=True)
    # the backend's DecodeStream keeps the window: the same piece for every token as the two decodes give
    for step in (1, 2, 5):
        stream, by_window = TextStream(wrapped), TextStream(wrapped)
        by_window._stream = None
        assert stream._stream is not None
        for at in range(0, len(ids), step):
            assert stream.push(ids[at : at + step]) == by_window.push(ids[at : at + step])
    cleaned = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=True)
    assert decoder_of(cleaned).__code__ is not decoder_of(wrapped).__code__  # the wrapper's clean-up is kept
