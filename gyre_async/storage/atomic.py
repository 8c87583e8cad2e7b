"""Atomic file writes: a reader sees the old file or the whole new one, never a part.

Every file Gyre writes for another process (or a later run) to read goes through here:
checkpoints, the process reward model, the launcher's status file, reports, caches. The
recipe is the POSIX one, in one place so that no writer forgets a step:

1. write a temporary file in the target's own folder (a rename is only atomic within one
   filesystem), named ``.<name>.<random>.tmp`` so that a crash leaves an obvious orphan
   and never a half-written file under the real name;
2. flush and fsync it: the bytes are on disk before the name points at them (without this
   a power loss after the rename can leave an empty or truncated file under the new name);
3. ``os.replace`` it over the target (atomic, also on Windows);
4. fsync the folder, so that the rename itself survives a power loss.

If the write raises, the temporary file is removed and the target is left as it was.

:func:`atomic_directory` does the same for a whole folder (a converted model): every file
in a staging folder is fsynced, then the folder is renamed into place. A non-empty folder
cannot be replaced in one rename, so an old one is first renamed aside (readers may see no
folder for that instant, never a mixed one) and removed afterwards.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

from gyre_async.storage.urls import fsync_dir

__all__ = ["atomic_directory", "atomic_write_bytes", "atomic_write_text", "atomic_writer"]

PathLike = str | os.PathLike[str]


def _temporary_name(target: Path) -> Path:
    return target.parent / f".{target.name}.{uuid.uuid4().hex}.tmp"


@contextmanager
def atomic_writer(path: PathLike, mode: str = "wb", *, encoding: str | None = None,
                  permissions: int = 0o666) -> Iterator[IO[Any]]:
    """Yield a file to stream into; it replaces ``path`` only if the block ends normally.

    ``mode`` is ``"wb"`` or ``"w"`` (text; ``encoding`` defaults to UTF-8). Missing parent
    folders are created. ``permissions`` (less the umask) are set when the temporary file
    is created, so a private file (``0o600``) is never readable by others, not even for
    an instant.
    """
    if mode not in ("wb", "w"):
        raise ValueError(f"atomic_writer mode must be 'wb' or 'w', got {mode!r}")
    target = Path(os.path.abspath(os.fspath(path)))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temporary_name(target)
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, permissions)
        with open(fd, mode, encoding=None if mode == "wb" else encoding or "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)


def atomic_write_bytes(path: PathLike, data: bytes, *, permissions: int = 0o666) -> None:
    """Replace ``path`` with ``data`` atomically and durably (see the module docstring)."""
    with atomic_writer(path, "wb", permissions=permissions) as f:
        f.write(data)


def atomic_write_text(path: PathLike, text: str, encoding: str = "utf-8") -> None:
    """Replace ``path`` with ``text`` atomically and durably (see the module docstring)."""
    with atomic_writer(path, "w", encoding=encoding) as f:
        f.write(text)


def _fsync_tree(root: Path) -> None:
    """fsync every file under ``root``, then every folder, deepest first."""
    folders: list[Path] = []
    for walked, _dirs, files in os.walk(root):
        folders.append(Path(walked))
        for name in files:
            fd = os.open(Path(walked) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for folder in reversed(folders):
        fsync_dir(folder)


@contextmanager
def atomic_directory(path: PathLike) -> Iterator[Path]:
    """Yield an empty staging folder beside ``path``; it becomes ``path`` (replacing any old
    folder there) only if the block ends normally, after every file in it is fsynced.

    Callers that may race (several roles converting one model) hold a lock around this.
    """
    target = Path(os.path.abspath(os.fspath(path)))
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = _temporary_name(target)
    staging.mkdir()
    try:
        yield staging
        _fsync_tree(staging)
        old = None
        if target.exists():
            old = _temporary_name(target)
            os.replace(target, old)
        try:
            os.replace(staging, target)
        except BaseException:
            if old is not None:  # put the old folder back rather than leave none
                os.replace(old, target)
            raise
        fsync_dir(target.parent)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
