"""Streaming detokenization and stop strings, with a byte-level tokenizer (nothing downloaded)."""

from specdecode.text import TextStream


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
