"""Prompt sets of the kinds of work users send besides the dev sets: translation, short factual questions,
answering from a long passage (RAG), summarising a passage, rewriting a function. One JSONL file per kind, each
row {"id", "prompt"}, for `specdecode bench --prompt-as-chat`:

    python scripts/kind_prompts.py --out kinds/
    specdecode bench --prompt-as-chat --max-new-tokens 128 --methods none,draft,hybrid,llamacpp \
        --dataset kinds/translation.jsonl --dataset kinds/qa.jsonl --dataset kinds/rag.jsonl \
        --dataset kinds/summary.jsonl --dataset kinds/rewrite.jsonl

The translations and questions are written here. The passages are module docstrings of this machine's Python
standard library (long, plain prose), and the functions to rewrite come from it too: a fixed choice, so every
machine with the same Python builds the same sets.
"""

from __future__ import annotations

import argparse
import ast
import json
import sysconfig
from pathlib import Path

TRANSLATION = [
    "Translate into German: 'The meeting has moved to Thursday afternoon because the client's flight was "
    "delayed. Please bring the signed contract and last quarter's figures.'",
    "Translate into French: 'Our library keeps the original output of the model while making it faster. It "
    "works on laptops and on servers, and it needs no new hardware.'",
    "Translate into Spanish: 'The museum is closed on Mondays. Tickets bought online are valid for one year, "
    "and children under twelve enter for free.'",
    "Translate into Italian: 'If the printer does not respond, turn it off, wait ten seconds, and turn it on "
    "again. Then check that the cable is connected.'",
]
QA = [
    "What is the capital of Australia, and why was it chosen over Sydney and Melbourne? Answer briefly.",
    "Who wrote 'Pride and Prejudice', and in what year was it published?",
    "What does the HTTP status code 404 mean? One or two sentences.",
    "Why is the sky blue? Explain in three sentences.",
]
PASSAGES = ("argparse", "heapq", "shelve", "socketserver", "copy", "timeit", "cmd", "fileinput")
RAG_ASK = ("Answer the question using only the passage below.\n\nPassage:\n{text}\n\nQuestion: What is this "
           "module for, and what are the main things it lets a program do?")
SUMMARY_ASK = "Summarise the following documentation in three or four sentences.\n\n{text}"
REWRITE_MODULES = ("textwrap", "shlex", "fnmatch", "colorsys")
REWRITE_ASK = ("Rewrite this function to be easier to read: clearer names and a docstring, the same behaviour."
               "\n\n```python\n{src}\n```")


def module_docstrings(count: int, stdlib: Path, skip: int = 0) -> list[str]:
    """Docstrings of at least 600 characters from PASSAGES, cut to ~2,500 characters at a paragraph."""
    texts = []
    for name in PASSAGES:
        path = stdlib / f"{name}.py"
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) if path.is_file() else None
        if doc and len(doc) >= 600:
            cut = doc[:2500]
            texts.append(cut[: cut.rfind("\n\n")] if len(doc) > 2500 and "\n\n" in cut else cut)
    return texts[skip : skip + count]


def functions(count: int, stdlib: Path) -> list[str]:
    """Top-level functions of 8-25 lines from REWRITE_MODULES, in file order."""
    found = []
    for name in REWRITE_MODULES:
        path = stdlib / f"{name}.py"
        if not path.is_file():
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        for node in ast.parse("\n".join(lines)).body:
            if isinstance(node, ast.FunctionDef) and 8 <= node.end_lineno - node.lineno + 1 <= 25:
                found.append("\n".join(lines[node.lineno - 1 : node.end_lineno]))
                break  # one per module: different styles
    return found[:count]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="kinds", help="folder for the JSONL files (made if missing)")
    p.add_argument("--per-kind", type=int, default=4)
    args = p.parse_args()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    n = args.per_kind
    kinds = {
        "translation": TRANSLATION[:n],
        "qa": QA[:n],
        "rag": [RAG_ASK.format(text=t) for t in module_docstrings(n, stdlib)],
        "summary": [SUMMARY_ASK.format(text=t) for t in module_docstrings(n, stdlib, skip=n)],
        "rewrite": [REWRITE_ASK.format(src=s) for s in functions(n, stdlib)],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for kind, prompts in kinds.items():
        with open(out / f"{kind}.jsonl", "w", encoding="utf-8") as f:
            for i, prompt in enumerate(prompts):
                f.write(json.dumps({"id": f"{kind}-{i}", "prompt": prompt}) + "\n")
        print(f"{out / f'{kind}.jsonl'}: {len(prompts)} prompts")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
