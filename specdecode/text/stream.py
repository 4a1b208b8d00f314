"""Token ids -> streamed text, one piece per token, with stop strings cut at the token that completes them.

Tokenizers merge bytes across tokens, so a token's text is the difference between decoding a short window of
recent ids with and without it (constant work per token, not a re-decode of everything). Text that may still
change is held back: an incomplete character (U+FFFD) and a tail that could be the start of a stop string.
A `tokenizers` backend does that window itself (its DecodeStream: one call a token instead of two decodes).
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


def decoder_of(tokenizer):
    """ids -> text, special tokens skipped: the `tokenizers` backend's own decode where transformers' wrapper adds
    nothing to it (no clean-up of spaces), which skips the wrapper's Python around every call (two calls a token,
    each a few tens of microseconds on a step's cold caches); else the tokenizer's `decode`. No tokenizer (a
    folder without its files, prompted with ids): no text, the ids alone."""
    if tokenizer is None:
        return lambda ids: ""
    if (backend := plain_backend(tokenizer)) is not None:
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def plain_backend(tokenizer):
    """The `tokenizers` backend whose decode gives the wrapper's text (no clean-up of spaces), or None."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if callable(getattr(backend, "decode", None)) and getattr(tokenizer, "clean_up_tokenization_spaces", True) is False:
        return backend
    return None


class TextStream:
    def __init__(self, tokenizer, stop: list[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self._decode = decoder_of(tokenizer)
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.text = ""  # all text decoded so far (cut at a stop string once one appears)
        self.sent = 0  # characters of `text` already released
        self.stopped = False
        self._prefix = 0  # window start: ids before it are settled text
        self._read = 0  # ids before it are already part of `text`
        backend = plain_backend(tokenizer)
        self._stream = None if backend is None else (backend, DecodeStream(skip_special_tokens=True))

    def push(self, tokens: list[int]) -> tuple[list[str], int]:
        """Add a step's tokens -> (text released with each kept token, how many of `tokens` are kept).

        Fewer tokens are kept when a stop string ends inside them; the text then ends before the stop string."""
        pieces = []
        for i, token in enumerate(tokens):
            search_from = max(0, len(self.text) - max(map(len, self.stop), default=0))
            self.ids.append(token)
            self.text += self._decode_next()
            hits = [pos for s in self.stop if (pos := self.text.find(s, search_from)) >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True
                pieces.append(self._release(hold=False))
                return pieces, i + 1
            pieces.append(self._release(hold=True))
        return pieces, len(tokens)

    def flush(self) -> str:
        """Everything not yet released, at the end of generation."""
        rest = self.text[self.sent :]
        self.sent = len(self.text)
        return rest

    def _decode_next(self) -> str:
        if self._stream is not None:  # the same window, kept by the backend: None while a character is incomplete
            backend, stream = self._stream
            try:
                return stream.step(backend, self.ids[-1]) or ""
            except Exception:  # noqa: BLE001 - a decoder it cannot stream (not prefix-stable): the window below
                self._stream = None
                self._prefix = self._read = len(self.ids) - 1  # this token's text alone, then windows as usual
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if after.endswith("\ufffd") or len(after) < len(before):
            return ""  # an incomplete multi-byte character: wait for the next token
        self._prefix, self._read = self._read, len(self.ids)
        return after[len(before) :]

    def _release(self, hold: bool) -> str:
        end = len(self.text)
        if hold:  # keep back a tail that a stop string could still complete
            for s in self.stop:
                for n in range(min(len(s) - 1, end - self.sent), 0, -1):
                    if self.text.endswith(s[:n], 0, end):
                        end -= n
                        break
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out
