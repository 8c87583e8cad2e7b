"""``gyre archive``: record every topic of a run from any bus into the embedded log format.

A Kafka run is archived into ``<out>/events.db`` so it can be replayed, inspected, tailed and
reported later with the same tools, without the cluster. Partitioning is preserved (both
backends place a key on ``crc32(key) % partitions``), and so is each partition's order.
"""

from __future__ import annotations

from collections.abc import Sequence

from gyre_async.bus import Bus
from gyre_async.bus.embedded import EmbeddedBus
from gyre_async.bus.reading import iter_topics


async def archive(source: Bus, out_path: str, topics: Sequence[str] | None = None,
                  batch: int = 2000) -> dict[str, int]:
    """Copy ``topics`` (default: all) from ``source`` into a new embedded log; counts per topic."""
    infos = {t.name: t for t in await source.topics()}
    names = [t for t in (topics or sorted(infos)) if t in infos and not t.startswith("__")]
    counts: dict[str, int] = {}
    async with EmbeddedBus(out_path) as target:
        for name in names:
            await target.create_topics([name], infos[name].partitions)
        pending: dict[str, list] = {}
        async for record in iter_topics(source, names):
            pending.setdefault(record.topic, []).append((record.key, record.value))
            counts[record.topic] = counts.get(record.topic, 0) + 1
            if len(pending[record.topic]) >= batch:
                await target.publish(record.topic, pending.pop(record.topic))
        for name, messages in pending.items():
            await target.publish(name, messages)
    return counts
