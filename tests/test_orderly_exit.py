"""What is learned is never lost: `specdecode serve` exits 0 after its drain and saves its suffix pool, every answer
in it; a save killed midway leaves a temporary that the next start removes; a trained folder replaced by a run
killed between its two renames is still found, old or new; SIGTERM to any other command exits through atexit."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
from test_bench import _write_model as write_tiny_folder
from tiny import tiny_native

from specdecode import atomic_files
from specdecode.atomic_files import recover_folder
from specdecode.cli import exit_on_sigterm
from specdecode.drafters.suffix_pool import SuffixPool
from specdecode.weights import store


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(folder: Path, *extra: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "specdecode", "serve", "--target", str(folder), "--dtype",
                             "float32", "--port", str(port), "--log-level", "warning", *extra],
                            stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("the server did not come up")


def chat(content: str, tokens: int, stream: bool = False) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}


def test_sigterm_drains_exits_0_and_the_pool_file_holds_every_answer(tmp_path):
    write_tiny_folder(tmp_path / "tiny", seed=0)
    pool = tmp_path / "answers.npz"
    stray = tmp_path / "answers.npzk1ll3d.tmp"  # what a save SIGKILLed midway leaves
    stray.write_bytes(b"half a pool")
    proc, url = start_serve(tmp_path / "tiny", "--method", "suffix", "--suffix-pool", str(pool),
                            "--served-model-name", "m", "--drain-timeout", "60")
    try:
        assert not stray.exists()  # removed at start
        with httpx.Client(base_url=url, timeout=60) as http:
            for i in range(6):
                assert http.post("/v1/chat/completions", json=chat(f"question {i}", 8)).status_code == 200
            with http.stream("POST", "/v1/chat/completions", json=chat("a long one", 48, stream=True)) as r:
                lines = (line for line in r.iter_lines() if line.startswith("data: "))
                assert "choices" in next(lines)
                proc.send_signal(signal.SIGTERM)  # a stream is open: it finishes within the drain
                rest = list(lines)
        assert rest[-1] == "data: [DONE]" and not any('"error"' in line for line in rest)
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    with np.load(pool) as saved:
        assert saved["lengths"].tolist() == [8] * 6 + [48]  # every answer, the one finished while draining too
    assert not list(tmp_path.glob("*.tmp"))


def test_a_pool_removes_the_temporaries_of_a_killed_save(tmp_path):
    path = tmp_path / "pool.npz"
    first = SuffixPool(1.0, "fp", str(path))
    first.add([1, 2, 3, 4])
    first.save()
    (tmp_path / "pool.npz8a7sd.tmp").write_bytes(b"torn")
    (tmp_path / "other.npz.tmp").write_bytes(b"not ours")
    again = SuffixPool(1.0, "fp", str(path))
    assert [a.tolist() for a in again.answers] == [[1, 2, 3, 4]]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.npz.tmp", "pool.npz"]


class Killed(BaseException):
    """A kill at that point: nothing after it in the writer runs (no `except Exception`, no cleanup)."""


def kill_at_replace(monkeypatch, call: int) -> None:
    """The writer dies just before its `call`-th os.replace (1: before the old folder moves, 2: between the two)."""
    real, calls = os.replace, []

    def replace(src, dst):
        calls.append(src)
        if len(calls) == call:
            raise Killed
        real(src, dst)

    monkeypatch.setattr(atomic_files.os, "replace", replace)


def save(out: Path, version: int) -> None:
    store.save(out, "medusa", {"version": version}, {"w": torch.ones(2) * version}, TARGET, "tiny")


TARGET = tiny_native()


@pytest.mark.parametrize("call, survivor", [(1, 1), (2, 2)])
def test_a_folder_replacement_killed_at_any_rename_leaves_a_whole_folder(tmp_path, monkeypatch, call, survivor):
    out = tmp_path / "heads"
    save(out, 1)
    with monkeypatch.context() as patch:
        kill_at_replace(patch, call)
        with pytest.raises(Killed):
            save(out, 2)
    assert out.exists() == (call == 1)  # killed between the renames: nothing under the name until recovered
    meta = store.read_meta(out, "medusa")  # what loading does first: the replacement is finished
    assert meta["config"]["version"] == survivor
    assert store.load(out, "medusa", TARGET)[1]["w"].tolist() == [survivor] * 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads"]  # nothing left beside it
    save(out, 3)  # and the next run replaces it as usual
    assert store.read_meta(out)["config"]["version"] == 3


def test_a_run_killed_while_writing_keeps_the_old_folder_and_its_staging_goes(tmp_path, monkeypatch):
    out = tmp_path / "heads"
    save(out, 1)
    with monkeypatch.context() as patch:
        patch.setattr(store, "save_file", lambda *a, **k: (_ for _ in ()).throw(Killed()))
        with pytest.raises(Killed):
            save(out, 2)
    assert any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    assert store.read_meta(out)["config"]["version"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heads"]


def test_another_live_writers_staging_is_left_alone(tmp_path):
    out = tmp_path / "heads"
    out.mkdir()
    (out / store.CONFIG).write_text(json.dumps({"kind": "medusa"}))
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        staging = tmp_path / f".heads.{live.pid}.tmp"
        staging.mkdir()
        recover_folder(out)
        assert staging.exists()  # still being written by a process that runs
    finally:
        live.kill()
        live.wait()
    recover_folder(out)
    assert not staging.exists()  # its writer is gone: a leftover


def test_sigterm_to_a_command_exits_through_atexit_and_the_handler_is_put_back():
    before = signal.getsignal(signal.SIGTERM)
    if before != signal.SIG_DFL:
        pytest.skip("this test process has a SIGTERM handler of its own")
    previous = exit_on_sigterm()
    try:
        with pytest.raises(SystemExit) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler runs at the next bytecode; this is never reached
        assert stopped.value.code == 143
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    assert signal.getsignal(signal.SIGTERM) == before
