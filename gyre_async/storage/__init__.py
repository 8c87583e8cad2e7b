"""Where large arrays live: segments in Zarr, weights in safetensors; the bus carries only
addresses and hashes. Both stores take a local path, ``file://`` or an fsspec URL."""

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
from gyre_async.storage.group_commit import GroupCommitWriter
from gyre_async.storage.segments import SegmentRef, SegmentStore

if TYPE_CHECKING:
    from gyre_async.storage.checkpoints import CheckpointRef, CheckpointStore


def __getattr__(name: str) -> Any:
    # Lazy: the checkpoint store needs torch; segment readers and writers do not.
    if name in ("CheckpointRef", "CheckpointStore"):
        from gyre_async.storage import checkpoints

        return getattr(checkpoints, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = [
    "CheckpointCorrupt",
    "CheckpointError",
    "CheckpointRef",
    "CheckpointStore",
    "GroupCommitWriter",
    "SegmentConflict",
    "SegmentCorrupt",
    "SegmentNotFound",
    "SegmentRef",
    "SegmentStore",
    "SegmentStoreError",
    "StorageError",
]
