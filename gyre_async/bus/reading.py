"""Reading a whole topic back (replay, tail, audits, summaries)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Sequence

from .base import Bus, Record


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
