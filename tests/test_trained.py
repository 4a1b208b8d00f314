"""Trained drafters on tiny random models: `specdecode train eagle | medusa | draft` end to end, the heads and the
adapter loading in generate and bench, greedy output token-identical to plain decoding, sampled output distributed
as the target's, and the bad-input errors (malformed data, a head for another target, an interrupted cache)."""

from __future__ import annotations

import io
import json
import random
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch
from test_bench import _write_model
from tiny import tiny_native
from toy import assert_exact_distribution

from specdecode.api import SpecDecoder
from specdecode.cli import main
from specdecode.config import SamplingParams
from specdecode.drafters.eagle import EagleDrafter
from specdecode.drafters.hybrid import HybridDrafter
from specdecode.drafters.medusa import MedusaDrafter, static_tree
from specdecode.drafters.none import NoDrafter
from specdecode.engine.engine import Engine
from specdecode.errors import SpecdecodeError
from specdecode.methods import METHODS
from specdecode.training import features as feature_cache
from specdecode.training.data import Example, expand, read_examples

WORDS = ["def", "return", "x", "y", "+", "1", "(", ")", ":", "if", "else", "for", "in", "range", "print"]
PROMPTS = ["def f(x):", "for i in range(3):", "print(x + 1)"]


def _main(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(args)
    return code, out.getvalue(), err.getvalue()


def _data(path: Path, records: int = 60, seed: int = 0) -> Path:
    rng = random.Random(seed)
    lines = []
    for _ in range(records):
        answer = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 30)))
        ask = " ".join(["write"] + [rng.choice(WORDS) for _ in range(3)])
        lines.append(json.dumps({"messages": [{"role": "user", "content": ask},
                                              {"role": "assistant", "content": answer}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


OUT = {"eagle": "eagle", "medusa": "medusa", "draft": "lora"}  # the folder each kind is trained into


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("trained")
    _write_model(root / "target", seed=0)
    _write_model(root / "draft", seed=1)
    data = _data(root / "data.jsonl")
    common = ["--target", str(root / "target"), "--data", str(data), "--max-tokens", "4000", "--epochs", "1",
              "--cache", str(root / "cache"), "--dtype", "float32"]
    for kind, extra in (("eagle", ["--intermediate-size", "64"]), ("medusa", ["--heads", "3"]),
                        ("draft", ["--draft", str(root / "draft"), "--rank", "4", "--merge", str(root / "merged")])):
        code, out, err = _main(["train", kind, *common, "--out", str(root / OUT[kind]), *extra])
        assert code == 0, err
        assert "expected mean accepted length" in out
    return root


def test_train_writes_a_folder_naming_its_target(trained: Path) -> None:
    for kind in ("eagle", "medusa", "draft"):
        meta = json.loads((trained / OUT[kind] / "config.json").read_text())
        assert meta["kind"] == kind and len(meta["target_fingerprint"]) == 16
        assert (trained / OUT[kind] / "model.safetensors").is_file()
        report = meta["report"]
        assert report["rows"] > 0 and 1.0 <= report["mean_accepted_length"]
        assert all(0.0 <= p <= 1.0 for p in report["acceptance_per_position"])
    assert (trained / "merged" / "config.json").is_file()  # --merge wrote an HF folder
    assert len(list((trained / "cache").glob("features-*"))) == 1  # the three kinds shared one cache


def _generate(decoder: SpecDecoder, prompt: str, params: SamplingParams) -> list[int]:
    return decoder.generate(prompt, params).token_ids


@pytest.mark.parametrize("method,shape", [("eagle", "tree"), ("eagle", "chain"), ("medusa", "tree"),
                                          ("draft", "chain"), ("hybrid-eagle", "tree")])
def test_greedy_with_trained_drafters_is_token_identical(trained: Path, method: str, shape: str) -> None:
    target = str(trained / "target")
    plain = SpecDecoder.load(target, method="none", dtype="float32")
    kwargs = {"draft": str(trained / METHODS[method].head)} if method != "draft" else {
        "draft": str(trained / "draft"), "draft_adapter": str(trained / "lora")}
    decoder = SpecDecoder.load(target, method=method, dtype="float32", draft_shape=shape,
                               num_draft_tokens=4,  # fixed: an automatic budget may find tiny drafts not worth it
                               **kwargs)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    for prompt in PROMPTS:
        assert _generate(decoder, prompt, params) == _generate(plain, prompt, params)
    assert decoder.stats.drafted_tokens > 0


def test_merged_draft_runs_as_a_plain_draft(trained: Path) -> None:
    target = str(trained / "target")
    plain = SpecDecoder.load(target, method="none", dtype="float32")
    merged = SpecDecoder.load(target, method="draft", draft=str(trained / "merged"), dtype="float32")
    params = SamplingParams(max_new_tokens=16, ignore_eos=True)
    assert _generate(merged, PROMPTS[0], params) == _generate(plain, PROMPTS[0], params)


def test_trained_methods_run_in_bench(trained: Path) -> None:
    data = trained / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = trained / "bench.json"
    code, _, err = _main(["bench", "--dataset", str(data), "--target", str(trained / "target"), "--draft",
                          str(trained / "draft"), "--dtype", "float32", "--max-new-tokens", "8", "--no-progress",
                          "--methods", "none,draft,eagle,hybrid-eagle,medusa,draft-lora", "--eagle", str(trained / "eagle"),
                          "--medusa", str(trained / "medusa"), "--draft-adapter", str(trained / "lora"),
                          "--json", str(out)])
    assert code == 0, err
    report = json.loads(out.read_text())
    assert set(report["methods"]) == {"none", "draft", "eagle", "hybrid-eagle", "medusa", "draft-lora"}
    for name, m in report["methods"].items():
        assert m["lossless"] is True, (name, m["mismatches"])


def test_bench_names_the_missing_head_folder(trained: Path) -> None:
    code, _, err = _main(["bench", "--dataset", str(trained / "data.jsonl"), "--target", str(trained / "target"),
                          "--methods", "eagle"])
    assert code == 2 and "--eagle DIR" in err and "Traceback" not in err


def test_a_head_for_another_target_is_refused(trained: Path) -> None:
    # Another model of the same shape; its norms trained (a fresh init's are all ones, like the target's).
    other = trained / "other"
    _write_model(other, seed=2)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(other / "model.safetensors"))
    save_file({k: v * 1.5 if "norm" in k else v for k, v in weights.items()}, str(other / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(SpecdecodeError, match="trained for target"):
        SpecDecoder.load(str(other), method="eagle", draft=str(trained / "eagle"), dtype="float32")
    code, _, err = _main(["generate", "hi", "--target", str(other), "--method", "medusa", "--draft",
                          str(trained / "medusa"), "--dtype", "float32"])
    assert code == 2 and "trained for target" in err and err.count("\n") == 1
    with pytest.raises(SpecdecodeError, match="needs --draft DIR"):
        SpecDecoder.load(str(trained / "target"), method="eagle", dtype="float32")


@pytest.mark.parametrize("content,message", [
    ('{"messages": [{"role": "user", "content": "hi"}]}\n', "data.jsonl:1: no assistant message"),
    ('{"text": "fine text here for sure"}\nnot json\n', "data.jsonl:2: not valid JSON"),
    ('{"answer": 1}\n', "data.jsonl:1: a record needs"),
    ("", "no training examples"),
])
def test_bad_data_names_file_and_line(trained: Path, tmp_path: Path, content: str, message: str) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text(content)
    code, _, err = _main(["train", "eagle", "--target", str(trained / "target"), "--data", str(data), "--out",
                          str(tmp_path / "out"), "--dtype", "float32", "--cache", str(tmp_path / "cache")])
    assert code == 2 and message in err and "Traceback" not in err


def test_no_matching_data_file_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SpecdecodeError, match="no file matches"):
        expand([str(tmp_path / "*.jsonl")])


def test_an_interrupted_feature_cache_resumes_where_it_stopped(trained: Path, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    target = SpecDecoder.load(str(trained / "target"), method="none", dtype="float32").engine.target
    tokenizer = SpecDecoder.load(str(trained / "target"), method="none", dtype="float32").tokenizer
    examples = list(read_examples([trained / "data.jsonl"], tokenizer, 256))[:8]
    monkeypatch.setattr(feature_cache, "SHARD_TOKENS", 1)  # a shard per example
    settings = {"feature_layers": [0, 1]}
    full = feature_cache.build(target, examples[2:], examples[:2], tmp_path, settings)
    # Interrupted after 5 examples: the manifest lists 5 shards.
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    manifest["shards"], manifest["done"] = manifest["shards"][:5], 5
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    computed: list[Example] = []
    real = feature_cache._example_rows
    monkeypatch.setattr(feature_cache, "_example_rows", lambda t, e, layers: computed.append(e) or real(t, e, layers))
    resumed = feature_cache.build(target, examples[2:], examples[:2], tmp_path, settings)
    assert computed == examples[5:]
    assert torch.equal(resumed.tokens, full.tokens) and torch.equal(resumed.hidden, full.hidden)
    assert resumed.held == 2 and len(resumed.seq_starts) == 9


def test_memory_is_checked_before_the_work(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(feature_cache, "_available_bytes", lambda: 1 << 30)
    with pytest.raises(SpecdecodeError, match="lower --max-tokens"):
        feature_cache.check_memory(feature_cache.estimate_bytes(10**6, 1536, 4), "the features")


def test_static_tree_keeps_parents_and_the_likeliest_paths() -> None:
    tree = static_tree([[0.6, 0.2], [0.5, 0.1], [0.4]], 5)
    assert tree == [(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]
    assert all(p[:-1] in tree for p in tree if len(p) > 1)


# Sampling: the output distribution of the target (top-2 of a tiny random model, 3 tokens: 8 outcomes) must not
# change with an EAGLE head or Medusa heads drafting. The heads are trained in a few seconds on the target's own
# sampled text, so their guesses are often right and the accept and reject paths both run.
SAMPLED = SamplingParams(temperature=1.5, top_k=2, max_new_tokens=3, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_heads(tmp_path_factory: pytest.TempPathFactory):
    from specdecode.training import eagle, medusa

    target = tiny_native("qwen2", seed=0)
    engine = Engine(target, NoDrafter())
    examples = []
    for i in range(60):
        prompt = [1 + i % 7, 2 + i % 5, 3, 4]
        params = SamplingParams(**{**SAMPLED.__dict__, "max_new_tokens": 40, "seed": i})
        text = [t for step in engine.generate(prompt, params) for t in step.tokens]
        examples.append(Example(prompt + text, [False] * 4 + [True] * len(text), f"sample {i}"))
    layers = (0, 1)
    feats = feature_cache.build(target, examples[4:], examples[:4], tmp_path_factory.mktemp("features"),
                                {"feature_layers": list(layers)})
    head = eagle.new_head(target, feats, layers, 48, 64)
    eagle.train(head, target, feats, epochs=8, steps=2, lr=3e-3, seconds=None)
    heads = medusa.new_heads(target, feats, 2, 48)
    medusa.train(heads, feats, epochs=8, lr=3e-3, seconds=None)
    accuracy = medusa.evaluate(heads, feats)["top_accuracy"]
    return target, head, heads, accuracy


def _exact_top2(target: torch.nn.Module, prompt: list[int], length: int, params: SamplingParams) -> dict:
    from specdecode.sampling import to_probs

    out: dict[tuple, float] = {}

    def walk(seq: list[int], prob: float) -> None:
        if len(seq) == length:
            out[tuple(seq)] = prob
            return
        ids = torch.tensor([prompt + seq])
        cache = target.new_cache(1, ids.shape[1])
        from specdecode.models.masks import chain_mask

        logits, _ = target(ids, torch.arange(ids.shape[1])[None], cache, chain_mask(0, ids.shape[1], "cpu"),
                           logits_from=ids.shape[1] - 1)
        probs = to_probs(logits[0, -1], params)
        for tok in probs.nonzero().squeeze(-1).tolist():
            walk(seq + [tok], prob * float(probs[tok]))

    with torch.inference_mode():
        walk([], 1.0)
    return out


@pytest.mark.parametrize("kind", ["eagle", "medusa", "hybrid-eagle"])
def test_sampling_with_trained_drafters_keeps_the_targets_distribution(tiny_heads, kind: str) -> None:
    target, head, heads, accuracy = tiny_heads
    prompt = [1, 2, 3, 4]
    exact = _exact_top2(target, prompt, 3, SAMPLED)
    if kind == "medusa":
        # four guesses a head: with two, whether this one prompt's guesses meet the target's two tokens at all
        # hangs on how the tiny heads happened to train (on texts sampled by the engine)
        drafter = MedusaDrafter(heads, [row[:4] for row in accuracy])
    else:
        drafter = EagleDrafter(head, target, (0, 1), width=2, expand=2, max_depth=3)
        drafter = HybridDrafter(drafter) if kind == "hybrid-eagle" else drafter
    engine = Engine(target, drafter, num_draft_tokens=3)
    trials = 2500
    counts: dict[tuple, int] = {}
    accepted = 0
    for i in range(trials):
        out = tuple(t for step in engine.generate(prompt, SamplingParams(**{**SAMPLED.__dict__, "seed": i}))
                    for t in step.tokens)
        counts[out] = counts.get(out, 0) + 1
        accepted += engine.last.stats.accepted_tokens
    assert accepted > trials // 10  # the drafts were really verified, and often accepted
    assert_exact_distribution(counts, exact)


@pytest.mark.parametrize("width", [1, 3])
def test_eagle_greedy_on_a_quickly_trained_head_matches_plain(tiny_heads, width: int) -> None:
    target, head, _, _ = tiny_heads
    prompt = list(range(1, 20))
    params = SamplingParams(max_new_tokens=30, ignore_eos=True)
    plain = [t for s in Engine(target, NoDrafter()).generate(prompt, params) for t in s.tokens]
    drafter = EagleDrafter(head, target, (0, 1), width=width)
    engine = Engine(target, drafter, num_draft_tokens=5)
    assert [t for s in engine.generate(prompt, params) for t in s.tokens] == plain
    assert engine.last.stats.accepted_tokens > 0


def test_hybrid_eagle_copies_and_drafts_with_the_head_and_matches_plain(tiny_heads) -> None:
    """Copy steps and head steps alternate: the head must read the features of every step it sat out."""
    target, head, _, _ = tiny_heads
    prompt = [5, 6, 7, 8, 9, 10, 11, 1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    plain = [t for s in Engine(target, NoDrafter()).generate(prompt, params) for t in s.tokens]
    drafter = HybridDrafter(EagleDrafter(head, target, (0, 1), width=2))
    used = []

    def counted_fork(fork=drafter.fork):  # the request's drafter says which of its two drafters committed
        forked = fork()
        commit = forked.commit
        forked.commit = lambda *a: (used.append(type(forked.used).__name__), commit(*a))  # type: ignore[method-assign]
        return forked
    drafter.fork = counted_fork  # type: ignore[method-assign]
    engine = Engine(target, drafter, num_draft_tokens=5)
    assert [t for s in engine.generate(prompt, params) for t in s.tokens] == plain
    assert {"NgramDrafter", "EagleDrafter"} <= set(used)
    assert engine.last.stats.accepted_tokens > 0


@pytest.mark.parametrize("hybrid", [False, True])
def test_eagle_in_a_batch_with_chunked_prefill_matches_plain(tiny_heads, fixed_prefill, hybrid: bool) -> None:
    """The server's engine: requests joining at different steps, prompts fed in chunks (the head must get every
    position's features, across chunks and steps it sat out)."""
    from test_batch import run_batch

    target, head, _, _ = tiny_heads
    fixed_prefill(busy=5, idle=7)
    prompts = [[1, 2, 3, 4, 1, 2, 3], list(range(5, 45)), [7, 7, 7, 7]]
    params = SamplingParams(max_new_tokens=20, ignore_eos=True)
    eagle = EagleDrafter(head, target, (0, 1), width=2)
    drafter = HybridDrafter(eagle) if hybrid else eagle
    together = run_batch(Engine(target, drafter, 4), [(p, params) for p in prompts], arrivals=[0, 1, 3])
    for prompt, got in zip(prompts, together):
        assert got == [t for s in Engine(target, NoDrafter()).generate(prompt, params) for t in s.tokens]


def test_a_corpus_too_small_is_one_clear_error(trained: Path, tmp_path: Path) -> None:
    data = _data(tmp_path / "small.jsonl", records=3)
    code, _, err = _main(["train", "medusa", "--target", str(trained / "target"), "--data", str(data), "--out",
                          str(tmp_path / "out"), "--dtype", "float32", "--cache", str(tmp_path / "cache")])
    assert code == 2 and "too few to learn from" in err and err.count("\n") == 1


def test_regenerate_lets_the_target_write_and_resumes_from_its_log(trained: Path, tmp_path: Path) -> None:
    data = _data(tmp_path / "data.jsonl", records=40)
    args = ["train", "medusa", "--target", str(trained / "target"), "--data", str(data), "--out",
            str(tmp_path / "out"), "--dtype", "float32", "--cache", str(tmp_path / "cache"), "--regenerate",
            "--epochs", "1", "--heads", "2"]
    code, _, err = _main([*args, "--max-tokens", "1500"])
    assert code == 0, err
    (log,) = (tmp_path / "cache").glob("answers-*.jsonl")
    first = len(log.read_text().splitlines())
    assert 0 < first < 40
    with open(log, "a") as f:
        f.write('{"key": "abc", "answer": [1, 2')  # an interrupt in the middle of a line
    code, _, err = _main(args)  # a larger budget: only the answers the log lacks are written
    assert code == 0, err
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == 40 and len({r["key"] for r in records}) == 40
    assert all(len(r["answer"]) >= 8 for r in records)
    # The same data under another name, next to more: only the new file's prompts are answered.
    moved = tmp_path / "moved.jsonl"
    data.rename(moved)
    more = _data(tmp_path / "more.jsonl", records=10, seed=1)
    code, _, err = _main([*args[:5], str(moved), str(more), *args[6:]])
    assert code == 0, err
    assert len(log.read_text().splitlines()) == 50


def test_regenerated_answers_are_the_targets_plain_greedy_answers(tmp_path: Path) -> None:
    from specdecode.planner.budget import CostCurve
    from specdecode.training.regenerate import MIN_ANSWER, regenerate

    target = tiny_native("qwen2", seed=0)
    prompts = [[1, 2, 3, 4, 1, 2, 3, 4, 1, 2], [9, 8, 7, 9, 8, 7, 9], list(range(20, 40))]
    examples = [Example(p + [5] * 6, [False] * len(p) + [True] * 6, f"data:{i}") for i, p in enumerate(prompts)]
    flat = CostCurve(tuple([1.0] * 16))  # verifying is free: every draft the lookup finds is verified
    train, held = regenerate(target, examples[1:], examples[:1], 128, tmp_path / "log.jsonl", flat)
    plain = Engine(target, NoDrafter(), num_draft_tokens=0)
    for prompt, got in zip(prompts, held + train):
        answer = [t for s in plain.generate(prompt, SamplingParams(max_new_tokens=MIN_ANSWER)) for t in s.tokens]
        assert got.ids == prompt + answer and got.loss == [False] * len(prompt) + [True] * len(answer)


def test_bench_runs_trained_methods_by_default_only_when_given_their_folders() -> None:
    import argparse

    from specdecode.bench.cli import default_methods

    none_given = default_methods(argparse.Namespace(eagle=None, medusa=None, draft_adapter=None))
    assert not any(m.startswith(("eagle", "medusa", "draft-lora", "hybrid-eagle")) for m in none_given)
    assert "draft" in none_given
    given = default_methods(argparse.Namespace(eagle="e", medusa="m", draft_adapter="a"))
    assert {"eagle", "eagle-tree", "hybrid-eagle", "medusa", "draft-lora"} <= set(given)


def test_function_prompts_ask_to_complete_each_documented_function(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("function_prompts", Path(__file__).parents[1] / "scripts" /
                                                  "function_prompts.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    (tmp_path / "m.py").write_text(
        'def add(a, b):\n    """Sum of a and b."""\n    return a + b\n\n\n'
        "def bare(x):\n    return x\n\n\n"
        'class C:\n    @staticmethod\n    def twice(x):\n        """Two x."""\n        y = 2 * x\n        return y\n\n'
        '    def stub(self):\n        """Only a docstring."""\n')
    (tmp_path / "broken.py").write_text("def (:\n")
    out = tmp_path / "functions.jsonl"
    with redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()) as err:
        assert script.main([str(tmp_path / "*.py"), "--out", str(out)]) == 0
    assert "skipped" in err.getvalue() and "broken.py" in err.getvalue()
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 2  # add and twice: `bare` has no docstring, `stub` nothing to complete
    add, twice = sorted(rows, key=lambda r: "twice" in r["prompt"])
    assert '"""Sum of a and b."""' in add["prompt"] and "return a + b" not in add["prompt"]
    assert "return a + b" in add["response"]
    assert twice["prompt"].count("@staticmethod\ndef twice(x):") == 1  # decorated, dedented
    assert "y = 2 * x" in twice["response"]


def test_the_answers_log_is_repaired_by_truncation_and_bad_lines_are_skipped(tmp_path: Path, capsys) -> None:
    from specdecode.training.regenerate import _read_log

    log = tmp_path / "answers.jsonl"
    good = '{"key": "a", "answer": [1]}\n{"key": "b", "answer": [2, 3]}\n'
    log.write_text(good[:28] + "not json\n" + good[28:] + '{"key": "c", "answ')
    inode = log.stat().st_ino
    assert _read_log(log) == {"a": [1], "b": [2, 3]}
    assert log.read_text() == good[:28] + "not json\n" + good[28:]  # only the torn line went, in place
    assert log.stat().st_ino == inode and "is not an answer record" in capsys.readouterr().err


def test_a_trained_folder_is_replaced_whole_or_not_at_all(tmp_path: Path) -> None:
    from specdecode.weights import store

    target = tiny_native("qwen2", seed=0)
    out = tmp_path / "head"
    store.save(out, "medusa", {"v": 1}, {"w": torch.zeros(2)}, target, "t")
    with pytest.raises(Exception):  # noqa: B017 - an interrupt while writing: here, a tensor that cannot be written
        store.save(out, "medusa", {"v": 2}, {"w": "not a tensor"}, target, "t")
    assert json.loads((out / store.CONFIG).read_text())["config"] == {"v": 1}  # the old folder, whole
    store.save(out, "medusa", {"v": 3}, {"w": torch.ones(2)}, target, "t")
    assert json.loads((out / store.CONFIG).read_text())["config"] == {"v": 3}
    assert [p.name for p in tmp_path.iterdir()] == ["head"]  # nothing staged is left behind
