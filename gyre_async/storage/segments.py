"""Segment store: training segments' arrays in Zarr; the bus carries only address + hash.

Layout under the store URL (a Zarr v3 hierarchy plus an index of immutable pages)::

    zarr.json                         root group, attributes {"gyre_segment_store": 1}
    arrays/<name>/<dtype>[_<dims>]/   one append-only Zarr array per (array name, dtype,
                                      trailing-shape bucket), e.g. arrays/context_tokens/int32_64
                                      shape [2**40, *dims], chunked along rows, never resized
    index/<seq:012d>.json             index pages (see segment_index.py)
    index/snapshot-<seq:012d>.json    folded index after compact_index()

Why this shape: one Zarr group per segment would mean several tiny files per segment,
millions in a long run, which hurts every filesystem and object store. Here a segment is a
run of rows in a few large arrays, and files are ~``chunk_bytes`` each. The nominal
2**40-row length means appends never rewrite array metadata (Zarr stores only the chunks
that are written); rows are allocated by the index's per-array cursor. Trailing dimensions
are padded up to a power of two (the true shape is in the index) so that segments whose
context width varies a little share one array instead of creating one each.

Write protocol (one writer process; any number of readers, in any process): data rows
first (fsynced when ``durable``), then one index page, created exclusively. Only then is
the address returned for the caller to publish. A crash in between leaves rows past the
cursor that no page references; the next writer reuses them. Chunks are replaced whole
and atomically (write temp file, rename), so a reader of a live segment sees either the
old or the new version of a shared chunk, with identical bytes for its own rows. Sharding
is not used: a shard is rewritten in place while readers fetch its index and inner chunks
in separate requests, which can interleave with a rewrite.

Deletion (retention) writes a page marking segments deleted, then removes chunks that no
live segment uses any more (for first-in-first-out retention, that is nearly all of their
space). Rows of deleted segments inside chunks still shared with live ones stay until a
compaction that rewrites live rows, which is left for later.

The API is synchronous (Zarr's own loop runs the I/O); asyncio actors call it through
``asyncio.to_thread``. One instance may be shared by threads.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable, Mapping
from typing import Any, NoReturn

import msgspec
import numpy as np
import zarr.api.asynchronous as zasync
from zarr.codecs import Crc32cCodec, ZstdCodec
from zarr.core.sync import sync
from zarr.errors import ArrayNotFoundError, NodeNotFoundError
from zarr.storage import FsspecStore, LocalStore

from gyre_async.faultpoints import pause_point
from gyre_async.storage.errors import (
    SegmentConflict,
    SegmentCorrupt,
    SegmentNotFound,
    SegmentStoreError,
    as_storage_full,
)
from gyre_async.storage.index_log import IndexLog, delete_keys
from gyre_async.storage.segment_index import (
    IndexPage,
    IndexState,
    Placement,
    SegmentEntry,
    canonical_arrays,
    check_segment_id,
    content_hash,
)
from gyre_async.storage.segment_rows import array_path, as_rows, coalesce, dead_chunks, from_rows
from gyre_async.storage.urls import fsync_paths, normalize_store_url

__all__ = [
    "SegmentConflict",
    "SegmentCorrupt",
    "SegmentNotFound",
    "SegmentRef",
    "SegmentStore",
    "SegmentStoreError",
]

STORE_FORMAT = 1
NOMINAL_ROWS = 1 << 40


class SegmentRef(msgspec.Struct, frozen=True):
    """What a ``segment-closed`` event carries: ``<store-url>#<segment-id>`` and sha256."""

    address: str
    content_hash: str


class SegmentStore:
    """Append-only store of segments (dicts of named numpy arrays) at a store URL.

    ``url``: local path, ``file://...`` or an fsspec URL (only local is tested).
    ``chunk_bytes``: target chunk size of new arrays: bigger means fewer files but more
    bytes rewritten per small append. ``durable``: fsync data and index (local stores)
    before an address is returned. Readers may open with ``read_only=True``.
    """

    def __init__(
        self,
        url: str,
        *,
        read_only: bool = False,
        chunk_bytes: int = 256 * 1024,
        durable: bool = True,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        self.url, self._root = normalize_store_url(url)
        self.read_only = read_only
        self.chunk_bytes = chunk_bytes
        self.durable = durable
        if self._root is not None:
            if not read_only:
                self._root.mkdir(parents=True, exist_ok=True)
            self._store: Any = LocalStore(self._root, read_only=read_only)
        else:
            self._store = FsspecStore.from_url(
                self.url, storage_options=storage_options, read_only=read_only
            )
        self._arrays: dict[str, Any] = {}
        self._log = IndexLog(self._store, self.url, self._root, durable)
        self._lock = threading.RLock()  # guards the index and the write path
        if not read_only:
            sync(zasync.open_group(store=self._store, mode="a",
                                   attributes={"gyre_segment_store": STORE_FORMAT}))
        with self._lock:
            sync(self._log.reload())

    # ---- public API ------------------------------------------------------------------

    def address(self, segment_id: str) -> str:
        check_segment_id(segment_id)
        return f"{self.url}#{segment_id}"

    def segment_id(self, address: str) -> str:
        """The segment id in an address of this store (ValueError for another store's)."""
        url, sep, segment_id = address.rpartition("#")
        if not sep or url != self.url:
            raise ValueError(f"address {address!r} does not belong to store {self.url!r}")
        check_segment_id(segment_id)
        return segment_id

    def write(self, segment_id: str, arrays: Mapping[str, np.ndarray]) -> SegmentRef:
        """Store one segment; see :meth:`write_many`."""
        return self.write_many([(segment_id, arrays)])[0]

    def write_many(
        self, segments: Iterable[tuple[str, Mapping[str, np.ndarray]]]
    ) -> list[SegmentRef]:
        """Store segments with one data write per array and one index page; return their
        refs, in order, once durable. Idempotent: an id already stored with the same content
        returns the same ref and stores nothing again; different content raises
        SegmentConflict before anything of the batch is written."""
        self._check_writable()
        with self._lock:
            sync(self._log.refresh())
            refs, entries, columns, cursors = self._plan(list(segments))
            if not entries:
                return refs
            try:
                touched = sync(self._write_columns(columns))
                if self.durable and self._root is not None:
                    fsync_paths([self._root / key for key in touched], self._root)
                pause_point("segment-write")  # rows written, index page not yet (chaos.py)
                self._log.append(IndexPage(self._index.seq + 1, tuple(entries), (),
                                           {path: cursors[path] for path in columns}))
            except OSError as exc:  # a full disk: no index page, so nothing is visible
                full = as_storage_full(exc, f"segments to {self.url}", "segmenter.store")
                if full is None:
                    raise
                raise full from exc
            return refs

    def read(self, address: str, verify: bool = True) -> dict[str, np.ndarray]:
        """The arrays of the segment at ``address``. With ``verify`` the content hash is
        recomputed: SegmentCorrupt (naming the segment) on mismatch or unreadable chunk."""
        return self.read_many([address], verify)[0]

    def read_many(
        self, addresses: Iterable[str], verify: bool = True
    ) -> list[dict[str, np.ndarray]]:
        """Several segments at once: nearby rows of one array are fetched in one read
        (segments written in one batch are adjacent)."""
        entries = [self._lookup(self.segment_id(a)) for a in addresses]
        try:
            results = sync(self._fetch(entries))
        except Exception:  # a bad chunk somewhere: read one by one to name the segment
            return [self._fetch_one(e, verify) for e in entries]
        if verify:
            for entry, arrays in zip(entries, results):
                self._verify(entry, arrays)
        return results

    def contains(self, segment_id: str) -> bool:
        try:
            self._lookup(segment_id)
        except SegmentNotFound:
            return False
        return True

    def ref(self, segment_id: str) -> SegmentRef:
        """The ref of a stored segment (e.g. for re-publishing after a restart)."""
        return SegmentRef(self.address(segment_id), self._lookup(segment_id).content_hash)

    def list_segments(self) -> list[str]:
        with self._lock:
            sync(self._log.refresh())
            return sorted(self._index.live)

    def delete(self, segment_ids: Iterable[str]) -> int:
        """Retention hook: mark segments deleted (one index page), then remove the chunks
        no live segment uses. Returns how many were live; unknown ids are ignored."""
        self._check_writable()
        with self._lock:
            sync(self._log.refresh())
            gone = [s for s in dict.fromkeys(segment_ids) if s in self._index.live]
            if not gone:
                return 0
            dead = [p for s in gone for p in self._index.live[s].placements]
            self._log.append(IndexPage(self._index.seq + 1, (), tuple(gone), {}))
            sync(self._reclaim(dead))
            return len(gone)

    def compact_index(self) -> int:
        """Fold all index pages into one snapshot, then remove them; returns how many
        index objects were removed. A reader that misses a page meanwhile reloads."""
        self._check_writable()
        with self._lock:
            sync(self._log.refresh())
            return self._log.compact()

    def disk_bytes(self) -> int:
        """Bytes stored under the URL: data chunks, Zarr metadata and index."""
        return int(sync(self._store.getsize_prefix("")))

    @property
    def _index(self) -> IndexState:  # the replayed index: live entries, cursors, last page
        return self._log.state

    # ---- internals -------------------------------------------------------------------

    def _check_writable(self) -> None:
        if self.read_only:
            raise SegmentStoreError(f"segment store {self.url} was opened read-only")

    def _lookup(self, segment_id: str) -> SegmentEntry:
        entry = self._index.live.get(segment_id)
        if entry is None:
            with self._lock:
                sync(self._log.refresh())
                if (entry := self._index.live.get(segment_id)) is None:
                    sync(self._log.reload())  # its page may have been folded into a snapshot
                    entry = self._index.live.get(segment_id)
        if entry is None:
            raise SegmentNotFound(
                f"no segment {segment_id!r} in {self.url} (never written, or deleted)")
        return entry

    def _plan(self, items: list[tuple[str, Mapping[str, np.ndarray]]]) -> tuple[
        list[SegmentRef], list[SegmentEntry], dict[str, tuple[int, list[np.ndarray]]], dict[str, int]
    ]:
        """Check ids and hashes and allocate rows (no I/O). Returns the refs, the new
        entries, the rows to append per array ``{path: (first_row, blocks)}`` and the
        cursors after them."""
        refs, entries = [], []
        known = {sid: e.content_hash for sid, _ in items if (e := self._index.live.get(sid))}
        cursors = dict(self._index.cursors)
        columns: dict[str, tuple[int, list[np.ndarray]]] = {}
        for segment_id, arrays in items:
            check_segment_id(segment_id)
            canon = canonical_arrays(arrays)
            digest = content_hash(canon)
            refs.append(SegmentRef(self.address(segment_id), digest))
            if segment_id in known:
                if known[segment_id] != digest:
                    raise SegmentConflict(
                        f"segment {segment_id!r} is already in {self.url} with content hash "
                        f"{known[segment_id]}; refusing different content {digest}")
                continue
            known[segment_id] = digest
            placements = []
            for name, a in canon.items():
                rows = as_rows(a)
                path = array_path(name, rows)
                start = cursors.get(path, 0)
                cursors[path] = start + rows.shape[0]
                columns.setdefault(path, (start, []))[1].append(rows)
                placements.append(Placement(name, path, start, a.shape, a.dtype.str))
            entries.append(SegmentEntry(segment_id, digest, tuple(placements)))
        return refs, entries, columns, cursors

    async def _array(self, path: str, like: np.ndarray | None = None) -> Any:
        """Open (cached) the Zarr array at ``path``; create it shaped after ``like``."""
        if (arr := self._arrays.get(path)) is not None:
            return arr
        mode = "r" if self.read_only else "r+"
        try:
            arr = await zasync.open_array(store=self._store, path=path, mode=mode)
        except (ArrayNotFoundError, NodeNotFoundError, FileNotFoundError):
            if like is None:
                raise
            row_bytes = max(1, like[:1].nbytes)
            arr = await zasync.create_array(
                self._store, name=path, shape=(NOMINAL_ROWS, *like.shape[1:]),
                chunks=(max(1, self.chunk_bytes // row_bytes), *like.shape[1:]),
                dtype=like.dtype, fill_value=np.zeros((), like.dtype)[()],
                compressors=(ZstdCodec(level=1), Crc32cCodec()),
            )
        self._arrays[path] = arr
        return arr

    async def _write_columns(self, columns: dict[str, tuple[int, list[np.ndarray]]]) -> list[str]:
        """Append each array's new rows in one write; return the chunk keys touched."""

        async def one(path: str, start: int, blocks: list[np.ndarray]) -> list[str]:
            data = blocks[0] if len(blocks) == 1 else np.concatenate(blocks)
            # Array metadata this process has not seen yet may have just been created.
            keys = [] if path in self._arrays else [f"{path}/zarr.json"]
            arr = await self._array(path, like=data)
            if len(data) == 0:
                return keys
            await arr.setitem(slice(start, start + len(data)), data)
            r, tail = arr.chunks[0], (0,) * (data.ndim - 1)
            return keys + [f"{path}/{arr.metadata.encode_chunk_key((c, *tail))}"
                           for c in range(start // r, (start + len(data) - 1) // r + 1)]

        keys = await asyncio.gather(*(one(p, s, b) for p, (s, b) in columns.items()))
        return [k for ks in keys for k in ks]

    async def _fetch(self, entries: list[SegmentEntry]) -> list[dict[str, np.ndarray]]:
        """Read all placements; nearby row ranges of one array come in one read."""
        by_array: dict[str, list[tuple[int, int, object]]] = {}
        for i, entry in enumerate(entries):
            for p in entry.placements:
                if p.rows:
                    by_array.setdefault(p.array, []).append((p.start, p.start + p.rows, (i, p.name)))
        blocks: dict[object, np.ndarray] = {}

        async def read_array(path: str, wanted: list[tuple[int, int, object]]) -> None:
            arr = await self._array(path)
            spans = coalesce(wanted, gap=arr.chunks[0])
            datas = await asyncio.gather(*(arr.getitem(slice(lo, hi)) for lo, hi, _ in spans))
            for (lo, _, members), data in zip(spans, datas):
                for start, stop, tag in members:
                    blocks[tag] = data[start - lo:stop - lo]

        await asyncio.gather(*(read_array(p, w) for p, w in by_array.items()))
        return [{p.name: from_rows(blocks.get((i, p.name)), p) for p in entry.placements}
                for i, entry in enumerate(entries)]

    def _fetch_one(self, entry: SegmentEntry, verify: bool) -> dict[str, np.ndarray]:
        try:
            arrays = sync(self._fetch([entry]))[0]
        except Exception as exc:
            self._missing_or_corrupt(entry, f"unreadable ({type(exc).__name__}: {exc})", exc)
        if verify:
            self._verify(entry, arrays)
        return arrays

    def _verify(self, entry: SegmentEntry, arrays: dict[str, np.ndarray]) -> None:
        digest = content_hash(arrays)
        if digest != entry.content_hash:
            self._missing_or_corrupt(
                entry, f"content hash {digest} does not match the indexed {entry.content_hash}")

    def _missing_or_corrupt(
        self, entry: SegmentEntry, why: str, cause: Exception | None = None
    ) -> NoReturn:
        with self._lock:
            sync(self._log.reload())  # deleted meanwhile? then its chunks may be gone: not corrupt
        if entry.segment_id not in self._index.live:
            raise SegmentNotFound(
                f"segment {entry.segment_id!r} was deleted from {self.url}") from cause
        arrays = sorted({p.array for p in entry.placements})
        raise SegmentCorrupt(
            f"segment {entry.segment_id!r} in {self.url} is corrupt: {why} (arrays {arrays})"
        ) from cause

    async def _reclaim(self, dead: list[Placement]) -> None:
        """Delete the chunks that only dead rows use."""
        live: dict[str, list[tuple[int, int]]] = {}
        for entry in self._index.live.values():
            for p in entry.placements:
                live.setdefault(p.array, []).append((p.start, p.start + p.rows))
        doomed: list[str] = []
        for path in sorted({p.array for p in dead}):
            arr = await self._array(path)
            tail = (0,) * (arr.ndim - 1)
            ranges = [(p.start, p.start + p.rows) for p in dead if p.array == path]
            cursor = self._index.cursors.get(path, 0)
            for c in dead_chunks(ranges, live.get(path, []), arr.chunks[0], cursor):
                doomed.append(f"{path}/{arr.metadata.encode_chunk_key((c, *tail))}")
        await delete_keys(self._store, doomed)
