"""``gyre run CONFIG``: the whole loop in one process on the embedded bus.

The command composes the three parts: the runtime runs the loop and returns the run folded
(:func:`~gyre_async.runtime.loop.run_loop`), the progress display draws the fold as it grows
(:class:`~gyre_async.ui.progress.Progress`), and the run's files are written from the result
(:func:`~gyre_async.ui.run_outputs.write_run_outputs`).
"""

from __future__ import annotations

import argparse
import json


def add_parser(sub) -> None:
    p = sub.add_parser("run", help="train: all roles in one process on the embedded bus",
                       description="Run the whole loop (sampler, segmenter, arbiter, "
                       "learner, evaluator, keeper) in one process, with a live progress "
                       "display. "
                       "Writes the event log, segment store, checkpoints, metrics.jsonl, "
                       "a learning-curve PNG and summary.json into the run directory.")
    p.add_argument("config", help="TOML config, e.g. ops/configs/quickstart.toml")
    p.add_argument("--run-dir", help="override run.run_dir")
    p.add_argument("--bus", help="bus URL (default: embedded log in the run directory)")
    p.add_argument("--no-progress", action="store_true", help="plain log lines, no live bar")
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from gyre_async.cli.common import config_of
    from gyre_async.runtime.loop import run_loop
    from gyre_async.runtime.process import run_main
    from gyre_async.ui.progress import Progress
    from gyre_async.ui.run_outputs import write_run_outputs

    cfg = config_of(args)
    progress = None if args.no_progress else Progress(cfg.run.run_id)
    if progress is not None:
        progress.start()
    try:
        result = run_main(lambda: run_loop(cfg, bus_override=args.bus,
                                           watch=progress.show if progress else None))
    finally:
        if progress is not None:
            progress.stop()
    summary = write_run_outputs(cfg, result)
    print(json.dumps(summary, indent=2))
    return 0
