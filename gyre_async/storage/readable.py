"""Which segments of a batch cannot be read whole (corrupt chunk, wrong hash, deleted).

A reader that meets one bad segment in a batch must not lose the batch, nor retry it
forever: it refuses exactly the bad segments, with the store's reason, and goes on with
the rest (the learner announces each refusal as ``segment-dropped``).
"""

from __future__ import annotations

from collections.abc import Iterable

from gyre_async.storage.errors import SegmentStoreError
from gyre_async.storage.segments import SegmentStore
from gyre_async.storage.store_set import SegmentStores


def unreadable_segments(store: SegmentStore | SegmentStores, addresses: Iterable[str]) -> dict[str, str]:
    """``{address: reason}`` for every segment that fails to read with its content hash."""
    bad: dict[str, str] = {}
    for address in dict.fromkeys(addresses):
        try:
            store.read(address)
        except (SegmentStoreError, ValueError) as exc:  # ValueError: another store's address
            bad[address] = str(exc)
    return bad
