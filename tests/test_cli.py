"""The CLI: bad input gives one clear line and a non-zero exit; one end-to-end run on the real SmolLM2-135M."""

import json
import os
import subprocess
import sys

import pytest

SMOL = "smollm2-135m-instruct"


def cli(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "specdecode", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


@pytest.mark.parametrize("args, words", [
    (["generate", "hi", "--target", "/no/such/model.gguf"], "/no/such/model.gguf"),
    (["generate", "hi", "--temperature", "-1"], "temperature"),
    (["generate", "hi", "--top-p", "0"], "top_p"),
    (["generate", "hi", "--max-new-tokens", "0"], "max_new_tokens"),
    (["models", "pull", "no-such-model"], "no-such-model"),
])
def test_bad_input_is_one_clear_line(args, words):
    result = cli(*args)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and words in lines[0], result.stderr


@pytest.mark.e2e
def test_generate_json_on_smollm2_is_lossless_across_methods():
    outputs = {}
    for name, method, shape in (("none", "none", "chain"), ("ngram", "ngram", "tree"), ("draft", "draft", "chain"),
                                ("draft-tree", "draft", "tree"), ("hybrid", "hybrid", "chain")):
        result = cli("generate", "Write a Python function that adds two numbers.", "--chat", "--json",
                     "--target", SMOL, "--draft", SMOL, "--method", method, "--max-new-tokens", "24",
                     "--dtype", "float32", "--draft-quantize", "none", "--draft-shape", shape)
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout)
        assert {"text", "token_ids", "stats"} <= out.keys()
        for key in ("new_tokens", "wall_s", "acceptance_rate", "mean_accepted_length"):
            assert key in out["stats"]
        outputs[name] = out
    for name in ("ngram", "draft", "draft-tree", "hybrid"):
        assert outputs[name]["token_ids"] == outputs["none"]["token_ids"], name
    assert outputs["draft"]["stats"]["acceptance_rate"] == 1.0  # the draft is the target itself
    tree = outputs["draft-tree"]["stats"]  # every step's best path is accepted whole; siblings never are
    assert tree["draft_budget"] == "auto" and tree["verify_costs"]["seconds"]
    # (steps that drafted nothing and the step cut at --max-new-tokens keep the two means from matching exactly)
    assert 1.0 <= tree["accepted_path_length"] <= tree["nodes_per_step"]
    assert outputs["none"]["stats"]["mean_accepted_length"] == 1.0
