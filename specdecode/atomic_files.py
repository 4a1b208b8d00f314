"""Files and folders put in place whole: a kill (SIGKILL, a power cut) at any point leaves the old version or the
new one under the name, never half of one, and never neither.

A file is written beside its name, fsynced, then renamed over it (`os.replace`: one atomic step). A folder cannot
be renamed over a folder that holds files, so replacing one takes two renames, `NAME -> .NAME.PID.old` and
`.NAME.PID.tmp -> NAME`, and a kill between them leaves nothing under NAME. `recover_folder`, run before a folder
is looked for and before it is written again, finishes such a replacement: the staged folder was whole before the
first rename (an `.old` exists only then), so it goes in place; then what dead writers left is removed.
"""

from __future__ import annotations

import glob
import os
import shutil
from pathlib import Path

STAGED, OLD = ".tmp", ".old"  # how the new version and the one it replaces end while a replacement runs


def fsync_folder(folder: Path) -> None:
    """Flush a folder's entries (a rename into it) to disk, where the system allows it (not on Windows)."""
    try:
        handle = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(handle)
    except OSError:
        pass
    finally:
        os.close(handle)


def staging_folder(out: Path) -> Path:
    """Where this process writes the next version of the folder `out`, emptied."""
    staging = out.with_name(f".{out.name}.{os.getpid()}{STAGED}")
    shutil.rmtree(staging, ignore_errors=True)
    return staging


def replace_folder(staging: Path, out: Path) -> None:
    """Put the whole folder `staging` (from staging_folder) where `out` is, or is not yet."""
    for path in staging.rglob("*"):
        if path.is_file():
            with open(path, "rb+") as f:
                os.fsync(f.fileno())  # the files on disk before any rename: a power cut keeps a whole version
    if out.exists():
        old = out.with_name(f".{out.name}.{os.getpid()}{OLD}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(staging, out)  # killed before this: recover_folder puts `staging` in place
        fsync_folder(out.parent)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(staging, out)
        fsync_folder(out.parent)


def recover_folder(out: str | Path) -> None:
    """Finish a replacement of `out` that a killed process left halfway, and remove what dead writers left beside
    it (a writer still running is left alone: it finishes on its own)."""
    out = Path(out)
    try:
        left = [p for p in out.parent.glob(f".{glob.escape(out.name)}.*") if _writer_gone(p, out)]
    except OSError:  # no parent folder, or one we may not read: nothing of ours there
        return
    try:
        for old in (p for p in left if p.name.endswith(OLD)):
            staged = old.with_name(old.name[: -len(OLD)] + STAGED)
            if not out.exists():
                os.replace(staged if staged.is_dir() else old, out)
                fsync_folder(out.parent)
            shutil.rmtree(old, ignore_errors=True)
    except OSError:  # a folder this user may not change: left as it is, for one who may
        return
    for staged in (p for p in left if p.name.endswith(STAGED)):
        shutil.rmtree(staged, ignore_errors=True)


def _writer_gone(path: Path, out: Path) -> bool:
    """Whether `path` is a `.NAME.PID.tmp` / `.old` of `out` whose process has ended (this one counts as ended:
    it is not replacing `out` while it recovers it)."""
    middle, _, end = path.name[len(out.name) + 2 :].rpartition(".")
    if f".{end}" not in (STAGED, OLD) or not middle.isdigit():
        return False
    pid = int(middle)
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's
        return False
    return False
