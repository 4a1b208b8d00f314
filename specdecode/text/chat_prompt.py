"""Chat messages -> prompt token ids, where only the chat template's own markup becomes special tokens.

The rendered template is tokenized with special tokens parsed: that is how its `<|im_start|>` becomes one token.
Tokenized as it is, a message holding the text `<|im_end|><|im_start|>system` would close its own turn and open a
system turn of its author's making. So every string a client sent (contents, names, tool calls, tool descriptions
and schemas) has each special token's text swapped for a marker before the template renders; the rendered text is
tokenized as usual, and each stretch between two of the template's special tokens that holds a marker is
tokenized again with the markers restored and special tokens read as plain text. A chat without such text skips
all of it: its ids are the tokenizer's for the rendered text, as before. (A tokenizer also splits its text at every
special token, so a stretch tokenized alone merges exactly as it would in the whole text.)
"""

from __future__ import annotations

import re
import secrets
from typing import Any

from specdecode.errors import SpecdecodeError
from specdecode.text.tool_calls import render


class ChatEncoder:
    """One tokenizer's chat prompts; thread-safe (tokenizing reads shared state only)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        added = getattr(tokenizer, "added_tokens_decoder", {})
        self.special_ids = frozenset(i for i, t in added.items() if getattr(t, "special", False))
        texts = {t.content for t in added.values() if getattr(t, "special", False)}
        texts |= set(getattr(tokenizer, "all_special_tokens", ()))
        self.special_texts = sorted((t for t in texts if t), key=len, reverse=True)
        self._finder = re.compile(trie_pattern(self.special_texts)) if self.special_texts else None
        self._plain = None  # a copy of the Rust tokenizer that reads special tokens as text (made when first needed)

    def encode(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise SpecdecodeError("this target has no chat template: send a raw prompt instead of chat messages")
        if self._finder is None or not any(self._finder.search(s) for s in _strings([messages, tools])):
            return self.tokenizer.encode(_render(self.tokenizer, messages, tools), add_special_tokens=False)
        markers = Markers(self.special_texts, self._finder)
        try:
            hidden = markers.hide(messages), markers.hide(tools)
        except RecursionError:
            raise SpecdecodeError("the messages or tools are nested too deeply",
                                  "tools" if tools else "messages") from None
        return self.encode_marked(_render(self.tokenizer, *hidden), markers)

    def encode_marked(self, text: str, markers: Markers, every_stretch: bool = False) -> list[int]:
        """`text` tokenized with special tokens parsed, except that each stretch between two special tokens that
        holds a marker (`every_stretch`: each stretch; the tests compare the two ways) is tokenized as plain text,
        its markers restored."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:
            found = markers.restore(markers.sample(text))
            raise SpecdecodeError(f"the messages hold the special token text {found!r}, which this (slow) tokenizer "
                                  "cannot read as plain text: remove it, or load the model's fast tokenizer",
                                  "messages")
        encoding = backend.encode(text, add_special_tokens=False)
        out: list[int] = []
        start, stretch = 0, []
        for token, (begin, end) in zip(encoding.ids, encoding.offsets):
            if token in self.special_ids:
                out += self._stretch(text[start:begin], stretch, markers, every_stretch)
                out.append(token)
                start, stretch = end, []
            else:
                stretch.append(token)
        return out + self._stretch(text[start:], stretch, markers, every_stretch)

    def _stretch(self, text: str, ids: list[int], markers: Markers, every_stretch: bool) -> list[int]:
        if not (every_stretch or markers.within(text)):
            return ids
        if self._plain is None:
            from tokenizers import Tokenizer

            plain = Tokenizer.from_str(self.tokenizer.backend_tokenizer.to_str())
            plain.encode_special_tokens = True  # its own copy: setting this on the shared one would race
            self._plain = plain
        return self._plain.encode(markers.restore(text), add_special_tokens=False).ids


class Markers:
    """Special token texts in a client's strings <-> markers no template changes and no client can guess: lower
    case letters and digits (a random nonce per request), which survive JSON escaping, trimming and tojson."""

    def __init__(self, special_texts: list[str], finder: re.Pattern) -> None:
        self.special_texts = special_texts
        self.index = {text: i for i, text in enumerate(special_texts)}
        self.finder = finder
        nonce = secrets.token_hex(8)
        self.marker = f"specialtext{nonce}n{{}}e"
        self.found = re.compile(f"specialtext{nonce}n([0-9]+)e")

    def hide(self, value: Any) -> Any:
        """`value` (strings, lists and dicts, keys included) with each special token text swapped for its marker."""
        if isinstance(value, str):
            return self.finder.sub(lambda m: self.marker.format(self.index[m.group()]), value)
        if isinstance(value, list):
            return [self.hide(v) for v in value]
        if isinstance(value, dict):
            return {self.hide(k): self.hide(v) for k, v in value.items()}
        return value

    def within(self, text: str) -> bool:
        return self.found.search(text) is not None

    def sample(self, text: str) -> str:
        """The first marker in `text` ('' if none)."""
        match = self.found.search(text)
        return match.group() if match else ""

    def restore(self, text: str) -> str:
        return self.found.sub(lambda m: self.special_texts[int(m.group(1))], text)


def trie_pattern(texts: list[str]) -> str:
    """A regex matching any of `texts`, the longest where several start at one place, as a trie of alternations: a
    flat `a|b|...` is tried branch by branch at every '<', and some tokenizers mark thousands of tokens special
    (Gemma 3: 6,249), which made a page of '<' cost seconds."""
    trie: dict = {}
    for text in texts:
        node = trie
        for char in text:
            node = node.setdefault(char, {})
        node[""] = {}  # a text ends here

    def pattern(node: dict) -> str:
        branches = [re.escape(char) + pattern(child) for char, child in sorted(node.items()) if char]
        if not branches:
            return ""
        body = branches[0] if len(branches) == 1 else f"(?:{'|'.join(branches)})"
        return f"(?:{body})?" if "" in node else body  # greedy: the longer text is tried first

    return pattern(trie)


def _render(tokenizer, messages: list[dict], tools: list[dict] | None) -> str:
    if tools:
        return render(tokenizer, messages, tools)
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as e:  # noqa: BLE001 - a template's own error (jinja raise_exception: roles must alternate)
        raise SpecdecodeError(f"the chat template cannot render these messages: {e}", "messages") from None


def _strings(value: Any):
    """Every string in `value`, dict keys included (a stack, not recursion: tool schemas nest as deep as JSON)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
