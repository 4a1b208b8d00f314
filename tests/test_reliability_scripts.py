"""scripts/fault_run.py and scripts/soak.py, each run for a few seconds on a tiny random model, so that they keep
working as the server changes: their checks pass, their reports say what every client saw, and no server they
started outlives them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_bench import _write_model as write_tiny_folder

SCRIPTS = Path(__file__).resolve().parent.parent / "scripts"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("reliability") / "tiny"
    write_tiny_folder(folder, seed=0)
    return folder


def processes_naming(text: str) -> list[str]:
    """The command lines of running processes that mention `text` (a server started on this test's folder)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it ended while we looked
            continue
        if text in args:
            found.append(args)
    return found


def run_script(name: str, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([sys.executable, str(SCRIPTS / name), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # the scripts stop their servers on SIGTERM
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"{name} did not finish within {timeout:g} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_fault_run_engine_parts(tiny, tmp_path):
    report_file = tmp_path / "faults.json"
    result = run_script("fault_run.py", "--parts", "admit,step,loop", "--serve",
                        f"--target {tiny} --method ngram --dtype float32", "--settle", "1", "--json", str(report_file))
    assert not processes_naming(str(tiny)), "a server outlived the script"
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(report_file.read_text())
    assert report["failed checks"] == []
    assert report["admit"]["faulty request, whole"].startswith("500")  # the fault was injected, and cost only it
    assert report["step"]["a new request after, streamed / whole"] == ["complete, [DONE]", "200 complete"]
    assert report["loop"]["server exit status"] == 3 and report["loop"]["a new request after restart"] == "200 complete"
    assert report["exit status after SIGTERM"] == 0


def test_soak_short(tiny, tmp_path):
    report_file = tmp_path / "soak.json"
    result = run_script("soak.py", "--serve", f"--target {tiny} --method ngram --dtype float32", "--clients", "4",
                        "--minutes", "0.05", "--max-tokens", "8", "--malformed", "0.3", "--disconnect", "0.2",
                        "--drain-timeout", "5", "--json", str(report_file))
    assert not processes_naming(str(tiny)), "a server outlived the script"
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(report_file.read_text())
    assert report["valid_requests"] and report["valid_statuses"] == {"200": report["valid_requests"]}
    assert report["malformed"] and report["malformed_not_refused"] == []
    assert report["answers_differing_from_alone"] == 0
    assert set(report["sigterm_endings"]) <= {"200", "error-event"} and report["exit_code"] == 0
