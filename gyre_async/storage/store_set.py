"""Reading segments from every store of a run: one store per segmenter.

A segment store has one writer (gyre_async.storage.segments), so when a run's segmenters
scale out (``gyre launch --replicas segmenter=N``) each writes a store of its own
(:func:`segment_store_url`). Every ``segment-closed`` address names its store
(``<store-url>#<segment-id>``), so readers (the learner, replay, the invariant checker)
need no list of stores: :class:`SegmentStores` opens each one, read-only, the first time
an address names it, once the run's roots accept the address
(:meth:`~gyre_async.storage.roots.StorageRoots.segment`): a store elsewhere, or behind
another protocol, is never opened.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import numpy as np

from gyre_async.storage.roots import StorageRoots
from gyre_async.storage.segments import SegmentStore

#: the store of the segmenter named after its role (a run with one segmenter)
SEGMENTER_ROLE = "segmenter"


def segment_store_url(base: str, actor_name: str) -> str:
    """The store segmenter ``actor_name`` writes: ``base`` for the role's only segmenter
    (``segmenter``), ``<base stem>-<name>.zarr`` beside it for a replica (``segmenter-1``).
    A restarted replica (same name) finds its own store again."""
    if actor_name == SEGMENTER_ROLE:
        return base
    stem = base[: -len(".zarr")] if base.endswith(".zarr") else base
    return f"{stem}-{actor_name}.zarr"


def store_url_of(address: str) -> str:
    """The store URL an address names (ValueError for something that is not an address)."""
    url, sep, segment_id = address.rpartition("#")
    if not sep or not url or not segment_id:
        raise ValueError(f"{address!r} is not a segment address (<store-url>#<segment-id>)")
    return url


class SegmentStores:
    """Read-only access to segments in any of the run's stores that their addresses name
    (UntrustedAddress, before any I/O, for an address outside ``roots``)."""

    def __init__(self, roots: StorageRoots) -> None:
        self.roots = roots
        self._stores: dict[str, SegmentStore] = {}

    def store(self, url: str) -> SegmentStore:
        if url not in self._stores:
            if not self.roots.segment_store(url):
                self.roots.segment(f"{url}#-")  # raises, naming the roots
            self._stores[url] = SegmentStore(url, read_only=True)
        return self._stores[url]

    def read(self, address: str, verify: bool = True) -> dict[str, np.ndarray]:
        return self.store(store_url_of(self.roots.segment(address))).read(address, verify)

    def read_many(self, addresses: Iterable[str],
                  verify: bool = True) -> list[dict[str, np.ndarray]]:
        """In the order given; one batched read per store."""
        addresses = list(addresses)
        by_store: dict[str, list[int]] = defaultdict(list)
        for i, address in enumerate(addresses):
            by_store[store_url_of(self.roots.segment(address))].append(i)
        out: list[dict[str, np.ndarray]] = [{} for _ in addresses]
        for url, indices in by_store.items():
            arrays = self.store(url).read_many([addresses[i] for i in indices], verify)
            for i, one in zip(indices, arrays):
                out[i] = one
        return out
