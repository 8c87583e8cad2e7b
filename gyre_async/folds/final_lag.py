"""How far behind each consumer group is when a run ends, read from the bus itself.

``lag`` is what ``gyre topics`` shows: records written but not committed by the group. It
counts two different things: records the group never handled, and records it handled but
still holds in memory on purpose (a segmenter's open segments, a learner's partial batch:
the runtime never commits past them, so a crash gets them again). ``steps`` weighs
the uncommitted records by the trajectory steps they carry (a step is one, a segment or
a score its length), the unit of ``learner.batch_steps``: the bound a run is held to is
that no group is more than one learner batch behind.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gyre_async.bus.base import Bus
from gyre_async.bus.reading import end_offsets, read_back_limit
from schemas import DecodeError, Event, decode
from schemas.events import TrajectoryStep


def steps_of(event: Event) -> int:
    """Trajectory steps an event carries (the unit of ``learner.batch_steps``): one per
    step, a segment's (or score's) length."""
    if isinstance(event, TrajectoryStep):
        return 1
    start, end = getattr(event, "step_start", None), getattr(event, "step_end", None)
    if isinstance(start, int) and isinstance(end, int):
        return max(end - start, 0)
    return 0


async def _uncommitted_steps(bus: Bus, topic: str, committed: Mapping[int, int],
                             ends: Mapping[int, int]) -> int:
    """Env steps in ``topic`` from each partition's committed offset to its end offset."""
    remaining = {p: end for p, end in ends.items() if end > committed.get(p, 0)}
    if not remaining:
        return 0
    reader = await bus.reader([topic])
    steps = 0
    try:
        for partition in remaining:
            await reader.seek(topic, partition, committed.get(partition, 0))
        while remaining:
            records = await reader.fetch(2000, 0.5)
            if not records:
                break  # the end offsets were read first: nothing more will come
            for record in records:
                end = remaining.get(record.partition)
                if end is None or record.offset >= end:
                    continue
                if record.offset + 1 >= end:
                    del remaining[record.partition]
                try:
                    steps += steps_of(decode(topic, record.value, read_back_limit(bus)))
                except DecodeError:
                    continue  # dead-lettered by the group anyway: no steps to weigh
    finally:
        await reader.close()
    return steps


async def final_lag(bus: Bus, consumes: Mapping[str, Sequence[str]]) -> dict[str, dict]:
    """``{group: {"lag": records, "steps": steps, "topics": {topic: records}}}`` for
    each group and the topics it consumes (``consumes``: group -> topics)."""
    out: dict[str, dict] = {}
    for group, topics in consumes.items():
        ends = await end_offsets(bus, topics)
        per_topic: dict[str, int] = {}
        steps = 0
        for topic in topics:
            topic_ends = {p: end for (name, p), end in ends.items() if name == topic}
            committed = await bus.committed(group, topic)
            per_topic[topic] = sum(max(end - committed.get(p, 0), 0)
                                   for p, end in topic_ends.items())
            steps += await _uncommitted_steps(bus, topic, committed, topic_ends)
        out[group] = {"lag": sum(per_topic.values()), "steps": steps, "topics": per_topic}
    return out


def within_bound(lags: Mapping[str, Mapping], batch_steps: int) -> bool:
    """No group holds more than one learner batch (``batch_steps`` steps) uncommitted.

    Groups that consume only topics without steps (policy versions, evaluations) weigh
    nothing here; their record lag is reported beside it.
    """
    return all(entry["steps"] <= batch_steps for entry in lags.values())
