"""Atomic writes: a failed write leaves the target as it was; a finished one is fsynced."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gyre_async.storage import atomic
from gyre_async.storage.atomic import (
    atomic_directory,
    atomic_write_bytes,
    atomic_write_text,
    atomic_writer,
)


@pytest.fixture
def fsyncs(monkeypatch):
    """The paths passed to os.fsync, in order (the real fsync still runs)."""
    seen: list[str] = []
    real = os.fsync

    def counting(fd: int) -> None:
        seen.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", counting)
    return seen


def test_write_replaces_and_fsyncs_file_then_folder(tmp_path, fsyncs):
    target = tmp_path / "sub" / "status.json"  # the folder is created
    atomic_write_text(target, "old")
    fsyncs.clear()
    atomic_write_bytes(target, b"new")
    assert target.read_bytes() == b"new"
    assert os.listdir(target.parent) == ["status.json"]  # no temporary left behind
    # The temporary file's bytes first (it has been renamed since), then the folder.
    assert len(fsyncs) == 2 and fsyncs[1] == str(target.parent)
    assert fsyncs[0].startswith(str(target.parent / ".status.json."))


def test_a_write_that_raises_midway_leaves_the_target_unchanged(tmp_path, fsyncs):
    target = tmp_path / "report.html"
    atomic_write_text(target, "complete old report")
    fsyncs.clear()
    with pytest.raises(RuntimeError, match="renderer crashed"), atomic_writer(target, "w") as f:
        f.write("half of a new rep")
        f.flush()
        raise RuntimeError("renderer crashed")
    assert target.read_text() == "complete old report"
    assert os.listdir(tmp_path) == ["report.html"]
    assert fsyncs == []


def test_a_failed_fsync_never_publishes(tmp_path, monkeypatch):
    target = tmp_path / "w.bin"

    def broken(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", broken)
    with pytest.raises(OSError):
        atomic_write_bytes(target, b"never seen")
    assert os.listdir(tmp_path) == []


def test_text_mode_encodes_utf8_and_rejects_other_modes(tmp_path):
    atomic_write_text(tmp_path / "t.txt", "café")
    assert (tmp_path / "t.txt").read_bytes() == "café".encode()
    with pytest.raises(ValueError, match="mode"), atomic_writer(tmp_path / "a.txt", "a"):
        pass


def test_directory_is_published_whole_or_not_at_all(tmp_path, fsyncs):
    target = tmp_path / "models" / "m"
    with atomic_directory(target) as staging:
        (staging / "weights").write_bytes(b"1")
        (staging / "deep").mkdir()
        (staging / "deep" / "config.json").write_text("{}")
    assert sorted(p.name for p in target.rglob("*")) == ["config.json", "deep", "weights"]
    # Both files were fsynced before the rename (under their staging names).
    staged_files = [p for p in fsyncs if p.endswith(("/weights", "/config.json"))]
    assert len(staged_files) == 2 and all("/.m." in p for p in staged_files)

    with pytest.raises(RuntimeError), atomic_directory(target) as staging:
        (staging / "weights").write_bytes(b"2, half")
        raise RuntimeError("conversion failed")
    assert (target / "weights").read_bytes() == b"1"
    assert os.listdir(target.parent) == ["m"]

    with atomic_directory(target) as staging:  # a finished write replaces the old folder
        (staging / "weights").write_bytes(b"3")
    assert os.listdir(target) == ["weights"] and (target / "weights").read_bytes() == b"3"
    assert os.listdir(target.parent) == ["m"]


def test_a_failed_directory_rename_restores_the_old_folder(tmp_path, monkeypatch):
    target = tmp_path / "m"
    with atomic_directory(target) as staging:
        (staging / "weights").write_bytes(b"old")
    real = os.replace

    def failing(src, dst):
        staged = Path(src) / "weights"
        if staged.is_file() and staged.read_bytes() == b"new":  # publishing the new folder
            raise OSError(28, "No space left on device")
        real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", failing)
    with pytest.raises(OSError), atomic_directory(target) as staging:
        (staging / "weights").write_bytes(b"new")
    assert os.listdir(tmp_path) == ["m"] and (target / "weights").read_bytes() == b"old"
