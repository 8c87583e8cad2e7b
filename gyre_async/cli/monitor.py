"""``gyre monitor``: a live dashboard of a run's bus (:mod:`gyre_async.ui.monitor` draws)."""

from __future__ import annotations

import argparse

DESCRIPTION = ("Live dashboard of a run, by subscription to every topic of its bus: policy "
               "version, validation and training success, returns, reward components, "
               "staleness, throughput per role, consumer lag, heartbeats (silent actors "
               "named), rollbacks and dead letters. Works on a running `gyre run`, on actors "
               "in separate processes (embedded or Kafka) and on a finished run's log.")


def add_parser(sub) -> None:
    p = sub.add_parser("monitor", help="live dashboard of a run's bus", description=DESCRIPTION)
    p.add_argument("--bus", metavar="URL",
                   help="bus URL (default: $GYRE_BUS, else the config's run log)")
    p.add_argument("--config", help="config file (to find the run's bus)")
    p.add_argument("--run", dest="run_id", metavar="ID", help="show only events of this run id")
    p.add_argument("--once", action="store_true",
                   help="catch up to the current end, print one frame and exit")
    p.add_argument("--refresh", type=float, default=0.5, metavar="S",
                   help="seconds between redraws")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from gyre_async.config import bus_url, load_config
    from gyre_async.runtime.process import run_main
    from gyre_async.ui.monitor import monitor

    url = bus_url(load_config(getattr(args, "config", None)), args.bus)
    try:
        return run_main(lambda: monitor(url, args.run_id, args.once, args.refresh))
    except KeyboardInterrupt:
        return 130
