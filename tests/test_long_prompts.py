"""scripts/long_prompts.py with a stand-in tokenizer (a word or a punctuation mark is a token): every prompt lands in
its bucket's band, ids are unique, two builds give the same bytes, and each question names something the prompt
holds. No model, no tokenizer download: the script's counting is swapped for the stand-in."""

from __future__ import annotations

import importlib.util
import io
import json
import re
import sys
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

BUCKETS = "1k,4k"


def count_words(text: str) -> int:
    return len(re.findall(r"\w+|[^\w\s]", text))


@pytest.fixture(scope="module")
def script():
    path = Path(__file__).parents[1] / "scripts" / "long_prompts.py"
    spec = importlib.util.spec_from_file_location("long_prompts", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def write_train_rows(folder: Path, rows: int = 800) -> Path:
    """Chat rows in the training files' shape, of varied lengths, enough for the 4k bucket's conversations."""
    folder.mkdir()
    with open(folder / "roleplay_instruct.jsonl", "w", encoding="utf-8") as file:
        for i in range(rows):
            user = f"Question {i}: tell me about topic {i} " + "and its details " * (i % 7)
            answer = f"Answer {i} starts here. " + "Here is one more sentence about it. " * (1 + i % 11)
            file.write(json.dumps({"messages": [{"role": "user", "content": user},
                                                {"role": "assistant", "content": answer}]}) + "\n")
    return folder


def build(script, monkeypatch, out: Path, train: Path, buckets: str = BUCKETS) -> str:
    monkeypatch.setattr(script, "load_counter", lambda model: count_words)
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()) as err:
        assert script.main(["--buckets", buckets, "--out", str(out), "--model", "stand-in",
                            "--train-data", str(train)]) == 0
    return err.getvalue()


@pytest.fixture(scope="module")
def built(script, tmp_path_factory):
    """The 1k and 4k files, built twice into two folders."""
    root = tmp_path_factory.mktemp("long")
    train = write_train_rows(root / "train")
    with pytest.MonkeyPatch.context() as monkeypatch:
        notes = build(script, monkeypatch, root / "a", train)
        build(script, monkeypatch, root / "b", train)
    return root, notes


def rows_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_every_row_lands_in_its_bucket_with_every_kind(script, built) -> None:
    root, notes = built
    assert notes == ""  # no kind came up short
    for bucket in BUCKETS.split(","):
        rows = rows_of(root / "a" / f"long-{bucket}.jsonl")
        band = script.Band.below(script.BUCKETS[bucket])
        assert [r["kind"] for r in rows] == [kind for kind in script.KINDS for _ in range(2)]
        for row in rows:
            assert set(row) == {"id", "prompt", "kind", "context_tokens"}
            assert row["context_tokens"] == count_words(row["prompt"]) and row["context_tokens"] in band, row["id"]


def test_ids_are_unique_and_the_files_are_the_same_each_build(built) -> None:
    root, _ = built
    ids = [row["id"] for bucket in BUCKETS.split(",") for row in rows_of(root / "a" / f"long-{bucket}.jsonl")]
    assert len(ids) == len(set(ids))
    for bucket in BUCKETS.split(","):
        name = f"long-{bucket}.jsonl"
        assert (root / "a" / name).read_bytes() == (root / "b" / name).read_bytes()


def test_each_question_names_something_the_prompt_holds(built) -> None:
    root, _ = built
    for bucket in BUCKETS.split(","):
        for row in rows_of(root / "a" / f"long-{bucket}.jsonl"):
            prompt = row["prompt"]
            if row["kind"] == "document-qa":
                number, name = re.search(r"In document (\d+), find the entry for `([\w.]+)`", prompt).groups()
                document = prompt.split(f"\n\nDocument {number}: ", 1)[1].split("\n\nDocument ", 1)[0]
                assert f"\n\n{name}(" in document, (row["id"], name)
            elif row["kind"].startswith("code-"):
                name = re.search(r"(?:function|method) `(\w+)`", prompt.rsplit("```", 1)[1]).group(1)
                assert re.search(rf"^\s*(async )?def {name}\(", prompt.split("```python\n", 1)[1], re.M), row["id"]
            else:
                number, opening = re.search(r'my message (\d+), the one that began "([^"]+)"', prompt).groups()
                assert f"User (message {number}): {opening}" in " ".join(prompt.split()), row["id"]


def test_buckets_are_shifted_so_no_two_share_a_long_prefix(built) -> None:
    root, _ = built
    small, large = (rows_of(root / "a" / f"long-{bucket}.jsonl") for bucket in BUCKETS.split(","))
    for a in small:
        for b in large:
            shared = next((i for i, (x, y) in enumerate(zip(a["prompt"], b["prompt"])) if x != y), 0)
            assert shared < 200, (a["id"], b["id"])


def test_without_training_rows_there_is_no_long_chat(script, monkeypatch, tmp_path: Path) -> None:
    notes = build(script, monkeypatch, tmp_path / "out", tmp_path / "missing", buckets="1k")
    assert "no long-chat prompts" in notes
    assert all(row["kind"] != "long-chat" for row in rows_of(tmp_path / "out" / "long-1k.jsonl"))


def test_fitting_takes_the_most_material_under_the_top(script) -> None:
    fitted = script.largest_under(lambda n: "word " * n if n >= 3 else None, 100, count_words, 40)
    assert (fitted.used, fitted.tokens) == (40, 40)
    assert script.largest_under(lambda n: "word " * (50 + n), 100, count_words, 40) is None
    with pytest.raises(ValueError, match="unknown bucket 2k"):
        script.parse_buckets("1k,2k")
