"""Turn Python source into training prompts: "complete this function" for each documented function.

A code base is the domain data many users have, but as plain text it only teaches a drafter to continue files.
Asked to complete a function from its signature and docstring, the target answers as it answers a user (a code
block, often a word of explanation), and `specdecode train ... --regenerate` trains on exactly those answers.
Without --regenerate the function's own source is the answer.

    python scripts/function_prompts.py 'src/**/*.py' --out functions.jsonl
    specdecode train eagle --data functions.jsonl my-chats.jsonl --regenerate --out heads/eagle

Writes one {"prompt", "response"} per function or method with a docstring, whose source has at most
--max-lines lines; files that do not parse are skipped with a note.
"""

from __future__ import annotations

import argparse
import ast
import glob
import json
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

ASK = "Complete the following Python function:\n\n```python\n{head}```"


def functions(source: str) -> Iterator[tuple[str, str]]:
    """(signature and docstring, the whole function) of each documented function in `source`, dedented."""
    lines = source.splitlines(keepends=True)
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or ast.get_docstring(node) is None:
            continue
        if len(node.body) == 1:  # a docstring and nothing else: nothing to complete
            continue
        start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
        yield (textwrap.dedent("".join(lines[start : node.body[0].end_lineno])),
               textwrap.dedent("".join(lines[start : node.end_lineno])))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("sources", nargs="+", help="Python files or globs ('**' recurses)")
    p.add_argument("--out", required=True, help="the JSONL file to write")
    p.add_argument("--max-lines", type=int, default=60, help="skip longer functions (default 60)")
    args = p.parse_args(argv)
    files = sorted({f for pattern in args.sources for f in glob.glob(pattern, recursive=True) if f.endswith(".py")})
    if not files:
        print(f"no Python file matches {' '.join(args.sources)}", file=sys.stderr)
        return 2
    written = 0
    with open(args.out, "w") as out:
        for name in files:
            try:
                found = list(functions(Path(name).read_text(encoding="utf-8")))
            except (SyntaxError, UnicodeDecodeError, ValueError) as e:
                print(f"note: skipped {name}: {e.__class__.__name__}", file=sys.stderr)
                continue
            for head, whole in found:
                if whole.count("\n") <= args.max_lines:
                    out.write(json.dumps({"prompt": ASK.format(head=head), "response": f"```python\n{whole}```"})
                              + "\n")
                    written += 1
    print(f"wrote {written} prompts from {len(files)} files to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
