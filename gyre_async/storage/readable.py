"""Which segments of a batch cannot be read whole (corrupt chunk, wrong hash, deleted).

A reader that meets one bad segment in a batch must not lose the batch, nor retry it
forever: it refuses exactly the bad segments, with the store's reason, and goes on with
the rest (the learner announces each refusal as ``segment-dropped``).
"""

from __future__ import annotations

from collections.abc import Iterable

from gyre_async.errors import is_retriable
from gyre_async.storage.segments import SegmentStore
from gyre_async.storage.store_set import SegmentStores


def unreadable_segments(store: SegmentStore | SegmentStores, addresses: Iterable[str]) -> dict[str, str]:
    """``{address: reason}`` for every segment that fails to read with its content hash.

    Any error that trying again cannot fix counts (a store error, another store's address,
    a protocol or file the reader cannot open): a segment that fails in an unforeseen way is
    refused like a corrupt one, never kept to fail every later batch. Retriable errors (a
    busy store) are raised for the caller to retry."""
    bad: dict[str, str] = {}
    for address in dict.fromkeys(addresses):
        try:
            store.read(address)
        except Exception as exc:  # noqa: BLE001 - routed by `retriable`
            if is_retriable(exc):
                raise
            bad[address] = str(exc) or repr(exc)
    return bad
