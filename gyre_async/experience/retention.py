"""Retention of ordinary segments: a long run must not fill the disk.

The segment store only grows unless someone deletes; deleting must be done by its single
writer (the segmenter), and must never remove a segment someone still needs. The rule:

- A segment is **consumed** when the learner is done with it: it was dropped
  (``segment-dropped``: too stale, or the run's budget was spent), or it was trained on in
  a ``policy-version`` *older than the newest one published*. The one-version grace covers
  a learner that crashes after publishing a version but before committing that batch's
  input offsets: it is handed the batch again and must still find it.
- Everything else is still needed: segments not yet scored, scored but buffered in the
  learner, in the batch being trained. Elite segments are copied into the elite pool's own
  store when they are chosen (gyre_async.experience.elite), so their originals are
  ordinary segments here.
- Before each write, if the store's disk use (:func:`disk_use`: every file and directory,
  as ``du -sb`` counts them) plus the incoming batch (its raw, uncompressed size: an
  over-estimate) would exceed ``segmenter.retain_bytes``, **every consumed
  segment still in the store is deleted** (one index page; the store then removes the
  chunks no live segment uses) and the index pages are folded into one snapshot. If the
  segments still needed alone exceed the bound, nothing needed is touched: the shortfall is
  counted (``retention_over_bound``) and logged, and the bound should be raised (it must
  hold about ``(max_staleness + 2) * batch_steps`` steps of segments).
- Space comes back a whole chunk at a time: the store frees a chunk once no live segment
  has a row in it (segments.py). With the default 256 KiB chunks (1024 rows of a 64-token
  context) a bound of a few MB and up behaves as described; a bound near the chunk size
  deletes index entries but may free little space.

The consumed set is derived state: it is rebuilt from the bus (``policy-version`` and
``telemetry`` from offset 0) by every incarnation of the segmenter, so it needs no storage
of its own. Deleted segments are gone for good: ``gyre replay learner`` and ``gyre inspect``
can only audit what retention kept (leave ``retain_bytes = 0`` for a fully auditable run).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import structlog

from gyre_async.bus.reading import ReadCounts, end_offsets, read_events
from gyre_async.storage.urls import normalize_store_url
from schemas.events import PolicyVersion, SegmentDropped
from schemas.topics import POLICY_VERSION, TELEMETRY

log = structlog.get_logger(__name__)

#: the topics whose events say what the learner is done with
CONSUMPTION_TOPICS = (POLICY_VERSION, TELEMETRY)
#: ``Retention.follow`` stops waiting after this long without a new record (the follower
#: polls every 0.2 s, so this is more than one empty poll)
CAUGHT_UP_IDLE_S = 0.3


class ConsumedSegments:
    """Which segments the learner is done with, in the order it finished them (pure)."""

    def __init__(self) -> None:
        self._dropped: dict[str, None] = {}
        self._trained: dict[int, list[str]] = {}  # version -> its batch's segment ids
        self.newest_version = -1

    def fold(self, event: object) -> None:
        match event:
            case SegmentDropped():
                self._dropped[event.segment_id] = None
            case PolicyVersion():
                self._trained[event.version] = list(event.trained_segments)
                self.newest_version = max(self.newest_version, event.version)

    def deletable(self) -> list[str]:
        """Consumed ids, oldest first (dropped ones, then batches by version)."""
        ids = dict(self._dropped)
        for version in sorted(v for v in self._trained if v < self.newest_version):
            ids.update(dict.fromkeys(self._trained[version]))
        return list(ids)

    def forget(self, segment_ids: Iterable[str]) -> None:
        """Drop ids already deleted from the store (keeps this state bounded)."""
        gone = set(segment_ids)
        for sid in gone:
            self._dropped.pop(sid, None)
        for version in [v for v in self._trained if v < self.newest_version]:
            left = [s for s in self._trained[version] if s not in gone]
            if left:
                self._trained[version] = left
            else:
                del self._trained[version]


@dataclass
class RetentionStats:
    passes: int = 0
    deleted: int = 0
    over_bound: int = 0


def disk_use(store) -> int:
    """What the store occupies: for a local store, like ``du -sb`` (every file and directory,
    so directory entries count too); for a remote one, the bytes of its objects."""
    _, root = normalize_store_url(store.url)
    if root is None:
        return store.disk_bytes()
    total = 0
    for parent, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            try:
                total += os.lstat(os.path.join(parent, name)).st_size
            except FileNotFoundError:  # removed meanwhile (a chunk being replaced)
                pass
        total += 0 if parent != str(root) else os.lstat(root).st_size
    return total


#: Room for the directories one write may create per array (a new row-chunk folder or two).
DIRECTORY_ALLOWANCE = 2 * 4096


def incoming_bytes(items: Iterable[tuple[str, Mapping[str, np.ndarray]]]) -> int:
    """An upper bound on what writing ``items`` adds: raw bytes plus new directories."""
    items = list(items)
    names = {name for _, arrays in items for name in arrays}
    return (sum(int(np.asarray(a).nbytes) for _, arrays in items for a in arrays.values())
            + DIRECTORY_ALLOWANCE * len(names))


def prune_empty_dirs(store) -> int:
    """Remove the empty folders deleted chunks leave behind (local stores); returns how many.

    Zarr keeps each row-chunk of a 2-d array in its own folder (``c/<row>/<col>``); deleting
    the chunk leaves the folder, 4 KiB of disk each, which would add up over a long run.
    Only the writer calls this, between its own writes, and Zarr recreates folders it needs.
    """
    _, root = normalize_store_url(store.url)
    arrays = None if root is None else root / "arrays"
    if arrays is None or not arrays.is_dir():
        return 0
    removed = 0
    for parent, _dirs, _files in os.walk(arrays, topdown=False):  # children first
        if parent != str(arrays) and not os.listdir(parent):
            try:
                os.rmdir(parent)
                removed += 1
            except OSError:  # not empty after all (a file appeared): keep it
                pass
    return removed


class Retention:
    """Keeps one writable :class:`~gyre_async.storage.segments.SegmentStore` under a bound.

    ``follow`` (async, from the segmenter's loop) reads consumption events off the bus;
    ``make_room`` (sync, on the writer's thread, right before a write) deletes.
    """

    def __init__(self, store, bound_bytes: int) -> None:
        if bound_bytes < 0:
            raise ValueError("segmenter.retain_bytes must be >= 0 (0: keep everything)")
        self.store = store
        self.bound = bound_bytes
        self.consumed = ConsumedSegments()
        self.stats = RetentionStats()
        self.read = ReadCounts()  # how far the consumption topics were folded
        self._folding: asyncio.Task | None = None

    @property
    def enabled(self) -> bool:
        return self.bound > 0

    async def follow(self, bus) -> None:
        """Fold every consumption event published so far (waits for those, not new ones).

        A follower task folds the consumption topics as they grow (undecodable records
        skipped and counted: the dead-letter path is the consumers' job, not ours); this
        waits until it reached the end offsets seen now, or until it has found nothing new
        for :data:`CAUGHT_UP_IDLE_S` (a partition whose records expired never reaches its
        end offset).
        """
        if not self.enabled:
            return
        if self._folding is None:
            self._folding = asyncio.create_task(self._fold(bus), name="retention-fold")
        targets = await end_offsets(bus, CONSUMPTION_TOPICS)
        progress, idle_since = -1, time.monotonic()
        while any(self.read.next_offsets.get(tp, 0) < end for tp, end in targets.items()):
            if self._folding.done():
                self._folding.result()  # the reader failed: the segmenter crashes loudly
                return
            seen = self.read.decoded + self.read.skipped
            if seen != progress:
                progress, idle_since = seen, time.monotonic()
            elif time.monotonic() - idle_since > CAUGHT_UP_IDLE_S:
                return
            await asyncio.sleep(0.005)

    async def _fold(self, bus) -> None:
        async for _record, event in read_events(bus, CONSUMPTION_TOPICS, on_bad="skip",
                                                follow=True, counts=self.read):
            self.consumed.fold(event)

    async def close(self) -> None:
        if self._folding is not None:
            self._folding.cancel()
            await asyncio.gather(self._folding, return_exceptions=True)
            self._folding = None

    def make_room(self, incoming: int) -> None:
        """Delete consumed segments if writing ``incoming`` bytes would break the bound."""
        if not self.enabled or disk_use(self.store) + incoming <= self.bound:
            return
        self.stats.passes += 1
        live = set(self.store.list_segments())
        doomed = [s for s in self.consumed.deletable() if s in live]
        if doomed:
            self.stats.deleted += self.store.delete(doomed)
            self.store.compact_index()
            prune_empty_dirs(self.store)
        self.consumed.forget(self.consumed.deletable())  # deleted now, or gone before
        used = disk_use(self.store)
        if used + incoming > self.bound:
            self.stats.over_bound += 1
            log.warning("retention cannot keep the segment store under its bound: the "
                        "segments still needed fill it; raise segmenter.retain_bytes",
                        used=used, incoming=incoming, bound=self.bound, still_live=len(live)
                        - len(doomed))
