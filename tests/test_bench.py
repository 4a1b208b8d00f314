"""The benchmark harness on tiny random Qwen2 folders: every method runs, the JSON has its schema, the table and
plots appear, and the losslessness check flags a planted mismatch. Nothing is downloaded."""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from specdecode.bench.data import Prompt, load_prompts, parse_row
from specdecode.bench.harness import Run
from specdecode.bench.loaders import all_methods, drafter_and_shape, parse_methods
from specdecode.bench.metrics import find_mismatches, first_difference
from specdecode.bench.report import build_report, markdown
from specdecode.bench.runners import TurnResult
from specdecode.cli import main
from specdecode.errors import SpecdecodeError
from specdecode.methods import METHODS

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(33, 127)] + ["Ġ", "Ċ"]
ROWS = [
    {"task_id": "T/0", "prompt": "def add(a, b):\n"},
    {"question": "What is 2 + 3?"},
    {"question_id": 7, "category": "writing", "turns": ["Say hi.", "Now say it again."]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to 3."}]},
]
MAX_NEW = 6


def _write_model(folder: Path, seed: int) -> None:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(TOKENS), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000.0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    Qwen2ForCausalLM(config).eval().save_pretrained(folder)
    backend = Tokenizer(models.BPE({t: i for i, t in enumerate(TOKENS)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>", eos_token="<|im_end|>")
    tokenizer.add_special_tokens({"additional_special_tokens": TOKENS[:3]})
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)


def _main(args: list[str]) -> tuple[int, str]:
    stdout = io.StringIO()
    with redirect_stdout(stdout):
        code = main(args)
    return code, stdout.getvalue()


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("bench")
    _write_model(root / "target", seed=0)
    _write_model(root / "draft", seed=1)
    (root / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return root


# Every method but llama.cpp's, which run GGUF files only (tested on a real one in test_e2e_stored.py), the trained
# drafters, which need a trained folder (test_trained.py), and those needing layers a model may lack (mtp:
# test_mtp_drafter.py).
METHODS = [m for m in all_methods() if not m.startswith(("llamacpp", "draft-lora"))
           and METHODS.get(drafter_and_shape(m)[0], METHODS["none"]).head is None
           and METHODS.get(drafter_and_shape(m)[0], METHODS["none"]).offered is None]


def _args(root: Path, *extra: str) -> list[str]:
    return ["bench", "--dataset", str(root / "mixed.jsonl"), "--target", str(root / "target"), "--draft",
            str(root / "draft"), "--dtype", "float32", "--max-new-tokens", str(MAX_NEW), "--no-progress", *extra]


@pytest.fixture(scope="module")
def bench_run(folders: Path) -> tuple[dict, str, Path]:
    out = folders / "out" / "run.json"
    code, stdout = _main(_args(folders, "--methods", ",".join(METHODS), "--num-draft-tokens", "3",
                               "--json", str(out)))
    assert code == 0
    return json.loads(out.read_text()), stdout, out


def test_every_method_runs_and_json_has_the_schema(bench_run) -> None:
    report, _, _ = bench_run
    assert report["schema_version"] == 1
    assert list(report["methods"]) == METHODS
    assert set(report["categories"]) == {"mixed", "writing"} and report["datasets"] == ["mixed"]
    for key in ("command", "cpu", "cpu_flags", "kernel_prefetch", "cpu_cores", "torch", "torch_threads", "date",
                "git_commit"):
        assert key in report["machine"]
    assert report["settings"]["dtype"] == "float32" and report["settings"]["greedy"] is True
    for name, m in report["methods"].items():
        assert m["family"] == ("hf" if name.startswith("hf") else "ours")
        assert m["tokens_per_s"] > 0 and m["tokens_per_s_mean"] > 0 and m["speedup_vs_none"] > 0
        assert m["speedup_vs_hf"] > 0 and m["weights_bytes"] > 0 and m["peak_memory_bytes"] > 0
        assert m["prompts"] == len(ROWS) and m["generations"] == len(ROWS) + 1  # MT-Bench style: 2 turns
        assert m["ttft_s_mean"] > 0 and m["itl_s_p95"] >= m["itl_s_p50"] > 0
        assert isinstance(m["lossless"], bool) and isinstance(m["mismatches"], list)
        assert set(m["by_category"]) == set(report["categories"])
        assert m["by_category"]["writing"]["prompts"] == 1
    none = report["methods"]["none"]
    assert none["speedup_vs_none"] == pytest.approx(1.0) and none["mean_accepted_length"] == pytest.approx(1.0)
    assert none["acceptance_rate"] is None and report["methods"]["hf"]["mean_accepted_length"] == pytest.approx(1.0)
    draft = report["methods"]["draft"]
    assert draft["num_draft_tokens"] == 3 and 0 <= draft["acceptance_rate"] <= 1
    assert 1 <= len(draft["acceptance_per_position"]) <= 3  # adaptive: an unsure draft stops early
    assert len(report["runs"]) == len(ROWS) * len(METHODS)
    for run in report["runs"]:
        for turn in run["turns"]:
            assert 1 <= turn["new_tokens"] == len(turn["token_ids"]) <= MAX_NEW


def test_greedy_outputs_agree_across_methods_and_with_transformers(bench_run) -> None:
    report, _, _ = bench_run
    for name, m in report["methods"].items():
        assert m["lossless"] is True, (name, m["mismatches"])
        assert m["matches_hf"] is True, (name, m["mismatches_vs_hf"])


def test_table_and_plots_are_written(bench_run) -> None:
    report, stdout, out = bench_run
    assert "| method |" in stdout and "Speedup vs none by category" in stdout
    assert f"Machine: {report['machine']['cpu']} (" in stdout  # every figure names what it ran on
    for name in report["methods"]:
        assert f"| {name} |" in stdout
    for suffix in ("speedup", "acceptance"):
        png = out.parent / f"run-{suffix}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert markdown(report) in stdout  # the table renders from the saved JSON alone


def _run(method: str, tokens: list[list[int]], prompt_id: str = "p0") -> Run:
    turns = [TurnResult(t, wall_s=0.1, ttft_s=0.01, token_latencies_s=[0.01] * (len(t) - 1), decode_tokens=len(t) - 1,
                        decode_forwards=len(t) - 1) for t in tokens]
    return Run(method, Prompt(prompt_id, "data", "cat", ["q"] * len(tokens), True), 0, turns)


def test_lossless_check_flags_a_planted_mismatch() -> None:
    runs = [_run("none", [[1, 2, 3], [4, 5]]), _run("draft", [[1, 2, 3], [4, 9]]), _run("ngram", [[1, 2, 3], [4, 5]]),
            _run("none", [[7]], "p1"), _run("draft", [[7]], "p1"), _run("ngram", [[7, 8]], "p1")]
    facts = {m: {"family": "ours", "num_draft_tokens": 0, "weights_bytes": 1} for m in ("none", "draft", "ngram")}
    settings = dict(target="t", draft="d", dtype="float32", device="cpu", greedy=True, max_new_tokens=3, repeats=1,
                    temperature=0.0, top_p=1.0, top_k=0)
    report = build_report(runs, facts, settings, {}, greedy=True)
    draft, ngram = report["methods"]["draft"], report["methods"]["ngram"]
    assert report["methods"]["none"]["lossless"] is True
    assert draft["lossless"] is False and ngram["lossless"] is False
    assert [(x["prompt_id"], x["turn"], x["position"], x["expected"], x["got"]) for x in draft["mismatches"]] == [
        ("p0", 1, 1, 5, 9)]
    assert ngram["mismatches"][0]["position"] == 1 and ngram["mismatches"][0]["expected"] is None
    table = markdown(report)
    assert "NO (1 turns differ)" in table and "draft vs none: data:p0 turn 2" in table
    sampled = build_report(runs, facts, dict(settings, greedy=False), {}, greedy=False)
    assert sampled["methods"]["draft"]["lossless"] is None  # sampling: nothing to compare token by token


def test_first_difference() -> None:
    assert first_difference([1, 2], [1, 2]) is None
    assert first_difference([1, 2], [1, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2
    assert not find_mismatches([_run("none", [[1]]), _run("draft", [[1]])], "draft", "none")


def test_rows_and_limits(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS) + "\n")
    prompts = load_prompts([str(data)], limit=3)
    assert [(p.id, p.chat, len(p.turns)) for p in prompts] == [("T/0", False, 1), ("2", True, 1), ("7", True, 2)]
    assert prompts[2].category == "writing" and prompts[0].category == "d"
    assert prompts[2].messages(1, ["hi"])[1:] == [{"role": "assistant", "content": "hi"},
                                                    {"role": "user", "content": "Now say it again."}]
    system = parse_row(ROWS[3], "d", "d:4")
    assert system.messages(0, []) == ROWS[3]["messages"]
    assert parse_row(ROWS[0], "d", "d:1", prompt_as_chat=True).chat
    for bad, words in [({"text": "x"}, "needs one of"), ({"turns": []}, "turns"), ([1], "JSON object"),
                       ({"messages": [{"role": "assistant", "content": "x"}]}, "ending with a user")]:
        with pytest.raises(SpecdecodeError, match=words):
            parse_row(bad, "d", "d:1")
    with pytest.raises(SpecdecodeError, match="not found"):
        load_prompts([str(tmp_path / "missing.jsonl")])


def test_methods_are_checked_and_none_always_runs() -> None:
    assert parse_methods("ngram,hf,ngram") == ["none", "ngram", "hf"]
    with pytest.raises(SpecdecodeError, match="unknown method 'eagle7'"):
        parse_methods("none,eagle7")


def test_sampling_with_repeats_skips_the_token_check(folders: Path) -> None:
    code, stdout = _main(_args(folders, "--methods", "ngram,hf", "--temperature", "0.8", "--top-k", "0", "--seed",
                               "1", "--repeats", "2", "--limit", "2"))
    assert code == 0 and "2 prompts x 2 repeats" in stdout and stdout.count("n/a (sampling)") == 3


def test_bad_method_fails_before_loading(folders: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(["bench", "--dataset", str(folders / "mixed.jsonl"), "--methods", "none,nope"]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err


def test_llamacpp_needs_a_gguf_target_and_says_so(folders: Path, capsys: pytest.CaptureFixture) -> None:
    assert main(_args(folders, "--methods", "llamacpp", "--limit", "1")) == 2
    err = capsys.readouterr().err
    assert "llama-cpp-python" in err or "GGUF" in err
