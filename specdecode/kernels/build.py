"""Build a native library once per build folder, whichever process asks first, and load it without building again.

Processes of one environment often start together on one cache (a server, a CLI call, test workers). One builds,
under a lock the system drops when its holder dies; the others say once that they wait. When a build finishes, a
marker beside the library says so, and every later start imports the library directly, without running ninja:
ninja rebuilds whenever the compile command differs from the one it last ran, and torch writes paths into that
command that differ between processes of one environment (the venv reached through a symlink, a checkout on
PYTHONPATH, ccache on one PATH and not another). Those processes used to rebuild the same folder in turn.

The build runs in a child process leading a process group of its own. An interrupt here asks it to stop: it passes
SIGTERM to ninja, which stops its compilers (each in a group of its own) and exits. On Linux the child also learns
of this process's death, even by SIGKILL (PR_SET_PDEATHSIG), and does the same. Run in this process, torch's
build SIGKILLs ninja on any exception, KeyboardInterrupt included, and that leaves the compilers running.

Run as a script, this file is that child: `python build.py MODULE:FUNCTION KWARGS_JSON PARENT_PID` calls the
function with those keyword arguments (torch.utils.cpp_extension:load for the kernels). It imports only the
standard library, so a stand-in build in the tests starts in milliseconds.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import importlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

STOP_GRACE_S = 30.0  # a stopped build's time to stop its compilers before its whole group is killed
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
OUTPUT_LINES = 12  # of a failed build's output, the last lines its error quotes


class BuildError(RuntimeError):
    """The build ran and failed; the message quotes the end of its output."""


def library_path(folder: Path, name: str) -> Path:
    return folder / f"{name}.so"


def marker_path(folder: Path, name: str) -> Path:
    """Exists once a build of `name` in `folder` finished and its library loaded."""
    return folder / f"{name}.built"


def load_or_build(folder: Path, name: str, build: str, kwargs: dict, what: str) -> ModuleType:
    """The library `folder/name.so`, imported; built first by `build` ("module:function", called with `kwargs`
    in a child process, leaving the library in `folder`) unless a build of it finished there. `what` names it in
    the one line printed while it builds or while another process builds it."""
    if (module := load_built(folder, name)) is not None:
        return module
    folder.mkdir(parents=True, exist_ok=True)
    with build_lock(folder, what):
        if (module := load_built(folder, name)) is not None:  # built by the process this one waited for
            return module
        print(f"specdecode: building {what} (once, a minute or two)...", file=sys.stderr, flush=True)
        run_build(build, kwargs)
        module = import_library(library_path(folder, name), name)
        marker_path(folder, name).touch()
        return module


def load_built(folder: Path, name: str) -> ModuleType | None:
    """The library if a build of it finished in `folder`, imported; None if none did or it does not load (then it
    is built again)."""
    if not marker_path(folder, name).is_file():
        return None
    try:
        return import_library(library_path(folder, name), name)
    except (ImportError, OSError):
        return None


def import_library(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def build_lock(folder: Path, what: str) -> Iterator[None]:
    """One build at a time in `folder`, under a lock the system drops when its holder dies. torch's own lock is a
    file that a killed build leaves behind, and every later start then waits on it forever: held this lock, no
    other build is alive, so such a file is stale and goes."""
    with open(folder / "build.lock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"specdecode: another process is building {what} in {folder}; waiting for it...",
                  file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        (folder / "lock").unlink(missing_ok=True)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def run_build(build: str, kwargs: dict) -> None:
    """Call `build` with `kwargs` in a child process of its own process group; stop it (and so its compilers) if
    anything interrupts the wait."""
    command = [sys.executable, str(Path(__file__).resolve()), build, json.dumps(kwargs), str(os.getpid())]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        output, _ = child.communicate()
    except BaseException:  # Ctrl-C, a server's shutdown, any error: the compilers must not outlive the wait
        stop(child)
        raise
    if child.returncode != 0:
        lines = output.decode(errors="replace").strip().splitlines()[-OUTPUT_LINES:]
        raise BuildError(f"the build exited with status {child.returncode}: " + " | ".join(lines))


def stop(child: subprocess.Popen) -> None:
    """Ask the build to stop (it stops ninja, ninja its compilers, then it exits); kill its group if it hangs."""
    with contextlib.suppress(ProcessLookupError):
        child.send_signal(signal.SIGTERM)
    try:
        child.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def _child(build: str, kwargs_json: str, parent: int) -> None:
    signal.signal(signal.SIGTERM, _stop_group)
    signal.signal(signal.SIGINT, _stop_group)
    _stop_with_parent(parent)
    module, _, function = build.partition(":")
    getattr(importlib.import_module(module), function)(**json.loads(kwargs_json))


def _stop_with_parent(parent: int) -> None:
    """SIGTERM to this process when its parent dies, however it dies (Linux; elsewhere nothing)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # it died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


def _stop_group(signum: int, frame: object) -> None:
    """Stop everything this build started, wait for it, and exit. ninja, on SIGTERM, sends it to each compiler's
    group and waits for them; SIGKILLed, it could not."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.killpg(0, signal.SIGTERM)
    with contextlib.suppress(ChildProcessError):
        while True:
            os.wait()
    os._exit(128 + signum)


if __name__ == "__main__":
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)  # this file's folder, put first for a script: nothing there is meant to shadow a module
    _child(sys.argv[1], sys.argv[2], int(sys.argv[3]))
