"""Stand-ins for the native kernels' build (tests/test_kernel_build.py): each leaves what torch's build leaves, or
runs what it runs, in seconds instead of minutes. Only the standard library: they run in the build's child
process, which imports nothing else."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
import time
from pathlib import Path

# A module with one function, answer() -> 42: what the loader imports, as it imports the kernels.
C_SOURCE = """
#include <Python.h>
static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(42); }
static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "NAME", NULL, -1, methods};
PyMODINIT_FUNC PyInit_NAME(void) { return PyModule_Create(&module); }
"""


def tiny_extension(name: str, build_directory: str, log: str, arrivals: str = "", expected: int = 0) -> None:
    """Compile `name`.so into `build_directory` and add a line to `log` for this build. With `arrivals`: first
    wait until `expected` processes wrote their line there (all of them have asked for the build), and a moment
    more, so that the others are waiting on the lock while this one builds."""
    with open(log, "a") as out:
        out.write(f"{os.getpid()}\n")
    if arrivals:
        deadline = time.monotonic() + 60
        while len(Path(arrivals).read_text().splitlines()) < expected and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.0)
    folder = Path(build_directory)
    (folder / "tiny.c").write_text(C_SOURCE.replace("NAME", name))
    compiler = shutil.which("cc") or shutil.which("gcc")
    subprocess.run([compiler, "-shared", "-fPIC", f"-I{sysconfig.get_path('include')}", "tiny.c", "-o", f"{name}.so"],
                   cwd=folder, check=True)


def endless_compile(build_directory: str, pid_file: str) -> None:
    """Run ninja as torch's build runs it (subprocess.run, output captured) over one "compile" that never ends:
    it writes its pid to `pid_file` and sleeps. ninja starts it in a process group of its own, as it starts the
    compilers."""
    folder = Path(build_directory)
    # ninja writes $$ for a shell's $: the shell prints its own pid, then becomes the sleep (same pid)
    (folder / "build.ninja").write_text(f"rule compile\n  command = sh -c 'echo $$$$ > {pid_file}; exec sleep 120'\n"
                                        "build never.o: compile\n")
    subprocess.run(["ninja"], cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, check=True)
