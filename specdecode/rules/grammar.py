"""Structured output on llguidance: JSON schemas, any JSON object and tool-call formats as token masks.

llguidance was chosen over xgrammar and outlines-core on a 2-core CPU with the Qwen2.5 tokenizer (docs/server.md
has the figures): no compile step worth the name (a schema in ~1 ms, against ~20 ms for xgrammar and seconds for
outlines-core, whose index of the generic JSON grammar took 21 s), next-token masks in ~70 us (median), rollback
in ~1 us, a check of draft tokens without touching the state, forced tokens, and no dependency on torch builds.

A request's `GrammarState` is the matcher after the tokens emitted so far. To verify a draft, a copy of it walks
the draft tree: for each node it rolls back to where the node's path parts from the last one, consumes the rest
and writes the mask of what may follow. The request's own matcher only moves forward (consuming what was emitted):
llguidance grows its parser state with every rollback, and a long answer verified in many trees would reach its
complexity limit. So each verified row is masked exactly as plain constrained
decoding would mask it after that path.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from specdecode.errors import SpecdecodeError, require
from specdecode.kernels import cpu_kernels

NO_TOKEN = float("-inf")
# Whitespace between JSON tokens: compact, spaced and indented styles all fit, but not without end (a model that
# drifts into blank space would otherwise fill max_tokens with it and never close the object).
JSON_OPTIONS = {"whitespace_flexible": True, "whitespace_pattern": r"[\x20\x0A\x0D\x09]{0,24}"}


class GrammarCompiler:
    """Turns grammars into `Constraint`s for one tokenizer; what the tokenizer costs (~0.8 s for Qwen2.5's 152k
    tokens on 2 cores, llguidance's own tables) is paid once, at the first constraint. That cost stays per process:
    llguidance cannot save those tables, and rebuilding them from a saved token list gave other masks."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = [e for e in eos_ids if e < vocab_size]
        self._info = None

    @property
    def info(self):
        if self._info is None:
            require("llguidance", "grammar", "structured output (JSON schemas, tool calls)")
            try:
                self._info = _llguidance_tokenizer(self.tokenizer, self.vocab_size, self.eos_ids or None)
            except Exception as e:  # noqa: BLE001 - a tokenizer llguidance cannot read: say so plainly
                raise SpecdecodeError(f"structured output needs a fast (Rust) Hugging Face tokenizer; this one "
                                      f"cannot be used: {e}") from None
        return self._info

    def json_schema(self, schema: dict[str, Any] | bool) -> Constraint:
        """Output that is one JSON value valid under `schema` (JSON Schema, as OpenAI's json_schema takes it)."""
        from llguidance import LLMatcher

        if isinstance(schema, dict) and "x-guidance" not in schema:
            schema = {**schema, "x-guidance": JSON_OPTIONS}
        return self._compile(LLMatcher.grammar_from_json_schema(json.dumps(schema)), "JSON schema")

    def json_object(self) -> Constraint:
        """Output that is any one JSON object (OpenAI's json_object)."""
        return self.json_schema({"type": "object"})

    def lark(self, grammar: str) -> Constraint:
        """A Lark grammar in llguidance's dialect (`%json {...}` embeds a JSON schema)."""
        from llguidance import LLMatcher

        return self._compile(LLMatcher.grammar_from_lark(grammar), "grammar")

    def tool_calls(self, tools: list[dict], tool_choice: str | dict, many: bool = True) -> Constraint:
        """Output that is calls of `tools` (text/tool_calls.call_grammar). Each tool's arguments schema is first
        compiled alone: one that admits no arguments would otherwise fail only once a call's arguments begin."""
        from specdecode.text.tool_calls import call_grammar

        grammar = call_grammar(tools, tool_choice, many)  # a tool_choice naming no tool is refused first
        for index, tool in enumerate(tools):
            if parameters := tool["function"].get("parameters"):
                try:
                    self.json_schema(parameters)
                except SpecdecodeError as e:
                    raise SpecdecodeError(f"tools.{index}.function.parameters: {e}", "tools") from None
        return self.lark(grammar)

    def _compile(self, grammar: str, what: str) -> Constraint:
        from llguidance import LLMatcher

        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.info)
        if failed:
            raise SpecdecodeError(f"the {what} is not supported: {'; '.join(messages)}")
        _check_first_token(LLMatcher(self.info, grammar), self.vocab_size, what)
        return Constraint(self, grammar)


class Constraint:
    """A compiled grammar; requests each take their own `matcher()`."""

    def __init__(self, compiler: GrammarCompiler, grammar: str) -> None:
        self.compiler = compiler
        self.grammar = grammar

    def matcher(self) -> GrammarState:
        from llguidance import LLMatcher

        matcher = LLMatcher(self.compiler.info, self.grammar)
        if matcher.is_error():
            raise SpecdecodeError(f"the grammar is not supported: {matcher.get_error()}")
        return GrammarState(matcher, self.compiler.vocab_size, self.compiler.eos_ids)


class GrammarState:
    def __init__(self, matcher, vocab_size: int, eos_ids: list[int]) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = eos_ids
        self.words = (vocab_size + 31) // 32  # int32 words of one row's bitmask

    def legal_nodes(self, tokens: list[int], parents: list[int]) -> list[int]:
        """The draft nodes whose whole path the grammar accepts (every kept node's parent is kept)."""
        kept: list[int] = []
        legal = [False] * len(tokens)
        path: list[int] = []  # nodes consumed, root first
        walker = self.matcher.deep_copy()
        for node, (token, parent) in enumerate(zip(tokens, parents)):
            if parent >= 0 and (not legal[parent] or tokens[parent] in self.eos_ids):
                continue  # under a node the grammar rejects, or after the end of the text: nothing follows
            _walk_to(walker, path, parent, tokens, parents)
            # EOS: where the text may end (llguidance's check of tokens leaves EOS out)
            if (walker.is_accepting() if token in self.eos_ids else walker.validate_tokens([token]) == 1):
                legal[node] = True
                kept.append(node)
        return kept

    def mask(self, logits: torch.Tensor, tokens: list[int], parents: list[int], rows: list[int]) -> None:
        """In place on logits [len(rows), vocab]: row r keeps only the tokens the grammar allows after the path to
        draft node rows[r] (-1: the root); every node on those paths is legal (`legal_nodes` cut the draft)."""
        bitmask = torch.zeros(len(rows), self.words, dtype=torch.int32)
        path: list[int] = []
        walker = self.matcher.deep_copy()  # the request's own matcher only ever moves forward
        for r, node in enumerate(rows):
            if self._ends(node, tokens, parents):  # after EOS the text is over: only EOS, as a stopped matcher
                for eos in self.eos_ids:
                    bitmask[r, eos // 32] |= _bit(eos % 32)
                continue
            _walk_to(walker, path, node, tokens, parents)
            fill_mask_row(walker, bitmask, r)
        dead = torch.from_numpy(~bitmask.numpy().any(-1))
        if bool(dead.any()) and self.eos_ids:  # a grammar that allows nothing more (a dead end) can only end
            eos = self.eos_ids[0]
            bitmask[dead, eos // 32] |= _bit(eos % 32)
        apply_bitmask(logits, bitmask)

    def _ends(self, node: int, tokens: list[int], parents: list[int]) -> bool:
        """Whether an EOS lies on `node`'s path. The matcher is never walked past one: llguidance counts no token
        for an EOS consumed once it has stopped, so rolling back along such a path would undo too much."""
        while node >= 0:
            if tokens[node] in self.eos_ids:
                return True
            node = parents[node]
        return False

    def forced(self, limit: int) -> list[int]:
        """Tokens the grammar forces next (one legal continuation, tokenized as it must be), at most `limit`."""
        return list(self.matcher.compute_ff_tokens())[:limit]

    def advance(self, tokens: list[int]) -> None:
        """The tokens were emitted (from masked distributions, so the grammar accepts them)."""
        for token in tokens:
            if self.matcher.is_stopped():
                return
            _consume(self.matcher, token)


def _check_first_token(matcher, vocab_size: int, what: str) -> None:
    """Refuse a grammar that no output can start, before any request runs it: llguidance finds out only when it
    masks the first token (a schema that is itself, {"$ref": "#"} or a $ref / allOf cycle, validates fine)."""
    if not matcher.is_error():
        fill_mask_row(matcher, torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32), 0)
    if matcher.is_error():
        reason = matcher.get_error().splitlines()[0]
        raise SpecdecodeError(f"the {what} admits no output: most often a schema that refers to itself before any "
                              "value begins ($ref to itself or to a $ref that leads back, allOf of itself), which "
                              f"leaves nothing to generate; give the recursion a base case (llguidance: {reason})")


def fill_mask_row(matcher, bitmask: torch.Tensor, row: int) -> None:
    """Row `row` of the [rows, words] int32 bitmask: the tokens `matcher` allows next. What
    llguidance.torch.fill_next_token_bitmask does, without importing that module: it compiles a kernel with
    torch.compile as it loads, which loads torch._dynamo (4-5 s of a CLI call's grammar setup on 2 cores)."""
    words = bitmask[row]
    if bitmask.dtype != torch.int32 or not bitmask.is_cpu or not words.is_contiguous():
        raise ValueError("the bitmask must be a contiguous int32 tensor on the CPU")
    matcher.unsafe_compute_mask_ptr(words.data_ptr(), words.numel() * words.element_size())


def _llguidance_tokenizer(tokenizer, vocab_size: int, eos_ids: list[int] | None):
    """llguidance's tables for a fast HF tokenizer. llguidance.hf.from_tokenizer copies the Rust tokenizer first
    (0.3-0.5 s for 152k tokens) only to switch padding and truncation off on the copy: where neither is on, its
    JSON is read as it is, the same string, so the same tables."""
    from llguidance import LLTokenizer

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.padding is None and backend.truncation is None:
        return LLTokenizer(backend.to_str(), n_vocab=vocab_size,
                           eos_token=tokenizer.eos_token_id if eos_ids is None else eos_ids)
    import llguidance.hf

    return llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_ids)


def _walk_to(matcher, path: list[int], node: int, tokens: list[int], parents: list[int]) -> None:
    """Move `matcher` from the end of `path` (draft nodes consumed, root first) to the end of `node`'s path (-1:
    the root): roll back below where the two paths part, consume the rest. `path` follows."""
    target: list[int] = []
    while node >= 0:
        target.append(node)
        node = parents[node]
    target.reverse()
    common = 0
    while common < min(len(path), len(target)) and path[common] == target[common]:
        common += 1
    if len(path) > common:
        matcher.rollback(len(path) - common)
    for step in target[common:]:
        _consume(matcher, tokens[step])
    path[:] = target


def _consume(matcher, token: int) -> None:
    if not matcher.consume_token(token):
        raise SpecdecodeError(f"the grammar rejected token {token}: {matcher.get_error()}")


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: -inf for every token whose bit in the [rows, words] int32 bitmask is 0 (bit j of word w: token
    32 w + j). The native kernel on CPU float32; else unpacked bits (llguidance's own helper compiles with
    torch.compile, again for every new row count)."""
    if logits.is_cpu and logits.dtype == torch.float32 and logits.is_contiguous() and logits.dim() == 2:
        if (kernels := cpu_kernels()) is not None:
            kernels.mask_disallowed(logits, bitmask.contiguous())
            return
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.to(logits.device)[..., None] >> shifts.to(logits.device)) & 1).flatten(-2)
    logits.masked_fill_(allowed[..., : logits.shape[-1]] == 0, NO_TOKEN)


def _bit(j: int) -> int:
    """Bit j of an int32 word (bit 31 is the sign)."""
    return 1 << j if j < 31 else -(1 << 31)
