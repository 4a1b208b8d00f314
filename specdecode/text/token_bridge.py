"""Text between two tokenizers, for a draft model whose vocabulary is not the target's.

The draft reads the target's context as text in its own tokens, and its guesses come back as the target's tokens
for the target's text. Both directions work on bytes: each tokenizer's id -> bytes table is built once
(`Vocabulary`), so the context's text grows by the new tokens' bytes only, and only a short tail is tokenized again
each step (`DraftSide`): the draft tokens before it are kept, and with them the draft model's cache up to the
longest shared prefix. A draft's text goes back through the target's tokenizer behind the last few context tokens,
so a word the context ends in is split as the target splits it (`to_target`).

Nothing here decides what the target emits: the mapped tokens are point-mass proposals for the one verifier.
"""

from __future__ import annotations

import codecs
import json
import logging
from dataclasses import dataclass
from typing import Any

from specdecode.errors import SpecdecodeError

log = logging.getLogger(__name__)

RETOKENIZE_BACK = 4  # draft tokens re-read behind the new text each step: a merge rarely reaches further
TARGET_TAIL = 3  # context tokens the draft's text is tokenized behind, so its first word splits as the target's
# Text both tokenizers must carry byte for byte (unicode, whitespace runs, code) before a pair is accepted.
ROUND_TRIP_PROBES = ("Hello, world!\n", "def f(x):\n\treturn x ** 2  # square\n\n\n", "naïve café — 東京 🚀 ∑",
                     "    indented\r\n  \t mixed   spaces", "{\"key\": [1, 2.5e-3, null]}")


def byte_level_table() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte -> the byte."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


class Vocabulary:
    """One tokenizer seen as bytes: each id's bytes, and encoding a piece of text exactly (no dummy space)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.backend = tokenizer.backend_tokenizer  # the Rust tokenizer: encodes without Python-side overhead
        self.special = set(tokenizer.all_special_ids)
        self.bytes = self._id_bytes()
        # SentencePiece-style tokenizers put a space before every text they encode: a piece that starts with a
        # space is encoded without it, and the tokenizer puts it back.
        self.adds_space = self.text_of(self.encode("a")) == b" a"
        self.doubles_space = self.text_of(self.encode(" a")) == b"  a"  # the dummy goes before a space too

    def __len__(self) -> int:
        return len(self.bytes)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_piece(self, text: str) -> tuple[list[int], int]:
        """`text` that may follow other text -> (ids, bytes of a dummy space they carry in front: 1 only where a
        SentencePiece-style tokenizer reads text that starts with no space)."""
        if not self.adds_space:
            return self.encode(text), 0
        if not text.startswith(" "):
            return self.encode(text), 1
        if self.doubles_space or not text.startswith("  "):
            return self.encode(text[1:]), 0  # the dummy space it puts in front is the text's own
        return self.encode(text), 0  # it adds no dummy before a space

    def text_of(self, ids: list[int]) -> bytes:
        return b"".join(self.bytes[i] for i in ids)

    def _id_bytes(self) -> list[bytes]:
        vocab = self.tokenizer.get_vocab()
        size = max(max(vocab.values()) + 1, len(self.tokenizer))
        table: list[bytes] = [b""] * size
        added = {token.content for token in self.backend.get_added_tokens_decoder().values()}
        decoder = json.loads(self.backend.to_str()).get("decoder") or {}
        if _has_decoder(decoder, "ByteLevel"):
            chars = byte_level_table()
            for token, i in vocab.items():
                table[i] = token.encode() if token in added else bytes(chars.get(c, 0) for c in token)
        else:  # SentencePiece: '▁' is a space and byte fallback spells bytes as <0xNN>
            for token, i in vocab.items():
                if token in added:
                    table[i] = token.encode()
                elif len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
                    table[i] = bytes([int(token[3:5], 16)])
                else:
                    table[i] = token.replace("\u2581", " ").encode()
        return table


def _has_decoder(decoder: dict, kind: str) -> bool:
    return decoder.get("type") == kind or any(_has_decoder(d, kind) for d in decoder.get("decoders") or [])


@dataclass
class TokenBridge:
    """The target's and a draft's tokenizers, checked to carry the same text; shared by every request's drafter."""

    target: Vocabulary
    draft: Vocabulary

    @classmethod
    def between(cls, target_tokenizer: Any, draft_tokenizer: Any, target: str = "target",
                draft: str = "draft") -> TokenBridge:
        bridge = cls(Vocabulary(target_tokenizer), Vocabulary(draft_tokenizer))
        for probe in ROUND_TRIP_PROBES:
            for vocab, name in ((bridge.target, target), (bridge.draft, draft)):
                ids, lead = vocab.encode_piece(probe)
                if vocab.text_of(ids)[lead:] != probe.encode():
                    raise SpecdecodeError(f"the tokenizer of '{name}' does not carry text byte for byte (it "
                                          f"changes {probe!r}), so its drafts cannot be mapped: pick another draft")
        template = target_tokenizer.chat_template if isinstance(target_tokenizer.chat_template, str) else ""
        missing = sorted(t for t in target_tokenizer.all_special_tokens
                         if t in template and t not in draft_tokenizer.get_vocab())
        if missing:
            log.warning("draft '%s' lacks the target's special tokens %s: it reads them as plain text and guesses "
                        "less well around them", draft, ", ".join(missing))
        return bridge

    def to_target(self, context: list[int], guess: list[int]) -> tuple[list[int], list[int]]:
        """The draft's guessed tokens after `context` (target ids) -> (target ids, for each the index of the
        draft token its text ends in). The last one is kept though a word cut at the draft's last token may be a
        longer target token: it costs a verify row, while leaving it out cost a draft forward every step
        (measured: 1.26-1.40x against 1.25-1.28x plain decoding with it left out, BENCHMARKS.md)."""
        target = self.target
        tail, text = _tail(context, target)
        if text is None:
            return [], []
        guessed, ends = _valid_text(guess, self.draft)
        if not guessed:
            return [], []
        ids, lead = target.encode_piece(text + guessed)
        if lead or ids[: len(tail)] != tail:  # the draft's text merged into the context's last token
            return [], []
        tokens, owners, at = [], [], 0
        for token in ids[len(tail):]:
            at += len(target.bytes[token])
            owner = next((d for d, end in enumerate(ends) if end >= at), len(ends) - 1)
            tokens.append(token)
            owners.append(owner)
        return tokens, owners


def _tail(context: list[int], vocab: Vocabulary) -> tuple[list[int], str | None]:
    """The last few context tokens and their text, starting where the tokenizer starts a word."""
    for back in range(min(TARGET_TAIL, len(context)), min(len(context), 4 * TARGET_TAIL) + 1):
        tail = context[-back:]
        raw = vocab.text_of(tail)
        if vocab.adds_space and not raw.startswith(b" "):
            continue
        try:
            return tail, raw.decode()
        except UnicodeDecodeError:
            continue  # a character split across tokens: start further back
    return [], None


def _valid_text(guess: list[int], vocab: Vocabulary) -> tuple[str, list[int]]:
    """The draft tokens' text up to its last whole character -> (text, byte end of each token wholly in it)."""
    raw = vocab.text_of(guess)
    try:
        text = raw.decode()
    except UnicodeDecodeError as error:
        raw = raw[: error.start]
        text = raw.decode(errors="ignore")
    ends, at = [], 0
    for token in guess:
        at += len(vocab.bytes[token])
        if at > len(raw):
            break
        ends.append(at)
    return text, ends


class DraftSide:
    """One request's context in the draft's tokens, kept up to date from the target's tokens step by step."""

    def __init__(self, bridge: TokenBridge) -> None:
        self.bridge = bridge
        self.reset()

    def reset(self) -> None:
        self.read = 0  # target tokens whose bytes are in `text`
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.text = ""
        self.ids: list[int] = []  # the draft's tokens for `text`
        # Where the last tokenized piece began: draft index, character in `text`, dummy-space bytes in front.
        self.piece = (0, 0, 0)

    def update(self, context: list[int]) -> list[int] | None:
        """The draft's tokens for `context` (target ids, only ever extended within a request), or None while the
        text ends inside a character."""
        if len(context) < self.read:  # a new request reuses this drafter without reset: start over
            self.reset()
        if len(context) > self.read:
            self.text += self.decoder.decode(self.bridge.target.text_of(context[self.read :]))
            self.read = len(context)
            start, at, _ = self.piece = self._anchor()
            ids, lead = self.bridge.draft.encode_piece(self.text[at:])
            self.ids = self.ids[:start] + ids
            self.piece = (start, at, lead)
        if self.decoder.getstate()[0]:
            return None
        return self.ids

    def _anchor(self) -> tuple[int, int, int]:
        """A draft token boundary a few tokens back, at a known character of `text`: tokenizing from there
        again costs a few tokens, not the whole context."""
        start, at, lead = self.piece
        vocab = self.bridge.draft
        for index in range(len(self.ids) - RETOKENIZE_BACK, start, -1):
            raw = vocab.text_of(self.ids[start:index])[lead:]
            try:
                piece = raw.decode()
            except UnicodeDecodeError:
                continue
            if not self.text.startswith(piece, at):
                return self.piece  # the tokenizer normalised this text: tokenize the whole piece again
            if not vocab.adds_space or self.text.startswith(" ", at + len(piece)):
                return index, at + len(piece), 0
        return self.piece
