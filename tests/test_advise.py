"""`specdecode advise`: prompts from training-format files, the advice read from measured numbers, bad input in
one line, and one real run on SmolLM2."""

from __future__ import annotations

import json

import pytest

from specdecode.advise.prompts import prompts_from_data
from specdecode.advise.recommend import PAYS, advice, table
from specdecode.cli import main
from specdecode.errors import SpecdecodeError
from specdecode.kernels import cpu_kernels
from specdecode.weights import hub


def write_lines(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_prompts_are_read_from_every_training_format(tmp_path):
    data = write_lines(tmp_path / "mine.jsonl", [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
                      {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "More?"}]},
        {"prompt": "Sum 2 and 3.", "response": "5"},
        {"text": "def f(x):\n    return x + 1\n" * 3},
    ])
    (tmp_path / "code.py").write_text("import os\nprint(os.getcwd())\n")
    prompts = prompts_from_data([data, str(tmp_path / "*.py")])
    chat, plain, text, code = prompts
    assert chat.chat and chat.turns == ["Hi?"] and chat.history == [{"role": "system", "content": "Be brief."}]
    assert plain.turns == ["Sum 2 and 3."] and plain.chat
    assert not text.chat and text.turns[0] and len(text.turns[0]) < len("def f(x):\n    return x + 1\n" * 3)
    assert not code.chat and code.turns[0].startswith("import os")


@pytest.mark.parametrize("rows, message", [([], "no prompts"), ([{"answer": 1}], "needs 'messages'"),
                                           (["text"], "expected a JSON object")])
def test_bad_data_is_one_clear_line(tmp_path, rows, message):
    with pytest.raises(SpecdecodeError, match=message):
        prompts_from_data([write_lines(tmp_path / "bad.jsonl", rows)])


def test_a_time_budget_too_small_is_refused_before_loading(tmp_path, capsys):
    data = write_lines(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    assert main(["advise", "--data", data, "--time-budget", "5"]) == 2
    assert "too short to measure anything" in capsys.readouterr().err


def result(tokens_per_s, acceptance=None, length=None, draft_ms=None, method="none", draft=None):
    return {"tokens_per_s": tokens_per_s, "acceptance_rate": acceptance, "mean_accepted_length": length,
            "draft_ms_per_step": draft_ms, "method": method, "draft": draft, "acceptance_per_position": None,
            "ttft_s_mean": 0.1, "speedup_vs_none": None}


def with_speedups(results):
    for r in results.values():
        r["speedup_vs_none"] = r["tokens_per_s"] / results["none"]["tokens_per_s"]
    return results


def test_the_advice_is_the_fastest_drafter_with_its_command_lines():
    results = with_speedups({"none": result(10.0), "ngram": result(10.3, 0.5, 1.2, 0.1, "ngram"),
                             "draft@small": result(14.0, 0.7, 2.1, 9.0, "draft", "small")})
    advised = advice(results, "big")
    assert advised["pays"] and advised["method"] == "draft@small"
    assert advised["generate"] == "specdecode generate --target big --method draft --draft small 'your prompt'"
    assert advised["serve"] == "specdecode serve --target big --method draft --draft small"
    assert "draft@small" in table(results)


def test_of_level_drafters_the_advice_is_the_one_holding_least_memory():
    results = with_speedups({"none": result(10.0), "suffix": result(12.4, 0.6, 1.4, 0.4, "suffix"),
                             "hybrid@small": result(12.6, 0.6, 2.4, 23.0, "hybrid", "small")})
    results["hybrid@small"].update(extra_weights_bytes=400 * 2**20, extra_cache_bytes_per_token=12288)
    advised = advice(results, "big")
    assert advised["method"] == "suffix" and advised["within_noise"] == ["hybrid@small"]
    assert "level with the fastest, hybrid@small (1.26x), which holds 400 MiB more" in advised["reason"]
    assert advised["serve"] == "specdecode serve --target big --method suffix"
    results["hybrid@small"]["tokens_per_s"] = 14.0  # clearly faster: worth its memory
    advised = advice(with_speedups(results), "big")
    assert advised["method"] == "hybrid@small" and advised["within_noise"] == []


@pytest.mark.parametrize("acceptance, why", [(0.1, "rarely right"), (0.8, "costs more than")])
def test_when_no_drafter_pays_the_advice_says_why(acceptance, why):
    results = with_speedups({"none": result(10.0),
                             "draft@small": result(10.0 * (PAYS - 0.02), acceptance, 1.5, 20.0, "draft", "small")})
    advised = advice(results, "big")
    assert not advised["pays"] and advised["method"] == "none" and why in advised["reason"]
    assert advised["serve"] == "specdecode serve --target big --method none"


@pytest.mark.e2e
@pytest.mark.skipif(cpu_kernels() is None, reason="weights as stored run on the native CPU kernel")
def test_advise_measures_candidates_on_smollm2_and_writes_its_advice(tmp_path, capsys):
    hub.pull("smollm2-135m-instruct")
    data = write_lines(tmp_path / "p.jsonl", [{"prompt": "List the numbers from 1 to 20, comma separated."},
                                              {"prompt": "Repeat after me: the cat sat on the mat."}])
    out = tmp_path / "advice.json"
    code = main(["advise", "--target", "smollm2-135m-instruct", "--data", data, "--candidates", "none,ngram",
                 "--time-budget", "30", "--max-new-tokens", "24", "--no-progress", "--json", str(out)])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| ngram |" in printed and "specdecode serve --target smollm2-135m-instruct --method" in printed
    document = json.loads(out.read_text())
    assert set(document["candidates"]) == {"none", "ngram"} and document["prompts_measured"] >= 1
    assert document["advice"]["method"] in ("none", "ngram")


class FakeRunner:
    family = "ours"

    def __init__(self, name, interrupt_at=None):
        self.name, self.calls, self.interrupt_at = name, 0, interrupt_at

    def run(self, prompt_ids, params):
        from specdecode.bench.runners import TurnResult

        self.calls += 1
        if self.calls == self.interrupt_at:
            raise KeyboardInterrupt
        return TurnResult(token_ids=[1, 2, 3], wall_s=0.1, ttft_s=0.01, token_latencies_s=[0.05, 0.05],
                          decode_tokens=2, decode_forwards=2)


def test_an_interrupt_keeps_the_prompts_every_candidate_finished(tmp_path):
    import torch

    from specdecode.advise.measure import measure
    from specdecode.config import SamplingParams

    prompts = prompts_from_data([write_lines(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(5)])])
    runners = {"none": FakeRunner("none"), "ngram": FakeRunner("ngram", interrupt_at=4)}  # warm-up + 2 rounds
    measured = measure(prompts, runners, lambda text, chat: [1], lambda ids: "", SamplingParams(), 100.0,
                       torch.device("cpu"), progress=False)
    assert measured.interrupted and measured.prompts_left == 3
    assert sorted(r.method for r in measured.runs) == ["ngram", "ngram", "none", "none"]


@pytest.mark.skipif(cpu_kernels() is None, reason="float weights on the CPU kernels")
def test_a_float_target_is_told_what_blocks_would_read():
    import torch
    from tiny import tiny_native

    from specdecode.advise.cli import float_weights_note
    from specdecode.weights.quantize import quantize_

    model = quantize_(tiny_native("qwen2", dtype=torch.bfloat16, hidden_size=256, intermediate_size=512), "none")
    note = float_weights_note(model)
    assert "GB of bfloat16 weights a token" in note and "--quantize q8_0" in note and "--quantize q4_k" in note
    assert "~1.9x" in note and "~3.6x" in note  # 2 bytes a weight against 34/32 and 144/256
    assert float_weights_note(quantize_(tiny_native("qwen2", hidden_size=256, intermediate_size=512), "q8_0")) is None
