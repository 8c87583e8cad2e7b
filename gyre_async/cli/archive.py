"""``gyre archive``: record every topic of a run into an embedded log."""

from __future__ import annotations

import argparse
import os

from gyre_async.bus import open_bus


def add_parser(sub) -> None:
    p = sub.add_parser("archive", help="record every topic of a run into an embedded log",
                       description="Copy every topic of a run (e.g. from Kafka) into the "
                       "embedded log format, so it can be replayed, inspected and reported "
                       "later without the cluster.")
    p.add_argument("--bus", required=True, help="source bus URL, e.g. kafka://host:9092")
    p.add_argument("--out", required=True, help="directory for events.db")
    p.add_argument("--topics", help="comma-separated topics (default: all)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from gyre_async.runtime.process import run_main

    return run_main(lambda: archive_run(args))


async def archive_run(args) -> int:
    from gyre_async.audit.archive import archive

    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, "events.db")
    topics = args.topics.split(",") if args.topics else None
    async with open_bus(args.bus, reader=True) as bus:
        counts = await archive(bus, out, topics)
    for name, n in sorted(counts.items()):
        print(f"{name:<20} {n:>10}")
    print(f"archived {sum(counts.values())} events into {out}")
    return 0
