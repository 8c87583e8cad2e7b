"""``gyre actor ROLE``: one role in this process (one process per role)."""

from __future__ import annotations

import argparse

from gyre_async.errors import ConfigError
from schemas.config import Config


def add_parser(sub) -> None:
    p = sub.add_parser("actor", help="run one role in this process (one process per role)",
                       description="Run a single role until SIGTERM. Start one process "
                       "per role, on one machine (embedded bus) or many (Kafka).")
    p.add_argument("role", help="sampler, segmenter, arbiter, learner, evaluator, echo, ...")
    p.add_argument("--config", required=True,
                   help="TOML config file, or a run's recorded RUN_DIR/config.json")
    p.add_argument("--bus", help="bus URL (default: config bus.url or the embedded log)")
    p.add_argument("--name", help="actor name (default: the role, or ROLE-I with "
                   "--replica I/N)")
    p.add_argument("--replica", metavar="I/N",
                   help="this process is replica I (0-based) of N of its role, e.g. "
                   "--replica 2/4 for the third of four samplers: its seeds, ids, "
                   "policy-version group and staleness share derive from it")
    p.add_argument("--run-dir", help="override run.run_dir")
    p.add_argument("--metrics-port", type=int, metavar="PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics and "
                   "liveness at /healthz (default: off)")
    p.add_argument("--metrics-host", metavar="HOST",
                   help="address the metrics endpoint listens on (default 127.0.0.1: "
                   "this machine only; 0.0.0.0 for a scraper elsewhere)")
    p.add_argument("--rank", type=int, help="learner: this process's rank in a "
                   "data-parallel learner of learner.world_size (default: $RANK as "
                   "torchrun sets it, else 0); ranks > 0 follow rank 0, off the bus")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from gyre_async.cli.common import config_of
    from gyre_async.runtime.process import run_actor, run_main

    cfg, name = replica_config(args, config_of(args))
    if args.role == "learner":
        from gyre_async.core.learner_dp import follows_leader

        if follows_leader(cfg, args.rank):  # a data-parallel learner's rank > 0
            return 0
    run_main(lambda: run_actor(args.role, cfg, args.bus, name, args.metrics_port,
                               args.metrics_host))
    return 0


def replica_config(args: argparse.Namespace, cfg: Config) -> tuple[Config, str | None]:
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
