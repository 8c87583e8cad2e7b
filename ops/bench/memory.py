"""Memory on one very long trajectory: does any role's RSS grow with the trajectory's length?

One sampler slot plays one workshop episode that cannot end early (1,000 orders: a random
or learning policy finishes none of them) until its cap, chosen so that the trajectory's
context tokens (summed over its steps) reach ``--tokens`` (default 1,000,000): contexts of
``--context-tokens`` with ``--history-turns`` recent turns, so nearly every step fills its
context. The four core roles run as separate OS processes under ``gyre launch`` on the
embedded bus (sampler, segmenter, arbiter, learner), so each process's memory is its role's.

Every ``--poll`` seconds the bench reads each role's ``/proc/<pid>/status``: ``VmHWM`` (peak
resident set so far) and ``VmRSS`` (now). Readings are kept when the learner, the most
downstream role, has consumed (trained on or dropped) 10% and 50% of the trajectory's
steps, so every role is past its warm-up (the learner's first update included) and has
seen at least that share; the 100% reading waits until the whole trajectory is published
and the segmenter, arbiter and learner have seen all of it (the learner's last, partial
batch stays buffered, never trained: see :func:`progress`). ``max_growth`` is the largest
``peak@100% / peak@10% - 1`` over the roles (the issue's definition); the growth of the
current RSS is reported too (``rss_now_mb``, ``max_growth_now``). The trajectory's context
tokens are counted from the log at the end (``tokens``).

Last line: {"bench": "memory", "tokens": n, "rss_mb": {role: [at10, at50, at100]},
"max_growth": x, ...}; target max_growth <= 0.10.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import signal
import subprocess
import sys
import tempfile
import time

from _common import ROOT, make_config, memory_kb, print_result, write_config

from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_events
from gyre_async.runtime.launcher import read_status
from schemas.config import Config
from schemas.events import Heartbeat, PolicyVersion, TrajectoryStep
from schemas.topics import POLICY_VERSION, SCORED, SEGMENT_CLOSED, TELEMETRY, TRAJECTORY_STEP

ROLES = ("sampler", "segmenter", "arbiter", "learner")
#: what each downstream role consumes (its lag on these is 0 once it has seen everything)
INPUTS = {"segmenter": [TRAJECTORY_STEP], "arbiter": [SEGMENT_CLOSED], "learner": [SCORED]}
MARKS = (0.1, 0.5, 1.0)
RUN_ID = "memory"


def memory_config(run_dir: str, steps: int, args) -> Config:
    """The run: the quickstart's policy, one slot, one episode of ``steps`` steps."""
    return make_config(
        run={"run_id": RUN_ID, "run_dir": run_dir, "seed": 0, "mode": "async"},
        loop={"max_staleness": 2},
        task={"env": "workshop", "env_config": {"n_orders": 1000, "max_steps": steps}},
        policy={"d_model": 64, "n_layers": 2, "n_heads": 4,
                "context_tokens": args.context_tokens, "history_turns": args.history_turns},
        sampler={"num_envs": 1, "group_size": 1, "max_episodes": 1},
        segmenter={"max_segment_steps": args.segment_steps},
        learner={"batch_steps": args.batch_steps, "minibatch_steps": args.minibatch_steps,
                 "epochs": 1, "max_versions": 0},
    )


async def progress(bus, learner_seen: dict[str, int]) -> tuple[int, dict[str, int]]:
    """(trajectory steps published, how much of its input each downstream role has yet to
    see). The segmenter and arbiter: their lag. The learner commits a segment only once it
    is trained, so the steps of its last, partial batch stay uncommitted for good: its
    unseen count is ``scored`` records minus the ``processed`` of its latest heartbeat."""
    infos = {t.name: t for t in await bus.topics()}
    published = sum(infos[TRAJECTORY_STEP].end_offsets.values()) \
        if TRAJECTORY_STEP in infos else 0
    scored = sum(infos[SCORED].end_offsets.values()) if SCORED in infos else 0
    unseen = {role: await bus.lag(f"{RUN_ID}.{role}", topics)
              for role, topics in INPUTS.items() if role != "learner"}
    unseen["learner"] = max(0, scored - learner_seen.get("processed", 0))
    return published, unseen


async def follow_learner(bus, learner_seen: dict[str, int]) -> None:
    """Keep ``learner_seen`` at the learner's latest heartbeat (``processed``: records it has
    handled) and version (``consumed``: steps trained on or dropped), until cancelled."""
    async for _record, event in read_events(bus, [TELEMETRY, POLICY_VERSION], follow=True):
        match event:
            case Heartbeat(role="learner"):
                learner_seen["processed"] = event.processed
            case PolicyVersion():
                learner_seen["consumed"] = max(learner_seen.get("consumed", 0),
                                               event.consumed_steps)


async def context_tokens(bus) -> tuple[int, int, int]:
    """(steps, context tokens summed over them, longest context) of the logged trajectory."""
    steps = tokens = longest = 0
    async for _record, event in read_events(bus, [TRAJECTORY_STEP], on_bad="raise"):
        if isinstance(event, TrajectoryStep):
            steps += 1
            tokens += len(event.context_tokens)
            longest = max(longest, len(event.context_tokens))
    return steps, tokens, longest


async def watch(args, run_dir: str, steps: int, launcher: subprocess.Popen, status_file: str):
    """Poll memory and progress until the 100% reading; the readings per mark."""
    readings: dict[float, dict[str, tuple[int, int]]] = {}
    lags_at: dict[float, dict[str, int]] = {}
    peak = dict.fromkeys(ROLES, 0)
    last = dict.fromkeys(ROLES, 0)
    pids: dict[str, int] = {}
    started = time.monotonic()
    learner_seen: dict[str, int] = {}
    async with open_bus(f"sqlite:///{run_dir}/events.db") as bus:
        follower: asyncio.Task | None = None
        while len(readings) < len(MARKS):
            await asyncio.sleep(args.poll)
            if launcher.poll() is not None:
                raise RuntimeError(f"gyre launch exited early ({launcher.returncode})")
            if time.monotonic() - started > args.max_wall:
                raise TimeoutError(f"not done after {args.max_wall:.0f} s: {readings}")
            roles = read_status(status_file).get("roles", {})
            for role in ROLES:
                pid = roles.get(role, {}).get("pid")
                if pid and pids.setdefault(role, pid) != pid:
                    raise RuntimeError(f"{role} restarted: its memory is not one process's")
            now = {role: memory_kb(pid) for role, pid in pids.items()}
            for role, (hwm, rss) in now.items():
                peak[role] = max(peak[role], hwm)
                if rss:  # the sampler exits once its one episode is out: keep its last
                    last[role] = rss
            if follower is None and TELEMETRY in {t.name for t in await bus.topics()}:
                follower = asyncio.create_task(follow_learner(bus, learner_seen))
            published, lags = await progress(bus, learner_seen)
            for mark in MARKS:
                if mark in readings:
                    continue
                if mark < 1.0 and learner_seen.get("consumed", 0) < mark * steps:
                    continue  # the most downstream role has consumed this share: all have
                if mark == 1.0 and (published < steps or any(lags.values())
                                    or len(pids) < len(ROLES)):
                    continue  # the last reading: every role has seen the whole trajectory
                readings[mark] = {role: (peak[role], last[role]) for role in ROLES}
                lags_at[mark] = {**lags, "published": published,
                                 "learner_consumed": learner_seen.get("consumed", 0)}
                print(f"[{time.monotonic() - started:5.0f} s] {mark:.0%} of {steps} steps "
                      f"(learner consumed {learner_seen.get('consumed', 0)}): "
                      + ", ".join(f"{r} peak {readings[mark][r][0] / 1024:.0f} MB now "
                                  f"{readings[mark][r][1] / 1024:.0f} MB" for r in ROLES)
                      + f"; unseen {lags}", file=sys.stderr, flush=True)
        if follower is not None:
            follower.cancel()
            await asyncio.gather(follower, return_exceptions=True)
        totals = await context_tokens(bus)
    return readings, lags_at, totals, time.monotonic() - started


def stop(launcher: subprocess.Popen) -> None:
    if launcher.poll() is None:
        launcher.send_signal(signal.SIGTERM)
        try:
            launcher.wait(timeout=60)
        except subprocess.TimeoutExpired:
            launcher.kill()
            launcher.wait()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1_000_000,
                   help="context tokens the trajectory must hold, summed over its steps")
    p.add_argument("--context-tokens", type=int, default=256)
    p.add_argument("--history-turns", type=int, default=6)
    p.add_argument("--segment-steps", type=int, default=32)
    p.add_argument("--batch-steps", type=int, default=256)
    p.add_argument("--minibatch-steps", type=int, default=64)
    p.add_argument("--fill", type=float, default=0.9,
                   help="expected share of each context that is filled (sizes the episode)")
    p.add_argument("--poll", type=float, default=0.5, help="seconds between readings")
    p.add_argument("--max-wall", type=float, default=3600.0)
    p.add_argument("--out", default="", help="run directory (default: a temporary one)")
    args = p.parse_args(argv)
    steps = math.ceil(args.tokens / (args.fill * args.context_tokens))
    run_dir = os.path.abspath(args.out or tempfile.mkdtemp(prefix="gyre-memory-"))
    os.makedirs(run_dir, exist_ok=True)
    config = write_config(memory_config(run_dir, steps, args), os.path.join(run_dir, "memory.toml"))
    status_file = os.path.join(run_dir, "launch-status.json")
    log = open(os.path.join(run_dir, "launch.log"), "w")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    launcher = subprocess.Popen(
        [sys.executable, "-m", "gyre_async.cli", "launch", config, "--roles", ",".join(ROLES),
         "--status-file", status_file, "--max-restarts", "0"],
        cwd=str(ROOT), env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        readings, lags_at, (logged_steps, tokens, longest), wall = asyncio.run(
            watch(args, run_dir, steps, launcher, status_file))
    finally:
        stop(launcher)
        log.close()
    peak_mb = {r: [round(readings[m][r][0] / 1024, 1) for m in MARKS] for r in ROLES}
    now_mb = {r: [round(readings[m][r][1] / 1024, 1) for m in MARKS] for r in ROLES}

    def growth(series: dict[str, list[float]]) -> dict[str, float]:
        return {r: round(v[-1] / v[0] - 1, 4) if v[0] else math.inf for r, v in series.items()}

    print_result({
        "bench": "memory", "tokens": tokens, "steps": logged_steps,
        "context_tokens_max": longest, "rss_mb": peak_mb,
        "max_growth": max(growth(peak_mb).values()), "growth": growth(peak_mb),
        "rss_now_mb": now_mb, "max_growth_now": max(growth(now_mb).values()),
        "lags_at_marks": {f"{m:.0%}": lags_at[m] for m in MARKS},
        "wall_s": round(wall, 1), "run_dir": run_dir,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
