"""``gyre replay ROLE``: re-run a role on its recorded inputs and diff its outputs."""

from __future__ import annotations

import argparse
import sys

from gyre_async.bus import open_bus


def add_parser(sub) -> None:
    p = sub.add_parser("replay", help="audit: re-run a role on recorded inputs, diff outputs",
                       description="Re-feed a role the inputs recorded in the event log, on "
                       "a scratch bus, and compare what it emits with what it emitted in "
                       "the run. Exit status 1 when there are differences.")
    p.add_argument("role")
    p.add_argument("--bus", help="bus URL of the recorded run")
    p.add_argument("--config", help="the run's config: RUN_DIR/config.json (recorded by "
                   "every run) or its TOML file")
    p.add_argument("--name", help="actor name used in the run (default: the role)")
    p.add_argument("--run-dir", help="the run's directory (stores), if not in the config")
    p.add_argument("--json", action="store_true", help="print the full report as JSON")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from gyre_async.cli.common import config_of
    from gyre_async.config import bus_url
    from gyre_async.runtime.process import run_main

    cfg = config_of(args)
    return run_main(lambda: replay_role(bus_url(cfg, args.bus), cfg, args))


async def replay_role(url: str, cfg, args) -> int:
    from gyre_async.audit.replay import replay, report_json

    async with open_bus(url, reader=True, max_message_bytes=cfg.bus.max_message_bytes) as bus:
        report = await replay(bus, args.role, cfg, name=args.name)
    if args.json:
        sys.stdout.write(report_json(report).decode() + "\n")
    else:
        print(f"replayed {args.role}: {report.inputs} inputs, {report.recorded_outputs} recorded "
              f"outputs, {report.replayed_outputs} replayed outputs")
        for eid in report.missing:
            print(f"  missing  {eid}: recorded but not produced on replay")
        for eid in report.extra:
            print(f"  extra    {eid}: produced on replay but not recorded")
        for change in report.changed:
            fields = ", ".join(change["fields"])
            print(f"  changed  {change['event_id']}: {fields}")
        if report.not_reached:
            print(f"  ({len(report.not_reached)} outputs from inputs the recorded run never "
                  "consumed: not compared)")
        print(f"{report.differences} differences")
    return 1 if report.differences else 0
