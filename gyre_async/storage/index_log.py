"""The segment index as a log of immutable pages in the store (I/O side of segment_index).

One writer appends pages ``index/<seq>.json`` with exclusive creates, so a second writer
is detected rather than silently interleaved. Readers catch up by fetching ``seq + 1``
until it is missing, and fall back to a full reload (newest snapshot plus the pages
after it) when a page they expected has been folded into a snapshot by compaction.
Methods are coroutines for Zarr's loop, except those that also fsync.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from zarr.core.buffer import default_buffer_prototype
from zarr.core.sync import sync

from gyre_async.storage.errors import SegmentStoreError
from gyre_async.storage.segment_index import (
    INDEX_PREFIX,
    IndexPage,
    IndexState,
    decode_page,
    decode_snapshot,
    encode,
    page_key,
    parse_index_key,
    snapshot_key,
)
from gyre_async.storage.urls import fsync_paths

PROTO = default_buffer_prototype()


class IndexLog:
    def __init__(self, store: Any, url: str, root: Path | None, durable: bool) -> None:
        self.store = store
        self.url = url
        self.root = root
        self.durable = durable
        self.state = IndexState()

    async def get(self, key: str) -> bytes | None:
        try:
            buf = await self.store.get(key, prototype=PROTO)
        except FileNotFoundError:  # a reader that started before the writer created the store
            return None
        return None if buf is None else buf.to_bytes()

    async def keys(self) -> list[str]:
        try:
            return [k async for k in self.store.list_prefix(INDEX_PREFIX)]
        except FileNotFoundError:
            return []

    async def refresh(self) -> None:
        """Catch up page by page from the last one applied."""
        while (raw := await self.get(page_key(self.state.seq + 1))) is not None:
            self.state.apply(decode_page(raw))

    async def reload(self) -> None:
        """Rebuild the state from the newest snapshot and the pages after it."""
        for _ in range(10):
            parsed = [p for k in await self.keys() if (p := parse_index_key(k))]
            state = IndexState()
            if snaps := [seq for kind, seq in parsed if kind == "snapshot"]:
                raw = await self.get(snapshot_key(max(snaps)))
                if raw is None:
                    continue  # compacted again meanwhile
                state.apply_snapshot(decode_snapshot(raw))
            seqs = sorted(seq for kind, seq in parsed if kind == "page" and seq > state.seq)
            raws = await asyncio.gather(*(self.get(page_key(s)) for s in seqs))
            pages = [raw for raw in raws if raw is not None]
            if len(pages) != len(raws):
                continue  # a page was compacted away meanwhile
            for seq, raw in zip(seqs, pages):
                if seq != state.seq + 1:
                    break
                state.apply(decode_page(raw))
            self.state = state
            await self.refresh()
            return
        raise SegmentStoreError(f"index of {self.url} kept changing during reload")

    def append(self, page: IndexPage) -> None:
        """Publish the next page (durably) and apply it. Call from outside Zarr's loop."""
        if page.seq != self.state.seq + 1:
            raise SegmentStoreError(f"page {page.seq} does not follow {self.state.seq}")
        self._put(page_key(page.seq), encode(page), exclusive=True)
        self.state.apply(page)

    def compact(self) -> int:
        """Fold all pages into a snapshot, then remove them; returns objects removed."""
        snap = self.state.snapshot()
        keep = snapshot_key(snap.through_seq)
        self._put(keep, encode(snap), exclusive=False)
        old = [k for k in sync(self.keys())
               if (p := parse_index_key(k)) and p[1] <= snap.through_seq and k != keep]
        sync(delete_keys(self.store, old))
        return len(old)

    def _put(self, key: str, payload: bytes, exclusive: bool) -> None:
        buf = PROTO.buffer.from_bytes(payload)
        if exclusive:
            sync(self.store.set_if_not_exists(key, buf))
            if sync(self.get(key)) != payload:
                raise SegmentStoreError(
                    f"index page {key} of {self.url} was written by someone else: "
                    "a segment store takes one writer process")
        else:
            sync(self.store.set(key, buf))
        if self.durable and self.root is not None:
            fsync_paths([self.root / key], self.root)


async def delete_keys(store: Any, keys: list[str]) -> None:
    await asyncio.gather(*(store.delete(k) for k in keys))
