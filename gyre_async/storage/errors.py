"""Storage errors. Each says whether retrying the same call can help (``retriable``)."""

from __future__ import annotations

from ..errors import GyreError


class StorageError(GyreError):
    """Base of the segment and checkpoint store errors (none of them retriable)."""


class SegmentStoreError(StorageError):
    """Misuse or an inconsistent segment store (read-only writes, a second writer)."""


class SegmentNotFound(SegmentStoreError, KeyError):
    """No live segment with this id (never written here, or deleted by retention)."""

    def __str__(self) -> str:  # KeyError would print the message with quotes
        return str(self.args[0]) if self.args else ""


class SegmentConflict(SegmentStoreError, ValueError):
    """A segment id was written again with different content."""


class SegmentCorrupt(SegmentStoreError):
    """Stored bytes are unreadable or do not match the segment's content hash."""


class CheckpointError(StorageError):
    """A checkpoint that cannot be saved or found as asked."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint file whose sha256 is not the one expected, or that cannot be parsed."""
