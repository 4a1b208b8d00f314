"""A newcomer's first mistakes end in one `specdecode: error:` line (or exit 130 on Ctrl-C), never a traceback, and
nothing is written to the cache before the request is known to run: a prompt that is not UTF-8, a device torch
cannot use, a Ctrl-C while torch loads or while an answer streams."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from specdecode.cli import command_line_text, main
from specdecode.devices import available_devices, check_device
from specdecode.errors import SpecdecodeError

LATIN1_PROMPT = "caf\udce9 cr\udce8me"  # b"caf\xe9 cr\xe8me" as Python hands it over from argv (surrogateescape)


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("specdecode: error: "), err
    assert "Traceback" not in err
    return lines[0]


def test_a_prompt_that_is_not_utf8_is_one_line_naming_the_fix(capsys):
    assert main(["generate", LATIN1_PROMPT, "--target", "/no/such/model.gguf"]) == 2
    line = one_error_line(capsys)
    assert "prompt is not utf-8" in line and "0xe9" in line and "--prompt-encoding" in line


def test_a_stop_string_that_is_not_utf8_is_refused_too(capsys):
    assert main(["generate", "hi", "--stop", "\udcff", "--target", "/no/such/model.gguf"]) == 2
    assert "--stop" in one_error_line(capsys)


def test_prompt_encoding_decodes_the_bytes_the_shell_passed():
    assert command_line_text(LATIN1_PROMPT, "prompt", "latin-1") == "café crème"
    assert command_line_text("café", "prompt", "utf-8") == "café"  # valid text passes through as it is
    with pytest.raises(SpecdecodeError, match="lone surrogate"):
        command_line_text("\ud800", "prompt", "utf-8")


def test_an_unknown_prompt_encoding_is_one_line(capsys):
    assert main(["generate", "hi", "--prompt-encoding", "no-such-codec"]) == 2
    assert "--prompt-encoding no-such-codec" in one_error_line(capsys)


@pytest.mark.parametrize("device, words", [("gpu", "not a device name"), ("cuda", "CPU-only"),
                                           ("cuda:7", "CPU-only"), ("npu", "not a device name")])
def test_a_device_torch_cannot_use_is_refused_before_anything_is_written(device, words, tmp_path, monkeypatch,
                                                                          capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a CPU-only build of torch
    monkeypatch.setattr(torch.version, "cuda", None)
    cache = tmp_path / "cache"
    monkeypatch.setenv("SPECDECODE_CACHE", str(cache))
    for command in (["generate", "hi"], ["serve"]):  # the default target: a download, had the device been fine
        assert main([*command, "--device", device]) == 2
        line = one_error_line(capsys)
        assert f"--device {device}" in line and words in line and "--device cpu" in line, line
    assert not cache.exists() or not any(cache.rglob("*")), sorted(cache.rglob("*"))


def test_the_error_names_the_devices_there_are(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert available_devices()[:4] == ["cpu", "cuda", "cuda:0", "cuda:1"]
    check_device("cuda:1")
    with pytest.raises(SpecdecodeError, match=r"has 2 CUDA GPU\(s\); use one of cpu, cuda, cuda:0, cuda:1"):
        check_device("cuda:2")


# --- Ctrl-C: a real process, a real SIGINT ---

TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(c) for c in range(33, 127)] + ["Ġ", "Ċ"]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(TOKENS), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192,
                         rope_theta=10000.0, bos_token_id=1, eos_token_id=2)
    Qwen2ForCausalLM(config).eval().save_pretrained(folder)
    backend = Tokenizer(models.BPE({t: i for i, t in enumerate(TOKENS)}, []))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|im_start|>",
                            eos_token="<|im_end|>").save_pretrained(folder)
    return folder


def start(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "specdecode", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_ctrl_c_while_torch_loads_exits_130_without_a_traceback():
    proc = start("generate", "hi")
    time.sleep(0.5)  # inside the imports: torch alone takes seconds
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err.decode()
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err, err.decode()


def test_ctrl_c_mid_answer_ends_the_line_and_summarizes_what_was_generated(tiny_folder):
    proc = start("generate", "abc", "--target", str(tiny_folder), "--method", "none", "--dtype", "float32",
                 "--weights", "float", "--max-new-tokens", "6000", "--min-tokens", "6000", "--max-len", "8192")
    first = proc.stdout.read(1)  # the answer has begun
    assert first, proc.stderr.read().decode()
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    text = err.decode()
    assert proc.returncode == 130, text
    assert "Traceback" not in text
    summary = [line for line in text.splitlines() if line.strip()][-1]
    assert summary.startswith("[none] interrupted: ") and " tokens in " in summary, text
    assert "\n\n[none] interrupted: " in text  # the cut line is ended before the summary
