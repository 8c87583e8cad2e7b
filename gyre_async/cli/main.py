"""``gyre``: run the loop, run one role per process, and watch or audit a run's event log."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys

from gyre_async.bus import BusUnreachable, open_bus
from gyre_async.bus.reading import read_back_limit
from gyre_async.bus.secrets import has_literal_secret, redact
from gyre_async.config import bus_url, load_config
from gyre_async.errors import ConfigError, OutOfSpace
from gyre_async.runtime.logs import configure_logging
from schemas import DecodeError, decode, to_builtins
from schemas.topics import ALL_TOPICS

EPILOG = """\
bus URLs: sqlite:///runs/x/events.db (embedded, default: <run_dir>/events.db) or
kafka://host:port[,host:port][?security_protocol=SASL_SSL&sasl_mechanism=PLAIN&...].
$GYRE_BUS sets a default bus URL for every command.
"""


def _parser() -> argparse.ArgumentParser:
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

    run = sub.add_parser("run", help="train: all roles in one process on the embedded bus",
                         description="Run the whole loop (sampler, segmenter, arbiter, "
                         "learner, evaluator, keeper) in one process, with a live progress "
                         "display. "
                         "Writes the event log, segment store, checkpoints, metrics.jsonl, "
                         "a learning-curve PNG and summary.json into the run directory.")
    run.add_argument("config", help="TOML config, e.g. ops/configs/quickstart.toml")
    run.add_argument("--run-dir", help="override run.run_dir")
    run.add_argument("--bus", help="bus URL (default: embedded log in the run directory)")
    run.add_argument("--no-progress", action="store_true", help="plain log lines, no live bar")

    actor = sub.add_parser("actor", help="run one role in this process (one process per role)",
                           description="Run a single role until SIGTERM. Start one process "
                           "per role, on one machine (embedded bus) or many (Kafka).")
    actor.add_argument("role", help="sampler, segmenter, arbiter, learner, evaluator, echo, ...")
    actor.add_argument("--config", required=True,
                       help="TOML config file, or a run's recorded RUN_DIR/config.json")
    actor.add_argument("--bus", help="bus URL (default: config bus.url or the embedded log)")
    actor.add_argument("--name", help="actor name (default: the role, or ROLE-I with "
                       "--replica I/N)")
    actor.add_argument("--replica", metavar="I/N",
                       help="this process is replica I (0-based) of N of its role, e.g. "
                       "--replica 2/4 for the third of four samplers: its seeds, ids, "
                       "policy-version group and staleness share derive from it")
    actor.add_argument("--run-dir", help="override run.run_dir")
    actor.add_argument("--metrics-port", type=int, metavar="PORT",
                       help="serve Prometheus metrics at http://HOST:PORT/metrics and "
                       "liveness at /healthz (default: off)")
    actor.add_argument("--metrics-host", metavar="HOST",
                       help="address the metrics endpoint listens on (default 127.0.0.1: "
                       "this machine only; 0.0.0.0 for a scraper elsewhere)")
    actor.add_argument("--rank", type=int, help="learner: this process's rank in a "
                       "data-parallel learner of learner.world_size (default: $RANK as "
                       "torchrun sets it, else 0); ranks > 0 follow rank 0, off the bus")

    tail = sub.add_parser("tail", help="print a topic's events as JSON lines",
                          description="Subscribe to a topic and print each event as one JSON "
                          "line: monitoring by subscription, no side channel.")
    tail.add_argument("topic", help=f"one of: {', '.join(ALL_TOPICS)}")
    tail.add_argument("--bus", help="bus URL")
    tail.add_argument("--config", help="config file (to find the run's bus)")
    tail.add_argument("--from", dest="start", default="0",
                      help="start offset (per partition) or ISO time / epoch seconds")
    tail.add_argument("--follow", "-f", action="store_true", help="keep waiting for new events")
    tail.add_argument("--max", type=int, default=0, help="stop after N events")

    rep = sub.add_parser("replay", help="audit: re-run a role on recorded inputs, diff outputs",
                         description="Re-feed a role the inputs recorded in the event log, on "
                         "a scratch bus, and compare what it emits with what it emitted in "
                         "the run. Exit status 1 when there are differences.")
    rep.add_argument("role")
    rep.add_argument("--bus", help="bus URL of the recorded run")
    rep.add_argument("--config", help="the run's config: RUN_DIR/config.json (recorded by "
                     "every run) or its TOML file")
    rep.add_argument("--name", help="actor name used in the run (default: the role)")
    rep.add_argument("--run-dir", help="the run's directory (stores), if not in the config")
    rep.add_argument("--json", action="store_true", help="print the full report as JSON")

    ins = sub.add_parser("inspect", help="one trajectory: steps, segments, rewards, versions",
                         description="Print one trajectory as the event log tells it: its "
                         "steps, milestones with their state proof, segments, reward "
                         "components, and the policy version that trained on each segment.")
    ins.add_argument("trajectory_id")
    ins.add_argument("--bus", help="bus URL of the run")
    ins.add_argument("--config", help="the run's config file (to find its bus)")
    ins.add_argument("--steps", type=int, default=50, help="show at most N steps (0: all)")
    ins.add_argument("--contexts", action="store_true",
                     help="each step's exact context too (as text when --config names the run's "
                     "config, whose tokenizer decodes it; else token ids)")

    arc = sub.add_parser("archive", help="record every topic of a run into an embedded log",
                         description="Copy every topic of a run (e.g. from Kafka) into the "
                         "embedded log format, so it can be replayed, inspected and reported "
                         "later without the cluster.")
    arc.add_argument("--bus", required=True, help="source bus URL, e.g. kafka://host:9092")
    arc.add_argument("--out", required=True, help="directory for events.db")
    arc.add_argument("--topics", help="comma-separated topics (default: all)")

    from gyre_async.cli.offline import add_parser as add_offline
    from gyre_async.cli.schema import add_parser as add_schema
    from gyre_async.runtime.launcher import add_parser as add_launch
    from gyre_async.ui.monitor import add_parser as add_monitor
    from gyre_async.ui.report import add_parser as add_report

    add_launch(sub)
    add_monitor(sub)
    add_report(sub)
    add_offline(sub)
    add_schema(sub)

    top = sub.add_parser("topics", help="topics, end offsets and lag per consumer group")
    top.add_argument("--bus", help="bus URL")
    top.add_argument("--config", help="config file (to find the run's bus)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    configure_logging(args.log_level)
    if has_literal_secret(getattr(args, "bus", None) or ""):
        print("gyre: warning: --bus holds a password, which every user of this machine can "
              "read in `ps`; write it as ${VARIABLE} in the URL (quoted, so the shell leaves "
              "it) and export the variable, or put the URL in $GYRE_BUS", file=sys.stderr)
    try:
        return _dispatch(args)
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


def _config(args):
    cfg = load_config(getattr(args, "config", None))
    if getattr(args, "run_dir", None):
        import msgspec

        cfg = msgspec.structs.replace(
            cfg, run=msgspec.structs.replace(cfg.run, run_dir=args.run_dir)
        )
    return cfg


def _replica(args, cfg):
    """``--replica I/N``: the config and actor name of replica I of N of a role.

    A sampler replica gets ``sampler.replica = I``, ``sampler.replicas = N`` (its seeds,
    and its share of the staleness budget); a learner replica is rank I of a data-parallel
    learner of ``world_size = N`` (rank 0 leads and publishes); segmenter and arbiter replicas
    split their input's partitions in the role's group (a segmenter replica writes a store of
    its own). Every replica is named ``ROLE-I`` unless ``--name`` says otherwise (its
    trajectory ids, its segment store, and a sampler's own consumer group).
    """
    if not args.replica:
        return cfg, args.name
    index, _, count = args.replica.partition("/")
    try:
        replica, replicas = int(index), int(count)
    except ValueError:
        replica = replicas = -1
    if not 0 <= replica < replicas:
        raise ConfigError(f"--replica {args.replica!r}: give I/N with 0 <= I < N, e.g. 0/4")
    import msgspec

    if args.role == "sampler":
        cfg = msgspec.structs.replace(cfg, sampler=msgspec.structs.replace(
            cfg.sampler, replica=replica, replicas=replicas))
    if args.role == "learner":  # replica I of N is rank I of a data-parallel learner
        cfg = msgspec.structs.replace(cfg, learner=msgspec.structs.replace(
            cfg.learner, world_size=replicas))
        if args.rank is None:
            args.rank = replica
    return cfg, args.name or f"{args.role}-{replica}"


def _dispatch(args) -> int:
    from gyre_async.runtime.process import run_actor, run_main

    if args.command == "actor":
        cfg, name = _replica(args, _config(args))
        if args.role == "learner":
            from gyre_async.core.learner_dp import follows_leader

            if follows_leader(cfg, args.rank):  # a data-parallel learner's rank > 0
                return 0
        run_main(lambda: run_actor(args.role, cfg, args.bus, name, args.metrics_port,
                                    args.metrics_host))
        return 0
    if args.command == "run":
        from gyre_async.runtime.loop import run_loop

        cfg = _config(args)
        summary = run_main(lambda: run_loop(cfg, bus_override=args.bus,
                                            progress=not args.no_progress))
        print(json.dumps(summary, indent=2))
        return 0
    if args.command == "tail":
        cfg = _config(args)
        return run_main(lambda: _tail(bus_url(cfg, args.bus), args))
    if args.command == "replay":
        cfg = _config(args)
        return run_main(lambda: _replay(bus_url(cfg, args.bus), cfg, args))
    if args.command == "launch":
        from gyre_async.runtime.launcher import run as launch

        return launch(args)
    if args.command == "monitor":
        from gyre_async.ui.monitor import run as run_monitor

        return run_monitor(args)
    if args.command == "report":
        from gyre_async.ui.report import run as run_report

        return run_report(args)
    if args.command == "inspect":
        cfg = _config(args)
        return run_main(lambda: _inspect(bus_url(cfg, args.bus), args, cfg))
    if args.command == "export-model":
        from gyre_async.cli.offline import run_export_model

        return run_export_model(args)
    if args.command in ("warmstart", "export", "evaluate"):
        from gyre_async.cli.offline import run as run_offline

        return run_offline(args, _config(args))
    if args.command == "schema":
        from gyre_async.cli.schema import run as run_schema

        return run_schema(args)
    if args.command == "archive":
        return run_main(lambda: _archive(args))
    if args.command == "topics":
        cfg = _config(args)
        return run_main(lambda: _topics(bus_url(cfg, args.bus)))
    raise AssertionError(args.command)


def _parse_start(start: str) -> tuple[int | None, float | None]:
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


async def _tail(url: str, args) -> int:
    """Records of one topic as JSON lines, from an offset or a time.

    Not :func:`~gyre_async.bus.reading.read_events`: the tail seeks (``--from``), and it is
    a record viewer, so a record that does not decode is printed where it lies, with the
    reason, instead of being skipped or stopping the tail. It decodes without the live
    size limit, like every read-back.
    """
    offset, timestamp = _parse_start(args.start)
    out = sys.stdout
    count = 0
    async with open_bus(url) as bus:
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


async def _replay(url: str, cfg, args) -> int:
    from gyre_async.audit.replay import replay, report_json

    async with open_bus(url, max_message_bytes=cfg.bus.max_message_bytes) as bus:
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


async def _inspect(url: str, args, cfg) -> int:
    from gyre_async.audit.inspect_trajectory import collect, render

    async with open_bus(url) as bus:
        info = await collect(bus, args.trajectory_id)
    decode = None
    if args.contexts and args.config:
        from gyre_async.compose import build_tokenizer

        tokenizer = build_tokenizer(cfg)
        decode = lambda ids: tokenizer.decode(ids, skip_special=False)  # noqa: E731
    print(render(args.trajectory_id, info, args.steps, args.contexts, decode))
    return 0 if info["steps"] or info["segments"] else 1


async def _archive(args) -> int:
    import os

    from gyre_async.audit.archive import archive

    os.makedirs(args.out, exist_ok=True)
    out = os.path.join(args.out, "events.db")
    topics = args.topics.split(",") if args.topics else None
    async with open_bus(args.bus) as bus:
        counts = await archive(bus, out, topics)
    for name, n in sorted(counts.items()):
        print(f"{name:<20} {n:>10}")
    print(f"archived {sum(counts.values())} events into {out}")
    return 0


async def _topics(url: str) -> int:
    async with open_bus(url) as bus:
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
