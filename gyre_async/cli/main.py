"""``gyre``: run the loop, run one role per process, and watch or audit a run's event log.

Each command is a module of this package with its parser and its handler side by side:
``add_parser(sub)`` registers the command (``set_defaults(handler=...)``), and :func:`main`
builds the top parser from :data:`COMMANDS` and calls the chosen command's handler.
"""

from __future__ import annotations

import argparse
import sys
from types import ModuleType

from gyre_async.bus import BusUnreachable
from gyre_async.bus.secrets import has_literal_secret, redact
from gyre_async.cli import (
    actor,
    archive,
    inspect,
    launch,
    monitor,
    offline,
    replay,
    report,
    run,
    schema,
    tail,
    topics,
)
from gyre_async.errors import ConfigError, OutOfSpace
from gyre_async.runtime.logs import configure_logging

EPILOG = """\
bus URLs: sqlite:///runs/x/events.db (embedded, default: <run_dir>/events.db) or
kafka://host:port[,host:port][?security_protocol=SASL_SSL&sasl_mechanism=PLAIN&...].
$GYRE_BUS sets a default bus URL for every command.
"""

#: the commands, in the order ``gyre --help`` lists them
COMMANDS: tuple[ModuleType, ...] = (run, actor, tail, replay, inspect, archive, launch, monitor,
                                    report, offline, schema, topics)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="gyre",
        description="Gyre: online RL for LLM agents on very long tasks, as an event-sourced "
        "actor system. Every role consumes and emits events on a bus; every run is a "
        "replayable event log.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--log-level", default="WARNING", help="structlog level (default WARNING)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    configure_logging(args.log_level)
    if has_literal_secret(getattr(args, "bus", None) or ""):
        print("gyre: warning: --bus holds a password, which every user of this machine can "
              "read in `ps`; write it as ${VARIABLE} in the URL (quoted, so the shell leaves "
              "it) and export the variable, or put the URL in $GYRE_BUS", file=sys.stderr)
    try:
        return args.handler(args)
    except ConfigError as exc:
        print(f"gyre: config error: {redact(str(exc))}", file=sys.stderr)
        return 2
    except OutOfSpace as exc:  # a full disk: what and how to fix, not a traceback
        print(f"gyre: out of space: {exc}", file=sys.stderr)
        return 1
    except BusUnreachable as exc:  # no broker there: what and how to fix, not a traceback
        print(f"gyre: bus unreachable: {one_line(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def one_line(exc: BaseException) -> str:
    """An error's message on one line, secrets redacted (it may quote a bus URL)."""
    return " ".join(redact(str(exc)).split())


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
