"""Create Gyre's topics on a Kafka cluster with production settings, before the first run.

Why provision instead of letting actors create topics: every actor creates the topics it
uses on start, but with broker defaults (``cleanup.policy=delete``, ``retention.ms`` of
usually 7 days). For a run that lasts longer than the retention that is a trap: the last
``policy-version`` record gets deleted, and a sampler or learner restarted after that finds
no policy in force. This script sets, per topic:

- ``trajectory-step``: the high-volume topic (one event per environment step); short
  retention (``--steps-retention-hours``, default 72 h): the segmenter turns steps into
  Zarr segments within seconds, so the steps are only needed for replays and audits;
- ``policy-version``: one partition, ``cleanup.policy=compact`` (every event has the
  single key ``policy``), so the policy in force is kept for as long as the run lives;
  ``min.compaction.lag.ms`` (``--policy-history-days``, default 7) keeps every version
  event that long for learning curves and ``gyre replay``. ``--keep-policy-history``
  keeps them all instead (``delete`` with infinite retention: small events);
- ``segment-closed``, ``scored``, ``eval``, ``dead-letter``: ``--retention-days``
  (default 30): small events that explain what the learner trained on and what was refused;
- ``telemetry`` (heartbeats, segment-dropped): 14 days; ``probe-in/out``: 1 day;
- ``max.message.bytes`` from ``bus.max_message_bytes`` (+64 KiB framing), as the producer
  sizes its requests.

aiokafka's ``create_topics`` does not raise on a refused topic: it returns one error code
per topic, so each is checked here. Existing topics (TOPIC_ALREADY_EXISTS) are left as
they are; their partitions and settings are compared with the plan and differences are
printed (change them with ``kafka-configs.sh --alter``: the non-incremental AlterConfigs
call aiokafka offers would reset every other setting of the topic).

Exit status: 0 when every topic exists as planned or already existed, 1 when the broker
refused a topic, 2 on usage errors. ``--plan`` prints the plan as JSON without connecting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from urllib.parse import urlparse

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gyre_async.bus.secrets import expand_query, redact
from schemas.topics import (
    ALL_TOPICS,
    DEAD_LETTER,
    EVAL,
    POLICY_VERSION,
    PROBE_IN,
    PROBE_OUT,
    SCORED,
    SEGMENT_CLOSED,
    TELEMETRY,
    TRAJECTORY_STEP,
)

HOUR_MS = 3_600_000
DAY_MS = 24 * HOUR_MS
TOPIC_ALREADY_EXISTS = 36
#: Query parameters of a kafka:// URL that configure KafkaBus, not the connection.
_BUS_OPTIONS = {"client_id", "enable_idempotence", "max_message_bytes", "replication_factor",
                "isolation_level", "join_timeout", "default_partitions"}


def plan_topics(args) -> list[dict]:
    """One entry per topic: name, partitions, replication factor, configs (strings)."""
    max_bytes = max(args.max_message_bytes + 64 * 1024, 1_048_588)
    keep_days = {SEGMENT_CLOSED: args.retention_days, SCORED: args.retention_days,
                 EVAL: args.retention_days, DEAD_LETTER: args.retention_days,
                 TELEMETRY: 14, PROBE_IN: 1, PROBE_OUT: 1}
    plan = []
    for name in ALL_TOPICS:
        configs = {"max.message.bytes": str(max_bytes)}
        partitions = args.partitions
        if name == TRAJECTORY_STEP:
            configs["retention.ms"] = str(int(args.steps_retention_hours * HOUR_MS))
        elif name == POLICY_VERSION:
            partitions = 1  # one key: one partition holds the whole history, in order
            if args.keep_policy_history:
                configs.update({"cleanup.policy": "delete", "retention.ms": "-1"})
            else:
                configs.update({"cleanup.policy": "compact",
                                "min.compaction.lag.ms": str(int(args.policy_history_days
                                                                 * DAY_MS))})
        else:
            configs["retention.ms"] = str(int(keep_days.get(name, args.retention_days) * DAY_MS))
        plan.append({"name": name, "partitions": partitions,
                     "replication_factor": args.replication_factor, "configs": configs})
    return plan


def parse_bus(url: str) -> tuple[str, dict[str, str], dict[str, str]]:
    """``kafka://h1:9092,h2:9092?...`` -> (bootstrap, security options, bus options)."""
    parsed = urlparse(url)
    if parsed.scheme != "kafka" or not parsed.netloc:
        raise SystemExit(f"--bus {redact(url)!r}: give kafka://host:port[,host:port]"
                         "[?security...]")
    params = expand_query(parsed.query)  # ${NAME} references: the environment's secrets
    bus_opts = {k: v for k, v in params.items() if k in _BUS_OPTIONS}
    security = {k: v for k, v in params.items() if k not in _BUS_OPTIONS}
    return parsed.netloc, security, bus_opts


def _config_values(responses) -> dict[str, dict[str, str]]:
    """DescribeConfigs responses (v0 or v1) -> topic -> {name: value}."""
    out: dict[str, dict[str, str]] = {}
    for response in responses:
        for error_code, _msg, _type, name, entries in response.resources:
            if error_code == 0:
                out[name] = {e[0]: e[1] for e in entries}
    return out


async def provision(plan: list[dict], bootstrap: str, security: dict[str, str], *,
                    dry_run: bool, timeout_ms: int) -> int:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
    from aiokafka.errors import for_code

    from gyre_async.bus.kafka import client_config

    admin = AIOKafkaAdminClient(**client_config(bootstrap, "gyre-provision", security))
    await admin.start()
    failed = 0
    try:
        new = [NewTopic(t["name"], t["partitions"], t["replication_factor"],
                        topic_configs=t["configs"]) for t in plan]
        response = await admin.create_topics(new, timeout_ms=timeout_ms, validate_only=dry_run)
        existing = []
        for entry in response.topic_errors:  # one (topic, code[, message]) per topic
            topic, code = entry[0], entry[1]
            message = entry[2] if len(entry) > 2 and entry[2] else ""
            if code == 0:
                print(f"{'valid' if dry_run else 'created':8} {topic}")
            elif code == TOPIC_ALREADY_EXISTS:
                existing.append(topic)
            else:
                failed += 1
                print(f"FAILED   {topic}: error {code} {for_code(code).__name__}"
                      + (f": {message}" if message else ""), file=sys.stderr)
        if existing:
            await _compare_existing(admin, [t for t in plan if t["name"] in existing],
                                    ConfigResource, ConfigResourceType)
    finally:
        await admin.close()
    return 1 if failed else 0


async def _compare_existing(admin, topics: list[dict], ConfigResource, ConfigResourceType):
    """Print how existing topics differ from the plan (nothing is changed)."""
    meta = {t["topic"]: len(t["partitions"]) for t in
            await admin.describe_topics([t["name"] for t in topics])}
    try:
        values = _config_values(await admin.describe_configs(
            [ConfigResource(ConfigResourceType.TOPIC, t["name"]) for t in topics]))
    except Exception as exc:  # noqa: BLE001 - some brokers lack DescribeConfigs
        print(f"(could not read topic configs: {type(exc).__name__}: {exc})", file=sys.stderr)
        values = {}
    for t in topics:
        name = t["name"]
        diffs = []
        if meta.get(name) not in (None, t["partitions"]):
            diffs.append(f"partitions {meta[name]} (planned {t['partitions']})")
        for key, want in t["configs"].items():
            have = values.get(name, {}).get(key)
            if name in values and have != want:
                diffs.append(f"{key}={have} (planned {want})")
        print(f"exists   {name}" + (": " + "; ".join(diffs) if diffs else ""))
        have = values.get(name)
        if (name == POLICY_VERSION and have is not None
                and "compact" not in have.get("cleanup.policy", "delete")
                and have.get("retention.ms") != "-1"):
            print(f"WARNING  {name} is not compacted: the policy in force is deleted after "
                  "retention.ms; fix: kafka-configs.sh --alter --entity-type topics "
                  f"--entity-name {name} --add-config cleanup.policy=compact", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="provision_topics.py",
        description="Create Gyre's Kafka topics with partitions, retention and compaction "
        "chosen for long runs (see the module docstring for why each setting). Run once "
        "before the first actor starts; existing topics are reported, never changed.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example: python ops/provision_topics.py --bus kafka://k1:9092,k2:9092 "
        "--config /etc/gyre/run.toml --replication-factor 3")
    p.add_argument("--bus", help="kafka://host:port[,host:port][?security_protocol=...] "
                   "(default: $GYRE_BUS or bus.url of --config)")
    p.add_argument("--config", help="run config: partitions and max_message_bytes from [bus]")
    p.add_argument("--partitions", type=int, help="partitions per topic (default: "
                   "bus.partitions of --config, else 4); policy-version always gets 1")
    p.add_argument("--replication-factor", type=int,
                   help="replicas per partition (default: the URL's replication_factor, else 1; "
                   "use 3 on a production cluster)")
    p.add_argument("--steps-retention-hours", type=float, default=72.0,
                   help="retention of trajectory-step (default 72)")
    p.add_argument("--retention-days", type=float, default=30.0,
                   help="retention of segment-closed, scored, eval, dead-letter (default 30)")
    p.add_argument("--policy-history-days", type=float, default=7.0,
                   help="policy-version events younger than this are never compacted "
                   "(default 7)")
    p.add_argument("--keep-policy-history", action="store_true",
                   help="never compact or delete policy-version (infinite retention)")
    p.add_argument("--dry-run", action="store_true",
                   help="ask the broker to validate the plan without creating anything "
                   "(CreateTopics validate_only: Apache Kafka and noida-db honour it, Tansu "
                   "ignores it and creates the topics)")
    p.add_argument("--plan", action="store_true", help="print the plan as JSON; no broker")
    p.add_argument("--timeout-ms", type=int, default=30_000, help="CreateTopics timeout")
    args = p.parse_args(argv)

    import os

    from gyre_async.config import load_config
    from gyre_async.errors import ConfigError

    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(f"provision_topics: {exc}", file=sys.stderr)
        return 2
    url = args.bus or os.environ.get("GYRE_BUS") or cfg.bus.url
    bootstrap, security, bus_opts = parse_bus(url) if url else ("", {}, {})
    args.partitions = args.partitions or cfg.bus.partitions
    args.replication_factor = args.replication_factor or int(bus_opts.get("replication_factor", 1))
    args.max_message_bytes = int(bus_opts.get("max_message_bytes", cfg.bus.max_message_bytes))
    if args.partitions < 1 or args.replication_factor < 1:
        print("provision_topics: --partitions and --replication-factor must be >= 1",
              file=sys.stderr)
        return 2
    plan = plan_topics(args)
    if args.plan:
        print(json.dumps(plan, indent=1))
        return 0
    if not url:
        print("provision_topics: give --bus kafka://... (or $GYRE_BUS, or bus.url in --config)",
              file=sys.stderr)
        return 2
    return asyncio.run(provision(plan, bootstrap, security, dry_run=args.dry_run,
                                 timeout_ms=args.timeout_ms))


if __name__ == "__main__":
    sys.exit(main())
