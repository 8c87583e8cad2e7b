"""Subprocess worker for multi-process bus tests: produce or consume probe events."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import msgspec  # noqa: E402

from gyre_async.bus import open_bus  # noqa: E402
from schemas import encode, event_id  # noqa: E402
from schemas.events import Probe  # noqa: E402


async def produce(url: str, topic: str, prefix: str, n: int, batch: int) -> None:
    async with open_bus(url) as bus:
        for start in range(0, n, batch):
            msgs = []
            for seq in range(start, min(n, start + batch)):
                p = Probe(event_id=event_id(prefix, seq), run_id="t", producer=prefix,
                          key=f"{prefix}-{seq % 7}", seq=seq, payload=prefix)
                msgs.append((p.key.encode(), encode(p)))
            await bus.publish(topic, msgs)


async def consume(url: str, topic: str, group: str, n: int, out: str) -> None:
    seen = 0
    async with open_bus(url) as bus:
        consumer = await bus.consumer(group, [topic])
        with open(out, "a") as f:
            while seen < n:
                records = await consumer.fetch(500, 1.0)
                for r in records:
                    p = msgspec.msgpack.decode(r.value, type=Probe)
                    f.write(f"{p.payload} {p.seq}\n")
                f.flush()
                if records:
                    await consumer.commit({(r.topic, r.partition): r.offset + 1 for r in records})
                seen += len(records)
        await consumer.close()


if __name__ == "__main__":
    cmd, url, topic, a, n = sys.argv[1:6]
    if cmd == "produce":
        asyncio.run(produce(url, topic, a, int(n), int(sys.argv[6]) if len(sys.argv) > 6 else 50))
    else:
        asyncio.run(consume(url, topic, a, int(n), sys.argv[6]))
