"""``gyre inspect TRAJECTORY_ID``: one trajectory as the event log tells it."""

from __future__ import annotations

import argparse

from gyre_async.bus import open_bus


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="one trajectory: steps, segments, rewards, versions",
                       description="Print one trajectory as the event log tells it: its "
                       "steps, milestones with their state proof, segments, reward "
                       "components, and the policy version that trained on each segment.")
    p.add_argument("trajectory_id")
    p.add_argument("--bus", help="bus URL of the run")
    p.add_argument("--config", help="the run's config file (to find its bus)")
    p.add_argument("--steps", type=int, default=50, help="show at most N steps (0: all)")
    p.add_argument("--contexts", action="store_true",
                   help="each step's exact context too (as text when --config names the run's "
                   "config, whose tokenizer decodes it; else token ids)")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from gyre_async.cli.common import config_of
    from gyre_async.config import bus_url
    from gyre_async.runtime.process import run_main

    cfg = config_of(args)
    return run_main(lambda: inspect(bus_url(cfg, args.bus), args, cfg))


async def inspect(url: str, args, cfg) -> int:
    from gyre_async.audit.inspect_trajectory import collect, render

    async with open_bus(url, reader=True) as bus:
        info = await collect(bus, args.trajectory_id)
    decode = None
    if args.contexts and args.config:
        from gyre_async.compose import build_tokenizer

        tokenizer = build_tokenizer(cfg)
        decode = lambda ids: tokenizer.decode(ids, skip_special=False)  # noqa: E731
    print(render(args.trajectory_id, info, args.steps, args.contexts, decode))
    return 0 if info["steps"] or info["segments"] else 1
