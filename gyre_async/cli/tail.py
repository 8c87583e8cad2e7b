"""``gyre tail TOPIC``: a topic's events as JSON lines."""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import sys

from gyre_async.bus import open_bus
from gyre_async.bus.base import Bus
from gyre_async.bus.reading import read_back_limit
from gyre_async.bus.secrets import redact
from schemas import DecodeError, decode, to_builtins
from schemas.topics import ALL_TOPICS


def add_parser(sub) -> None:
    p = sub.add_parser("tail", help="print a topic's events as JSON lines",
                       description="Subscribe to a topic and print each event as one JSON "
                       "line: monitoring by subscription, no side channel.")
    p.add_argument("topic", help=f"one of: {', '.join(ALL_TOPICS)}")
    p.add_argument("--bus", help="bus URL")
    p.add_argument("--config", help="config file (to find the run's bus)")
    p.add_argument("--from", dest="start", default="0",
                   help="start offset (per partition) or ISO time / epoch seconds")
    p.add_argument("--follow", "-f", action="store_true", help="keep waiting for new events")
    p.add_argument("--max", type=int, default=0, help="stop after N events")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from gyre_async.cli.common import config_of
    from gyre_async.config import bus_url
    from gyre_async.runtime.process import run_main

    url = bus_url(config_of(args), args.bus)
    return run_main(lambda: tail(url, args))


async def existing_bus(url: str, follow: bool) -> Bus:
    """The bus to read, never a new embedded log: a tail of a run that has not started yet
    fails with the path (with ``--follow`` it waits for the run to make its log). An empty
    ``events.db`` left behind would make that run refuse its directory."""
    from gyre_async.bus.embedded import EmbeddedBus

    if not follow:
        return open_bus(url, reader=True)  # a missing embedded log: NoEventLog with its path
    bus = open_bus(url)
    if isinstance(bus, EmbeddedBus) and not os.path.isfile(bus.path):
        print(f"gyre tail: waiting for the run to create {bus.path}", file=sys.stderr)
        while not os.path.isfile(bus.path):
            await asyncio.sleep(0.5)
    return bus


def parse_start(start: str) -> tuple[int | None, float | None]:
    try:
        return int(start), None
    except ValueError:
        pass
    try:
        return None, float(start)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(start)
    except ValueError:
        raise SystemExit(f"--from {start!r}: give an offset, epoch seconds or ISO time") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=dt.UTC)
    return None, when.timestamp()


async def tail(url: str, args) -> int:
    """Records of one topic as JSON lines, from an offset or a time.

    Not :func:`~gyre_async.bus.reading.read_events`: the tail seeks (``--from``), and it is
    a record viewer, so a record that does not decode is printed where it lies, with the
    reason, instead of being skipped or stopping the tail. It decodes without the live
    size limit, like every read-back.
    """
    offset, timestamp = parse_start(args.start)
    out = sys.stdout
    count = 0
    async with await existing_bus(url, args.follow) as bus:
        known = {t.name: t for t in await bus.topics()}
        if args.topic not in known:
            raise SystemExit(f"no topic {args.topic!r} on {redact(url)}; topics: {', '.join(known)}")
        info = known[args.topic]
        reader = await bus.reader([args.topic])
        try:
            if timestamp is not None:
                await reader.seek_to_time(timestamp)
            else:
                for p in range(info.partitions):
                    await reader.seek(args.topic, p, offset or 0)
            pending = {p for p, end in info.end_offsets.items() if end > (offset or 0)}
            if timestamp is not None:
                pending = set(info.end_offsets)
            idle = 0
            while True:
                records = await reader.fetch(1000, 0.25)
                for r in records:
                    line = {"topic": r.topic, "partition": r.partition, "offset": r.offset,
                            "timestamp": r.timestamp}
                    try:  # a record viewer: a bad record is shown where it lies, with why
                        line["event"] = to_builtins(decode(r.topic, r.value,
                                                           read_back_limit(bus)))
                    except DecodeError as exc:
                        line["undecodable"] = exc.reason
                    out.write(json.dumps(line, default=str) + "\n")
                    count += 1
                    if r.offset + 1 >= info.end_offsets.get(r.partition, 0):
                        pending.discard(r.partition)
                    if args.max and count >= args.max:
                        out.flush()
                        return 0
                out.flush()
                idle = 0 if records else idle + 1
                if not args.follow and (not pending or idle >= 8):
                    return 0
        finally:
            await reader.close()
