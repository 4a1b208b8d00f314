"""Streaming detokenization and stop strings, with a byte-level tokenizer (nothing downloaded)."""

from specdecode.text.stream import TextStream, decoder_of


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


def test_a_metaspace_backend_streams_a_full_decodes_text_across_a_skipped_special_token():
    """Llama-2 style tokenizers: '▁' for spaces, a special token mid-answer. The streamed text is what decoding all
    the ids at once gives."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    backend.train_from_iterator(["hello world, héllo wörld 世界 " * 3],
                                trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<|end|>"]))
    wrapped = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)
    end = wrapped.convert_tokens_to_ids("<|end|>")
    ids = wrapped.encode("hello", add_special_tokens=False) + [end] + wrapped.encode(" world héllo",
                                                                                     add_special_tokens=False)
    for step in (1, 3):
        stream, pieces = TextStream(wrapped), []
        for at in range(0, len(ids), step):
            pieces += stream.push(ids[at : at + step])[0]
        assert "".join(pieces) + stream.flush() == wrapped.decode(ids, skip_special_tokens=True)


def test_a_stream_the_backend_cannot_follow_falls_back_to_the_window():
    class Refusing:
        def step(self, backend, token):
            raise RuntimeError("not prefix-stable")

    text = "abc déf"
    stream = TextStream(ByteTokenizer())
    stream._stream = (None, Refusing())
    pieces, kept = stream.push(ByteTokenizer().encode(text))
    assert "".join(pieces) + stream.flush() == text and kept == len(text.encode()) and stream._stream is None
