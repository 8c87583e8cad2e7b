"""Reading a whole topic back (replay, tail, audits, summaries, actor rebuilds).

:func:`read_events` is the one reader of decoded events; :func:`iter_topics` gives raw
records for the few callers that copy bytes (archive, tail of raw records).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import structlog

from gyre_async.bus.base import Bus, Record
from schemas import DecodeError, Event, decode

log = structlog.get_logger(__name__)


def read_back_limit(bus: Bus) -> int:
    """The size limit a record read back is decoded with: the bus's own, the one live
    consumers decode with. A record over it was refused (dead-lettered) live, so every
    reader treats it the same way (its declared bad-record policy), never decodes it: a
    restart, a replay or a report must not take in what the live run refused, nor spend
    memory on an event the size of a forged record."""
    return bus.max_message_bytes


async def end_offsets(bus: Bus, topics: Sequence[str]) -> dict[tuple[str, int], int]:
    infos = {t.name: t for t in await bus.topics()}
    return {
        (name, p): end
        for name in topics
        if name in infos
        for p, end in infos[name].end_offsets.items()
    }


async def iter_topics(
    bus: Bus, topics: Sequence[str], *, follow: bool = False, batch: int = 2000,
    idle_timeout_s: float = 30.0,
) -> AsyncIterator[Record]:
    """Yield every record of ``topics`` from offset 0 (per partition, in order).

    Without ``follow`` it stops at the end offsets seen when it started. ``idle_timeout_s``
    bounds how long it waits for records it was told exist (a broker that under-reports
    nothing is fine; one that over-reports would otherwise hang).
    """
    targets = await end_offsets(bus, topics)
    reader = await bus.reader(list(topics))
    try:
        remaining = {tp: end for tp, end in targets.items() if end > 0}
        last_progress = time.monotonic()
        while follow or remaining:
            records = await reader.fetch(batch, 0.2)
            if records:
                last_progress = time.monotonic()
            for record in records:
                tp = (record.topic, record.partition)
                if not follow:
                    end = remaining.get(tp)
                    if end is None or record.offset >= end:
                        continue
                    if record.offset + 1 >= end:
                        del remaining[tp]
                yield record
            if not follow and time.monotonic() - last_progress > idle_timeout_s:
                raise TimeoutError(f"records promised by end offsets never arrived: {remaining}")
    finally:
        await reader.close()


async def read_topics(bus: Bus, topics: Sequence[str]) -> list[Record]:
    return [r async for r in iter_topics(bus, topics)]


class UndecodableRecord(Exception):
    """A record of the log that does not decode, raised by ``read_events(on_bad="raise")``."""

    retriable = False

    def __init__(self, record: Record, reason: str):
        super().__init__(f"{record.topic}[{record.partition}]@{record.offset}: {reason}")
        self.record = record
        self.reason = reason


class UnknownTopic(LookupError):
    """``read_events(missing="raise")`` was asked for a topic the bus does not have."""

    retriable = False

    def __init__(self, absent: Sequence[str], known: Sequence[str]):
        super().__init__(f"no topic {', '.join(map(repr, absent))} on this bus (it has: "
                         f"{', '.join(known) or 'none'}); check the bus URL and the run")
        self.absent = list(absent)


@dataclass
class ReadCounts:
    """What a :func:`read_events` pass saw: decoded events and skipped (undecodable) records,
    and how far it got: the next offset per (topic, partition), skipped records included (a
    follower compares it with :func:`end_offsets` to know it has caught up)."""

    decoded: int = 0
    skipped: int = 0
    last_skip_reason: str = ""
    foreign: int = 0  # decoded, but of another run (with ``run_id``)
    next_offsets: dict[tuple[str, int], int] = field(default_factory=dict)


async def read_events(
    bus: Bus, topics: Sequence[str], *, on_bad: Literal["skip", "raise"] = "skip",
    follow: bool = False, counts: ReadCounts | None = None, run_id: str | None = None,
    missing: Literal["empty", "raise"] = "empty",
) -> AsyncIterator[tuple[Record, Event]]:
    """Every event of ``topics`` from offset 0, decoded: the one way to read a topic back.

    The log is the run's audit trail, so a record that no longer decodes (a newer schema, a
    corrupted byte) has one declared policy, chosen by the caller: ``"skip"`` counts it in
    ``counts`` (and logs it) and goes on, which suits views and rebuilds that must survive a
    poisoned record the way live actors do (those records sit in ``dead-letter`` already);
    ``"raise"`` stops with :class:`UndecodableRecord`, which suits audits that must not
    report on a partial log. Events are decoded with the live size limit
    (:func:`read_back_limit`): an oversized record is a bad record like any other. With
    ``run_id``, only that run's events are yielded (topics
    are shared by every run on a cluster; the others are counted in ``counts.foreign``).
    A topic that does not exist yet (a run that has not published there) has a declared
    answer too, ``missing``: ``"empty"`` reads it as a topic with no events (a rebuild on a
    fresh run), ``"raise"`` raises :class:`UnknownTopic` naming it (a tool that was given a
    name). Without ``follow`` no topic is created by reading it.
    """
    seen = counts if counts is not None else ReadCounts()
    limit = read_back_limit(bus)
    if not follow:
        known = {t.name for t in await bus.topics()}
        absent = [t for t in topics if t not in known]
        if absent and missing == "raise":
            raise UnknownTopic(absent, sorted(known))
        topics = [t for t in topics if t in known]
        if not topics:
            return
    async for record in iter_topics(bus, topics, follow=follow):
        seen.next_offsets[(record.topic, record.partition)] = record.offset + 1
        try:
            event = decode(record.topic, record.value, limit)
        except DecodeError as exc:
            if on_bad == "raise":
                raise UndecodableRecord(record, exc.reason) from None
            seen.skipped += 1
            seen.last_skip_reason = exc.reason
            log.warning("read_back.undecodable", topic=record.topic, partition=record.partition,
                        offset=record.offset, reason=exc.reason)
            continue
        seen.decoded += 1
        if run_id is not None and event.run_id != run_id:
            seen.foreign += 1
            continue
        yield record, event
