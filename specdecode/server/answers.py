"""What one response's choices look like: text or tool calls, logprobs in the chat or the completions shape, the
echoed prompt; shared by the whole answer (formats.completion) and the stream (streams.py).

Logprobs are the target's log-softmax at each position (sequence.token_logprobs): the same numbers with or without
speculation. A token's text is its bytes decoded (a token that ends inside a UTF-8 character shows U+FFFD; `bytes`
has the exact ones, as OpenAI's do).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specdecode.text.tool_calls import parse


class TokenTexts:
    """Token id -> its bytes and text, read off the tokenizer once, at the first logprobs request."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._bytes: list[bytes] | None = None
        self.special = frozenset(getattr(tokenizer, "all_special_ids", ()))  # the text leaves these out (EOS)

    def bytes_of(self, token: int) -> bytes:
        if self._bytes is None:
            from specdecode.text.token_bridge import Vocabulary

            try:
                self._bytes = Vocabulary(self.tokenizer).bytes
            except Exception:  # noqa: BLE001 - a slow tokenizer: decode tokens one at a time instead
                self._bytes = []
        if token < len(self._bytes):
            return self._bytes[token]
        return self.tokenizer.decode([token]).encode()

    def text_of(self, token: int) -> str:
        return self.bytes_of(token).decode("utf-8", errors="replace")


@dataclass
class Answer:
    """How this request's choices are written."""

    chat: bool
    texts: TokenTexts
    top: int | None = None  # logprobs: alternatives per token (None: no logprobs)
    echo: str | None = None  # completions with echo: the prompt's text, written before each choice's text
    echo_ids: list[int] = field(default_factory=list)  # and its tokens (for their logprobs)
    tools: list[dict] | None = None  # chat with tools: calls are read out of the answer

    def logprobs(self, tokens: list[int], logprobs: list | None, prompt: tuple[list[int], list] | None = None,
                 offset: int = 0) -> dict[str, Any] | None:
        """One choice's (or one chunk's) logprobs object; `prompt`: (ids, logprobs) echoed before the tokens,
        `offset`: characters of the choice's text before these tokens (completions' text_offset)."""
        if self.top is None or logprobs is None:
            return None
        if self.chat:  # as OpenAI's: the content's tokens, no EOS (the completions API keeps it: lm-eval reads it)
            kept = [(t, lp) for t, lp in zip(tokens, logprobs) if t not in self.texts.special]
            return {"content": [self._chat_entry(t, lp) for t, lp in kept]}
        ids, values = list(tokens), list(logprobs)
        if prompt is not None:
            ids, values = prompt[0] + ids, prompt[1] + values
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, entry in zip(ids, values):
            text = self.texts.text_of(token)
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            if entry is None:  # the prompt's first token: nothing predicts it
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(entry[0])
            out["top_logprobs"].append({self.texts.text_of(t): v for t, v in entry[1]})
        return out

    def _chat_entry(self, token: int, entry) -> dict[str, Any]:
        value, top = entry
        return {**self._token(token), "logprob": value,
                "top_logprobs": [{**self._token(t), "logprob": v} for t, v in top]}

    def _token(self, token: int) -> dict[str, Any]:
        raw = self.texts.bytes_of(token)
        return {"token": raw.decode("utf-8", errors="replace"), "bytes": list(raw)}

    def message(self, text: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
        """A chat choice's message and finish reason: tool calls read out of the text where tools were given."""
        if self.tools is None:
            return {"role": "assistant", "content": text}, finish_reason
        content, calls = parse(text, self.tools)
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        message = {"role": "assistant", "content": content, "tool_calls": [c.as_openai() for c in calls]}
        return message, "tool_calls" if finish_reason == "stop" else finish_reason


@dataclass
class Finished:
    """One choice, whole."""

    text: str
    finish_reason: str
    stats: dict[str, Any]
    token_ids: list[int] = field(default_factory=list)
    logprobs: list | None = None
    prompt_logprobs: list | None = None
