"""``gyre report RUN_DIR``: one self-contained HTML page about a run
(:mod:`gyre_async.ui.report` writes it)."""

from __future__ import annotations

import argparse
import sys


def add_parser(sub) -> None:
    p = sub.add_parser(
        "report", help="write a self-contained HTML report of a run",
        description="Read a run's event log (and its config.json / summary.json) and write one "
        "HTML page that opens offline: learning curves, reward components, staleness, segment "
        "lengths and boundaries, throughput, learner losses, rollbacks, a summary table, dead "
        "letters and the config. Figures are embedded PNGs (also written to RUN_DIR/report/). "
        "Works on finished and live runs; topics without events show 'no data'.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory made by `gyre run`")
    p.add_argument("--out", help="HTML file to write (default: RUN_DIR/report.html)")
    p.add_argument("--bus", help="read the event log from this bus URL (default: RUN_DIR/events.db"
                   ", else bus.url of RUN_DIR/config.json, e.g. a Kafka run)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from gyre_async.runtime.process import run_main
    from gyre_async.ui.report import build_report

    try:
        path = run_main(lambda: build_report(args.run_dir, out=getattr(args, "out", None),
                                             bus=getattr(args, "bus", None)))
    except FileNotFoundError as exc:
        print(f"gyre report: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0
