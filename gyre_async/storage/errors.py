"""Storage errors. Each says whether retrying the same call can help (``retriable``)."""

from __future__ import annotations

import errno

from gyre_async.errors import GyreError, OutOfSpace


class StorageError(GyreError):
    """Base of the segment and checkpoint store errors (only StorageFull is retriable)."""


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


class CheckpointNotFinite(CheckpointError):
    """A checkpoint whose weights hold NaN or inf: refused on load, naming the tensor."""


class UntrustedAddress(StorageError, ValueError):
    """An address named by an event that lies outside the run's storage roots, or uses
    another protocol: refused before any file-system or network call (see
    :mod:`gyre_async.storage.roots`). A ValueError too, so readers that refuse a foreign
    address already refuse this one."""


class UntrustedProducer(StorageError, ValueError):
    """An event naming a checkpoint that the role owning those checkpoints did not announce
    (another producer, or another run)."""


class StorageFull(StorageError, OutOfSpace):
    """The volume under a store is full (or a size limit was hit): nothing was made visible.

    Retriable in the sense that the same write succeeds once space is freed; the writer's
    actor exits (its supervisor restarts it with backoff) without committing its inputs.
    """

    retriable = True


_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def as_storage_full(exc: BaseException, what: str, setting: str) -> StorageFull | None:
    """A :class:`StorageFull` naming ``what`` was being written and the ``setting`` that
    moves it, when ``exc`` (or its cause) is a full-disk error; else None."""
    full: BaseException | None = exc
    while full is not None and not (isinstance(full, OSError) and full.errno in _FULL_ERRNOS):
        full = full.__cause__ or full.__context__
    if not isinstance(full, OSError):  # the chain ended (None) without a full-disk error
        return None
    where = f" ({full.filename})" if full.filename else ""
    return StorageFull(
        f"no space left writing {what}{where}: {full.strerror}. Nothing was published. Fix: "
        f"free space on that volume (or delete old runs), or point {setting} at a larger "
        "one, then restart; the writer resumes from its last committed input")
