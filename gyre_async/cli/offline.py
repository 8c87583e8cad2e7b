"""CLI of the offline side: ``gyre warmstart``, ``gyre export``, ``gyre export-model``,
``gyre evaluate``."""

from __future__ import annotations

import json

COMMANDS = ("warmstart", "export", "export-model", "evaluate")


def add_parser(sub) -> None:
    ws = sub.add_parser(
        "warmstart", help="behaviour cloning from demonstrations -> policy version 0",
        description="Clone demonstrations (warmstart.demonstrations JSONL files, or the "
        "environment's gold paths) into the run's policy and publish it as policy-version 0 "
        "(reason warmstart) on the run's bus; a later `gyre run` with the same config and "
        "run directory starts from it.")
    ws.add_argument("config", help="TOML config (its [warmstart] section)")
    ws.add_argument("--run-dir", help="override run.run_dir")
    ws.add_argument("--bus", help="bus URL (default: the run's embedded log)")
    ws.add_argument("--demonstrations", action="append", metavar="JSONL",
                    help="demonstration file (repeatable; overrides warmstart.demonstrations)")

    ex = sub.add_parser(
        "export", help="write a run's successful trajectories as demonstrations (JSONL)",
        description="Read the run's trajectory-step events, keep complete successful "
        "trajectories, replay each in the environment to recover and verify observations, "
        "and write them in the demonstration format (gyre_async/offline/demonstrations.py).")
    ex.add_argument("config", help="the run's TOML config")
    ex.add_argument("--out", required=True, help="output JSONL file")
    ex.add_argument("--run-dir", help="override run.run_dir")
    ex.add_argument("--bus", help="bus URL (default: the run's embedded log)")
    ex.add_argument("--min-score", type=float,
                    help="also keep finished trajectories with at least this score")
    ex.add_argument("--limit", type=int, default=0, help="at most N trajectories (0: all)")

    em = sub.add_parser(
        "export-model", help="write a run's model as a Hugging Face model directory",
        description="Load a version of an hf-backend run (by default its best validated one, "
        "from <run_dir>/best.json), merge LoRA adapters into the base weights, and write a "
        "model directory that transformers and vLLM load like any model (plus "
        "value_head.safetensors and gyre_export.json saying which version and why).")
    em.add_argument("run_dir", help="the run directory (holds config.json)")
    em.add_argument("--out", required=True, help="output directory")
    em.add_argument("--version", default="best",
                    help="best (default), final, or a version number")
    em.add_argument("--bus", help="bus URL (default: the run's embedded log)")

    ev = sub.add_parser(
        "evaluate", help="ask the run's evaluator to validate a policy version now",
        description="Publish an eval-request event; the evaluator answers with an eval event.")
    ev.add_argument("config", help="the run's TOML config")
    ev.add_argument("--version", type=int, default=-1, help="policy version (-1: latest)")
    decoding = ev.add_mutually_exclusive_group()
    decoding.add_argument("--greedy", dest="greedy", action="store_true", default=None)
    decoding.add_argument("--sampled", dest="greedy", action="store_false")
    ev.add_argument("--run-dir", help="override run.run_dir")
    ev.add_argument("--bus", help="bus URL (default: the run's embedded log)")
    for command in (ws, ex, ev):
        command.set_defaults(handler=run_with_config)
    em.set_defaults(handler=run_export_model)


def run_with_config(args) -> int:
    from gyre_async.cli.common import config_of

    return run(args, config_of(args))


def run(args, cfg) -> int:
    from gyre_async.runtime.process import run_main

    if args.command == "warmstart":
        import msgspec

        from gyre_async.offline.warmstart import warmstart

        if args.demonstrations:
            cfg = msgspec.structs.replace(cfg, warmstart=msgspec.structs.replace(
                cfg.warmstart, demonstrations=list(args.demonstrations)))
        summary = run_main(lambda: warmstart(cfg, args.bus))
        print(json.dumps(summary, indent=2))
        return 0
    if args.command == "export":
        from gyre_async.offline.export import export_run

        summary = run_main(lambda: export_run(cfg, args.out, bus_override=args.bus,
                                              min_score=args.min_score, limit=args.limit))
        print(json.dumps(summary, indent=2))
        return 0 if summary["written"] or not summary["trajectories"] else 1
    if args.command == "evaluate":
        return run_main(lambda: _request(cfg, args))
    raise AssertionError(args.command)


def run_export_model(args) -> int:
    """``gyre export-model RUN_DIR --out DIR [--version best|final|N]``."""
    import asyncio

    from gyre_async.offline.export_model import choose_version, export_model

    chosen = asyncio.run(choose_version(args.run_dir, args.version, args.bus))
    print(json.dumps(export_model(args.run_dir, args.out, chosen), indent=2))
    return 0


async def _request(cfg, args) -> int:
    import time

    from gyre_async.runtime.process import open_run_bus
    from schemas import encode, event_id
    from schemas.events import EvalRequest
    from schemas.topics import ALL_TOPICS, EVAL_REQUEST

    event = EvalRequest(event_id=event_id("eval-request", cfg.run.run_id, args.version,
                                          args.greedy, time.time()),
                        run_id=cfg.run.run_id, producer="cli", key="eval",
                        policy_version=args.version, greedy=args.greedy, reason="cli")
    async with open_run_bus(cfg, args.bus) as bus:
        await bus.create_topics(ALL_TOPICS, cfg.bus.partitions)
        await bus.publish(EVAL_REQUEST, [(event.key.encode(), encode(event))])
    print(json.dumps({"requested": args.version, "event_id": event.event_id}))
    return 0
