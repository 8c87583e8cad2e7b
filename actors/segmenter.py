"""Segmenter: cuts trajectories into training segments at sub-task boundaries.

consumes: trajectory-step (TrajectoryStep, EnvError)
emits:    segment-closed (SegmentClosed)

The cutting rules live in :mod:`gyre_async.core.segmenter`; this adapter feeds it steps,
writes the segments it closes to the Zarr segment store *before* ``segment-closed``
announces their address, and keeps the runtime from committing past steps that only its
memory holds (``commit_floor``). On restart it folds its own ``segment-closed`` log back
into the core, so redelivered steps of already-closed segments are skipped.
"""

from __future__ import annotations

import asyncio

from gyre_async import timing
from gyre_async.bus.reading import read_events
from gyre_async.core.segmenter import (
    PendingWrites,
    SegmenterCore,
    segment_arrays,
    segment_closed,
    segment_id,
)
from gyre_async.experience.retention import Retention, incoming_bytes
from gyre_async.runtime.actor import Actor, Emit
from gyre_async.storage.segments import SegmentStore
from schemas.config import Config, SegmenterConfig
from schemas.events import EnvError, SegmentClosed, TrajectoryStep
from schemas.topics import SEGMENT_CLOSED, TRAJECTORY_STEP


class Segmenter(Actor):
    role = "segmenter"
    consumes = (TRAJECTORY_STEP,)
    emits = (SEGMENT_CLOSED,)

    def __init__(self, config: SegmenterConfig, store_url: str, run_id: str):
        self.core = SegmenterCore(config)
        self.pending = PendingWrites(config)
        self.store = SegmentStore(store_url, durable=config.fsync)
        self.retention = Retention(self.store, config.retain_bytes)
        self.run_id = run_id
        self.segments = 0

    @classmethod
    def from_config(cls, cfg: Config) -> Segmenter:
        store = cfg.segmenter.store or f"{cfg.run.run_dir}/segments.zarr"
        return cls(cfg.segmenter, store, cfg.run.run_id)

    async def on_start(self) -> None:
        async for _, event in read_events(self.runner.bus, [SEGMENT_CLOSED], on_bad="skip"):
            if isinstance(event, SegmentClosed) and event.producer == self.runner.name:
                self.core.restore(event)

    async def handle(self, event, record):
        match event:
            case TrajectoryStep():
                self.pending.extend(self.core.add(event, (record.partition, record.offset)))
            case EnvError():
                self.pending.extend(self.core.abort(event))
        return []

    async def after_batch(self):
        """Write the segments that are due in one store transaction, then announce them."""
        due = self.pending.take_due(asyncio.get_running_loop().time())
        if not due:
            return []
        items = [(segment_id(self.run_id, seg), segment_arrays(seg)) for seg in due]
        await self.retention.follow(self.runner.bus)  # what the learner is done with
        refs = await asyncio.to_thread(self._write, items)
        self.segments += len(due)
        return [Emit(SEGMENT_CLOSED, segment_closed(seg, sid, ref, run_id=self.run_id,
                                                    producer=self.runner.name))
                for seg, (sid, _), ref in zip(due, items, refs)]

    def _write(self, items):
        with timing.timed("storage"):
            self.retention.make_room(incoming_bytes(items))
            return self.store.write_many(items)

    def commit_floor(self):
        return self.pending.hold(self.core.commit_floor())

    def inputs_ended(self) -> None:
        """The run ends: open segments are cut where they stand and written like any."""
        self.pending.extend(self.core.cut_all())

    def settled(self) -> bool:
        """Closed segments waiting for their batched write go out within ``write_delay_s``."""
        return not self.pending.segments

    def stats(self):
        r = self.retention.stats
        return {"segments": float(self.segments), "open_segments": float(len(self.core.open)),
                "retention_deleted": float(r.deleted), "retention_over_bound": float(r.over_bound)}

    async def on_stop(self) -> None:
        await self.retention.close()
