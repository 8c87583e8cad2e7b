"""Segmenter: cuts trajectories into training segments at sub-task boundaries.

consumes: trajectory-step (TrajectoryStep, EnvError)
emits:    segment-closed (SegmentClosed)
reads:    segment-closed (a fold, on each assignment), policy-version and telemetry (what
          the learner is done with, followed for retention: gyre_async.experience.retention)

The cutting rules live in :mod:`gyre_async.core.segmenter`; this adapter feeds it steps,
writes the segments it closes to the Zarr segment store *before* ``segment-closed``
announces their address, and keeps the runtime from committing past steps that only its
memory holds (``commit_floor``).

Scale-out (``gyre launch --replicas segmenter=N``): the replicas share the role's consumer
group, which splits ``trajectory-step``'s partitions between them (a trajectory's steps
share one partition, its key). Each writes a segment store of its own
(:func:`~gyre_async.storage.store_set.segment_store_url`: a store has one writer); the
addresses they announce name their store. When partitions come to a segmenter (its start,
or another replica leaving) it folds the run's whole ``segment-closed`` log into the core,
whoever wrote it, so steps another segmenter already segmented are skipped; when
partitions leave it (a replica joined), it forgets their open and unwritten segments, which
the new owner reads again from the commit floor. A segment closed by both in the moment of
a hand-over has one id (it is deterministic) and is handled once downstream.

Bad input is refused, never kept: a closed segment whose announcement would not fit on the
bus (long action texts) is split into parts that do (:mod:`gyre_async.core.segment_fit`),
and one that cannot be written for good (its id already holds other content) is
dead-lettered with the reason while the rest of its batch is written and announced.
"""

from __future__ import annotations

import asyncio

from gyre_async import timing
from gyre_async.bus import Record
from gyre_async.core.segment_fit import fit_to_bus
from gyre_async.core.segmenter import (
    ClosedSegment,
    PendingWrites,
    SegmenterCore,
    segment_arrays,
    segment_closed,
    segment_id,
)
from gyre_async.errors import is_retriable
from gyre_async.experience.retention import CONSUMPTION_TOPICS, Retention, incoming_bytes
from gyre_async.folds.restart import ClosedSegments
from gyre_async.runtime.actor import Actor, Emit
from gyre_async.storage.segments import SegmentRef, SegmentStore
from gyre_async.storage.store_set import segment_store_url
from schemas import encode
from schemas.config import Config, SegmenterConfig
from schemas.events import EnvError, SegmentClosed, TrajectoryStep
from schemas.topics import SEGMENT_CLOSED, TRAJECTORY_STEP


class Segmenter(Actor):
    role = "segmenter"
    consumes = (TRAJECTORY_STEP,)
    emits = (SEGMENT_CLOSED,)
    reads = (SEGMENT_CLOSED, *CONSUMPTION_TOPICS)

    def __init__(self, config: SegmenterConfig, store_url: str, run_id: str):
        self.config = config
        self.core = SegmenterCore(config)
        self.pending = PendingWrites(config)
        self.base_store_url = store_url
        self.store = SegmentStore(store_url, durable=config.fsync)
        self.retention = Retention(self.store, config.retain_bytes)
        self.run_id = run_id
        self.segments = 0
        self.released = 0  # open or unwritten segments handed over with their partition

    @classmethod
    def from_config(cls, cfg: Config) -> Segmenter:
        return cls(cfg.segmenter, cfg.segmenter.store or f"{cfg.run.run_dir}/segments.zarr",
                   cfg.run.run_id)

    async def on_start(self) -> None:
        """The store is this segmenter's own (its actor name is known now)."""
        url = segment_store_url(self.base_store_url, self.runner.name)
        if url != self.base_store_url:
            self.store = SegmentStore(url, durable=self.config.fsync)
            self.retention = Retention(self.store, self.config.retain_bytes)

    def folds(self):
        """Every segment this run closed so far, by any of its segmenters: restored on every
        assignment of step partitions, after the release below."""
        return (ClosedSegments(self.core.restore),)

    async def assignment_changed(self, added, removed) -> None:
        lost = {partition for topic, partition in removed if topic == TRAJECTORY_STEP}
        if lost:
            self.released += self.core.release(lost) + self.pending.release(lost)

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
        due = [part for seg in due for part in self._fitting(seg)]
        items = [(segment_id(self.run_id, seg), segment_arrays(seg)) for seg in due]
        await self.retention.follow(self.runner.bus)  # what the learner is done with
        try:
            refs = await asyncio.to_thread(self._write, items)
        except Exception as exc:  # noqa: BLE001 - routed by `retriable`
            if is_retriable(exc):
                raise  # a full disk: the supervisor restarts us, the steps come again
            return await self._write_each(due, items)
        self.segments += len(due)
        return [Emit(SEGMENT_CLOSED, segment_closed(seg, sid, ref, run_id=self.run_id,
                                                    producer=self.runner.name))
                for seg, (sid, _), ref in zip(due, items, refs)]

    async def _write_each(self, due: list[ClosedSegment], items) -> list[Emit]:
        """A batched write failed for good: each segment alone, so one that cannot be
        written (e.g. its id already holds other content) is dead-lettered, with the reason,
        and the others are announced. Kept, it would fail every later write (and, raised,
        crash the segmenter at every start on the same steps)."""
        out: list[Emit] = []
        for seg, item in zip(due, items):
            try:
                (ref,) = await asyncio.to_thread(self._write, [item])
            except Exception as exc:  # noqa: BLE001 - routed by `retriable`
                if is_retriable(exc):
                    raise
                first = seg.steps[0]
                partition, offset = seg.first_offset
                record = Record(TRAJECTORY_STEP, partition, offset, first.key.encode(),
                                encode(first), first.ts)
                out.append(self.runner.dead_letter(record, (
                    f"segment of steps [{first.step_index}, {seg.steps[-1].step_index + 1}) "
                    f"of trajectory {seg.trajectory_id!r} not written: {exc!r}")))
                continue
            self.segments += 1
            out.append(Emit(SEGMENT_CLOSED, segment_closed(
                seg, item[0], ref, run_id=self.run_id, producer=self.runner.name)))
        return out

    def _fitting(self, seg: ClosedSegment) -> list[ClosedSegment]:
        """``seg``, split where its announcement would not fit on the bus (long action
        texts): :mod:`gyre_async.core.segment_fit`. The margin covers what the placeholder
        address and hash cannot know."""
        def announce(part: ClosedSegment) -> SegmentClosed:
            sid = segment_id(self.run_id, part)
            ref = SegmentRef(self.store.address(sid), "0" * 64)
            return segment_closed(part, sid, ref, run_id=self.run_id, producer=self.runner.name)
        return fit_to_bus(seg, announce, self.runner.bus.max_message_bytes - 256)

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
                "released_segments": float(self.released),
                "retention_deleted": float(r.deleted), "retention_over_bound": float(r.over_bound)}

    async def on_stop(self) -> None:
        await self.retention.close()
