"""The native kernels' build in a shared cache: processes starting together build once, later starts load what is
built without running the build, an interrupted or killed build leaves no compiler running, and the build key
holds what makes a build differ (not how the paths to it are spelt).

Stand-in builds (tests/stand_in_build.py) take seconds: the loader and its lock are under test, not the kernels.
The processes here load specdecode/kernels/build.py by its path (it imports only the standard library), so each
starts in milliseconds instead of importing torch."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specdecode import kernels
from specdecode.kernels import build as kernel_build

TESTS = Path(__file__).resolve().parent
BUILD_PY = Path(kernel_build.__file__).resolve()
STARTERS = 4  # processes asking for one build at once

# One process asking for a build: loads the loader by path, says it arrived, then asks.
ASK = f"""
import importlib.util, json, sys
from pathlib import Path
spec = importlib.util.spec_from_file_location("kernel_build", {str(BUILD_PY)!r})
build = importlib.util.module_from_spec(spec); spec.loader.exec_module(build)
folder, name, target, kwargs, arrivals = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), sys.argv[5]
if arrivals:
    with open(arrivals, "a") as out:
        out.write("here\\n")
module = build.load_or_build(Path(folder), name, target, kwargs, "a stand-in library")
print(module.answer() if hasattr(module, "answer") else "loaded")
"""


def env() -> dict[str, str]:
    import ninja  # the pip-installed ninja, maybe not on PATH (as kernels/__init__.py finds it)

    return {**os.environ, "PYTHONPATH": str(TESTS), "PATH": ninja.BIN_DIR + os.pathsep + os.environ["PATH"]}


def ask(folder: Path, name: str, target: str, kwargs: dict, arrivals: Path | None = None) -> subprocess.Popen:
    import json

    return subprocess.Popen([sys.executable, "-c", ASK, str(folder), name, target, json.dumps(kwargs),
                             str(arrivals or "")], env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")


@needs_cc
def test_processes_starting_together_build_once_and_later_ones_load_what_is_built(tmp_path):
    folder, log, arrivals = tmp_path / "build", tmp_path / "builds.log", tmp_path / "arrivals"
    arrivals.write_text("")
    kwargs = {"name": "tiny_ext", "build_directory": str(folder), "log": str(log), "arrivals": str(arrivals),
              "expected": STARTERS}
    starters = [ask(folder, "tiny_ext", "stand_in_build:tiny_extension", kwargs, arrivals) for _ in range(STARTERS)]
    results = [p.communicate(timeout=120) + (p.returncode,) for p in starters]
    for out, err, code in results:
        assert code == 0 and out.strip() == "42", err
    assert len(log.read_text().splitlines()) == 1  # exactly one build
    said = [err for _, err, _ in results]
    assert sum("specdecode: building a stand-in library" in err for err in said) == 1
    # every other process waited on the lock and said so, once
    assert sorted(err.count("another process is building") for err in said) == [0] + [1] * (STARTERS - 1), said
    # A later start loads the library as built: no build, nothing said (not even ninja would run).
    later = ask(folder, "tiny_ext", "stand_in_build:tiny_extension", kwargs)
    out, err = later.communicate(timeout=180)
    assert later.returncode == 0 and out.strip() == "42" and err == ""
    assert len(log.read_text().splitlines()) == 1


@needs_cc
def test_a_library_whose_build_never_finished_is_built_again(tmp_path):
    folder, log = tmp_path / "build", tmp_path / "builds.log"
    folder.mkdir()
    (folder / "tiny_ext.so").write_bytes(b"half a library")  # a build killed while linking; no marker
    kwargs = {"name": "tiny_ext", "build_directory": str(folder), "log": str(log)}
    out, err = ask(folder, "tiny_ext", "stand_in_build:tiny_extension", kwargs).communicate(timeout=180)
    assert out.strip() == "42", err
    assert len(log.read_text().splitlines()) == 1


def test_a_failed_build_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(TESTS))  # the build's child finds the stand-ins there
    folder = tmp_path / "build"
    folder.mkdir()
    with pytest.raises(kernel_build.BuildError, match="No such file or directory|cannot|not found|Errno"):
        kernel_build.load_or_build(folder, "nothing", "stand_in_build:tiny_extension",
                                   {"name": "nothing", "build_directory": str(tmp_path / "missing"),
                                    "log": str(tmp_path / "log")}, "a stand-in library")
    assert not kernel_build.marker_path(folder, "nothing").exists()


def alive(pid: int) -> bool:
    """Running (a zombie waiting for a parent to reap it counts as ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "sigkill"])
def test_an_interrupted_or_killed_build_leaves_no_compiler_running(tmp_path, how):
    pid_file = tmp_path / "compiler.pid"
    folder = tmp_path / "build"
    asker = ask(folder, "never", "stand_in_build:endless_compile",
                {"build_directory": str(folder), "pid_file": str(pid_file)})
    deadline = time.monotonic() + 180  # generous: on a loaded 2-core machine a start alone can take a minute
    while not (pid_file.is_file() and pid_file.read_text().strip()):
        assert asker.poll() is None and time.monotonic() < deadline, asker.communicate()
        time.sleep(0.05)
    compiler = int(pid_file.read_text())
    try:
        assert alive(compiler)
        asker.send_signal(how)  # SIGINT to this process alone, as a server's or a script's own signal would come
        asker.communicate(timeout=180)  # the build's own grace for its compilers is 30 s; a loaded machine adds to it
        deadline = time.monotonic() + 60
        while alive(compiler) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(compiler), "the compiler outlived the build that started it"
    finally:
        if alive(compiler):
            os.kill(compiler, signal.SIGKILL)


def test_the_key_names_the_compiler_and_python_and_the_build_reads_resolved_sources(monkeypatch):
    key_of = kernels.build_key.__wrapped__  # uncached: the environment changes below
    key, flags = key_of()
    assert key_of() == (key, flags)
    monkeypatch.setenv("CXX", "clang++")
    assert key_of()[0] != key  # another compiler, another build
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(kernels.sysconfig, "get_config_var", lambda name: "cpython-399-x86_64-linux-gnu")
    assert key_of()[0] != key  # another Python ABI: the library would not load there
    monkeypatch.undo()
    monkeypatch.chdir(TESTS)
    assert key_of()[0] == key
    arguments = kernels.build_arguments(f"specdecode_cpu_kernels_{key}", Path("/tmp/folder"), flags)
    assert all(Path(source).resolve() == Path(source) for source in arguments["sources"])
