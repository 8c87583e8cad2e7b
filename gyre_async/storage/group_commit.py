"""Group commit for asyncio writers: many concurrent ``await write(...)``, few store writes.

A single segment write costs a few Zarr writes plus an index page no matter how small the
segment is, so writing segments one at a time tops out at tens per second, while
``write_many`` of a few hundred reaches thousands per second. A segmenter closing segments
for many trajectories at once gets the batch rate with this: each caller awaits its own
ref, which resolves once its batch is durable (so the caller may publish it). A batch is
flushed when ``max_batch`` segments are waiting or ``max_delay_s`` after its first one.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import numpy as np

from gyre_async.storage.segments import SegmentRef, SegmentStore


class GroupCommitWriter:
    """Batches writes to one :class:`SegmentStore` from tasks on one event loop."""

    def __init__(self, store: SegmentStore, max_batch: int = 256, max_delay_s: float = 0.02) -> None:
        if max_batch < 1 or max_delay_s < 0:
            raise ValueError("need max_batch >= 1 and max_delay_s >= 0")
        self.store = store
        self.max_batch = max_batch
        self.max_delay_s = max_delay_s
        self._pending: list[tuple[str, Mapping[str, np.ndarray], asyncio.Future[SegmentRef]]] = []
        self._full = asyncio.Event()
        self._flusher: asyncio.Task[None] | None = None

    async def write(self, segment_id: str, arrays: Mapping[str, np.ndarray]) -> SegmentRef:
        """Store one segment; returns its ref once durable. Errors (e.g. SegmentConflict)
        are raised to this caller only."""
        future: asyncio.Future[SegmentRef] = asyncio.get_running_loop().create_future()
        self._pending.append((segment_id, arrays, future))
        if len(self._pending) >= self.max_batch:
            self._full.set()
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush_soon(), name="segment-group-commit")
        return await future

    async def flush(self) -> None:
        """Write everything waiting now (e.g. before shutdown)."""
        while self._pending:
            await self._flush_batch()

    async def _flush_soon(self) -> None:
        while self._pending:
            try:
                await asyncio.wait_for(self._full.wait(), timeout=self.max_delay_s)
            except TimeoutError:
                pass
            await self._flush_batch()

    async def _flush_batch(self) -> None:
        batch, self._pending = self._pending[: self.max_batch], self._pending[self.max_batch:]
        if len(self._pending) < self.max_batch:
            self._full.clear()
        if not batch:
            return
        try:
            refs = await asyncio.to_thread(self.store.write_many, [(s, a) for s, a, _ in batch])
        except Exception:
            # write_many checks every segment before writing any: retry one by one so that
            # only the offending caller gets the error.
            for segment_id, arrays, future in batch:
                try:
                    ref = await asyncio.to_thread(self.store.write, segment_id, arrays)
                except Exception as exc:  # handed to the caller awaiting this segment
                    _settle(future, exc=exc)
                else:
                    _settle(future, ref=ref)
            return
        for (_, _, future), ref in zip(batch, refs):
            _settle(future, ref=ref)


def _settle(future: asyncio.Future[SegmentRef], ref: SegmentRef | None = None,
            exc: BaseException | None = None) -> None:
    if future.done():  # the caller was cancelled; its segment may still have been stored
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(ref)  # type: ignore[arg-type]
