"""Store URLs: a local path, ``file://...``, or any fsspec URL (``s3://``, ``gs://`` ...).

Both stores keep their URL in every address they hand out, normalised here, so that an
address read from the bus names one location no matter which process wrote it.
"""

from __future__ import annotations

import os
from pathlib import Path


def normalize_store_url(url: str) -> tuple[str, Path | None]:
    """Return ``(canonical_url, local_path)``; ``local_path`` is None for remote URLs.

    Local stores become ``file:///absolute/path`` (no trailing slash); remote URLs are kept
    as given, less any trailing slash.
    """
    if not url:
        raise ValueError("empty store URL")
    if url.startswith("file://"):
        path = Path(url[len("file://"):])
    elif "://" in url:
        return url.rstrip("/"), None
    else:
        path = Path(url)
    path = Path(os.path.abspath(os.path.expanduser(path)))
    return f"file://{path}", path


def fsync_paths(paths: list[Path], root: Path) -> None:
    """fsync each existing file, then every directory between it and ``root`` (inclusive),
    so that new directory entries (renamed-in files, fresh chunk folders) survive a power
    loss too, not only the bytes."""
    dirs: set[Path] = set()
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue  # e.g. an all-zero chunk that Zarr chose not to write
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        parent = path.parent
        while parent not in dirs and (parent == root or root in parent.parents):
            dirs.add(parent)
            parent = parent.parent
    for d in sorted(dirs):
        fsync_dir(d)


def fsync_dir(path: Path) -> None:
    """fsync a directory, making renames and unlinks inside it durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
