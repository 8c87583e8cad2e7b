"""``gyre topics``: topics, end offsets and lag per consumer group."""

from __future__ import annotations

import argparse

from gyre_async.bus import open_bus


def add_parser(sub) -> None:
    p = sub.add_parser("topics", help="topics, end offsets and lag per consumer group")
    p.add_argument("--bus", help="bus URL")
    p.add_argument("--config", help="config file (to find the run's bus)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from gyre_async.cli.common import config_of
    from gyre_async.config import bus_url
    from gyre_async.runtime.process import run_main

    url = bus_url(config_of(args), args.bus)
    return run_main(lambda: topics(url))


async def topics(url: str) -> int:
    async with open_bus(url, reader=True) as bus:
        infos = await bus.topics()
        groups = await bus.groups()
        print(f"{'topic':<20} {'parts':>5} {'records':>10}")
        for t in infos:
            print(f"{t.name:<20} {t.partitions:>5} {sum(t.end_offsets.values()):>10}")
        if groups:
            print(f"\n{'group':<40} {'topic':<20} {'lag':>8}")
            for g in groups:
                for t in infos:
                    done = await bus.committed(g, t.name)
                    if done:
                        print(f"{g:<40} {t.name:<20} {await bus.lag(g, [t.name]):>8}")
    return 0
