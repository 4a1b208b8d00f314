"""A drafter added from outside the package is one class and one `register` call: it runs through `generate`,
`bench` and the server with no other file touched, and its output is plain decoding's."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import httpx
import pytest
from server_thread import BackgroundServer
from test_bench import ROWS, _write_model

from specdecode.api import SpecDecoder
from specdecode.cli import main as cli_main
from specdecode.drafters.base import Draft, DraftContext, Drafter
from specdecode.methods import Method, register, unregister
from specdecode.server.app import create_app
from specdecode.server.settings import ServerSettings

NAME = "follow-last"


class FollowLastDrafter(Drafter):
    """Guesses that what followed the last token's previous occurrence follows again (a bigram copy, a chain)."""

    name = NAME

    def fork(self) -> FollowLastDrafter:
        return FollowLastDrafter()

    def propose(self, ctx: DraftContext, max_tokens: int) -> Draft:
        tokens, guess = ctx.tokens, []
        for _ in range(min(max_tokens, ctx.max_depth, 4)):
            last = (tokens + guess)[-1]
            seen = [i for i, t in enumerate(tokens[:-1]) if t == last]
            if not seen:
                break
            guess.append(tokens[seen[-1] + 1])
        return Draft.chain(guess, scores=[0.5**(i + 1) for i in range(len(guess))])


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("new-drafter")
    _write_model(root / "target", seed=0)
    (root / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    register(Method(NAME, "copies what followed the last token before", None, "chain", False,
                    lambda models, tree, max_ngram: FollowLastDrafter()))
    yield root
    unregister(NAME)


def _run(main, args: list[str]) -> str:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(args) == 0
    return out.getvalue()


def test_generate_runs_a_registered_drafter_losslessly(folder: Path) -> None:
    outputs = {}
    for method in ("none", NAME):
        printed = _run(cli_main, ["generate", "def add(a, b):", "--target", str(folder / "target"), "--method", method,
                                  "--json", "--dtype", "float32", "--max-new-tokens", "24", "--num-draft-tokens", "4"])
        outputs[method] = json.loads(printed)
    assert outputs[NAME]["token_ids"] == outputs["none"]["token_ids"]
    assert outputs[NAME]["stats"]["drafts"] > 0  # it was asked to draft


def test_bench_measures_a_registered_drafter(folder: Path) -> None:
    report_path = folder / "run.json"
    _run(cli_main, ["bench", "--dataset", str(folder / "prompts.jsonl"), "--target", str(folder / "target"),
                      "--dtype", "float32", "--max-new-tokens", "6", "--no-progress", "--methods", NAME,
                      "--num-draft-tokens", "3", "--json", str(report_path)])
    report = json.loads(report_path.read_text())
    assert list(report["methods"]) == ["none", NAME]
    assert report["methods"][NAME]["lossless"] is True


def test_the_server_serves_a_registered_drafter(folder: Path) -> None:
    answers = {}
    for method in ("none", NAME):
        decoder = SpecDecoder.load(str(folder / "target"), method=method, dtype="float32", num_draft_tokens=4,
                                   max_len=256)
        with BackgroundServer(create_app(decoder, ServerSettings(model_name="tiny"))) as url:
            reply = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "def add(a, b):",
                                                             "max_tokens": 24, "temperature": 0}, timeout=120)
        assert reply.status_code == 200, reply.text
        answers[method] = reply.json()["choices"][0]["text"]
    assert answers[NAME] == answers["none"]
