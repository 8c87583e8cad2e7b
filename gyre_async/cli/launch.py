"""``gyre launch CONFIG``: one process per role, crashed roles restarted
(:mod:`gyre_async.runtime.launcher` supervises)."""

from __future__ import annotations

import argparse

from gyre_async.runtime.launcher import REPLICABLE
from gyre_async.runtime.topology import CORE_ROLES


def add_parser(sub) -> None:
    p = sub.add_parser(
        "launch", help="run one process per role and restart crashed roles",
        description="Start one OS process per role (gyre actor ROLE ...), restart a role "
        "whose process exits abnormally (exponential backoff capped at 10 s), forward "
        "SIGTERM/SIGINT to the roles and wait for them. Exit status 1 when a role exceeds "
        "--max-restarts.")
    p.add_argument("config", help="TOML config file passed to every role")
    p.add_argument("--bus", help="bus URL for every role (default: config bus.url or the "
                   "embedded log); kafka:// to spread roles over machines")
    p.add_argument("--roles", default=",".join(CORE_ROLES),
                   help=f"comma-separated roles (default: {','.join(CORE_ROLES)})")
    p.add_argument("--replicas", default="", metavar="ROLE=N[,ROLE=N]",
                   help="run N processes of a role, named ROLE-0..ROLE-(N-1), e.g. "
                   f"sampler=4 (roles: {', '.join(REPLICABLE)}; default 1 each)")
    p.add_argument("--metrics-port-base", type=int, default=0, metavar="N",
                   help="give process i (in --roles order, replicas in turn) --metrics-port "
                   "N+i (default: none)")
    p.add_argument("--metrics-host", metavar="HOST",
                   help="address the roles' metrics endpoints listen on (default 127.0.0.1: "
                   "this machine only)")
    p.add_argument("--max-restarts", type=int, default=10, metavar="N",
                   help="give up (exit 1) when a role needs more than N restarts in total "
                   "(default 10; negative: never give up)")
    p.add_argument("--stop-timeout", type=float, default=30.0, metavar="S",
                   help="seconds to wait after SIGTERM before SIGKILL (default 30)")
    p.add_argument("--status-file", help="JSON file kept up to date: role -> pid, restarts")
    p.add_argument("--run-dir", help="override run.run_dir in every role")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from gyre_async.runtime.launcher import run as launch

    return launch(args)
