"""Where large arrays live: segments in Zarr, weights in safetensors; the bus carries only
addresses and hashes. Both stores take a local path, ``file://`` or an fsspec URL.
:mod:`gyre_async.storage.atomic` holds the one atomic-write recipe every file writer uses."""

from typing import TYPE_CHECKING, Any

from gyre_async.storage.errors import (
    CheckpointCorrupt,
    CheckpointError,
    SegmentConflict,
    SegmentCorrupt,
    SegmentNotFound,
    SegmentStoreError,
    StorageError,
)

if TYPE_CHECKING:
    from gyre_async.storage.checkpoints import CheckpointRef, CheckpointStore
    from gyre_async.storage.segments import SegmentRef, SegmentStore

_LAZY = {"CheckpointRef": "checkpoints", "CheckpointStore": "checkpoints",
         "SegmentRef": "segments", "SegmentStore": "segments"}


def __getattr__(name: str) -> Any:
    # Lazy: the checkpoint store needs torch and the segment store zarr; the atomic writes
    # (used by the launcher and the report) need neither.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"gyre_async.storage.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointRef",
    "CheckpointStore",
    "SegmentConflict",
    "SegmentCorrupt",
    "SegmentNotFound",
    "SegmentRef",
    "SegmentStore",
    "SegmentStoreError",
    "StorageError",
]
