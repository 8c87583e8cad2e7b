"""``gyre export``: good online trajectories back into the demonstration format.

Reads a run's ``trajectory-step`` topic, keeps complete trajectories (every step from 0,
ending ``done``) that succeeded (or reached ``--min-score``), and replays each one's actions
in the environment named by the run's config to recover the observations (steps carry
tokens, not text) and to check, against environment state, that the replay reaches the
recorded outcome again. Only verified episodes are written (a mismatch means the
environment is not deterministic for that seed, and is counted). The output is the same
JSONL format as gold demonstrations (:mod:`gyre_async.offline.demonstrations`), with
``source = "export:<run_id>"``, so it can feed ``gyre warmstart`` directly.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from gyre_async.bus.reading import read_events
from gyre_async.envs import make_env
from gyre_async.envs.text_games import TextGameEnv
from gyre_async.offline.demonstrations import Demonstration, replay, write_demonstrations
from gyre_async.runtime.process import open_run_bus
from schemas.config import Config
from schemas.events import TrajectoryStep
from schemas.topics import TRAJECTORY_STEP


async def successful_trajectories(cfg: Config, bus_override: str | None = None,
                                  min_score: float | None = None
                                  ) -> list[list[TrajectoryStep]]:
    """Complete trajectories of the run that succeeded (or scored at least ``min_score``)."""
    steps: dict[str, dict[int, TrajectoryStep]] = defaultdict(dict)
    async with open_run_bus(cfg, bus_override) as bus:
        async for _record, event in read_events(bus, [TRAJECTORY_STEP], on_bad="skip"):
            if isinstance(event, TrajectoryStep):
                steps[event.trajectory_id][event.step_index] = event
    good = []
    for by_index in steps.values():
        ordered = [by_index[i] for i in range(len(by_index)) if i in by_index]
        if len(ordered) != len(by_index) or not ordered or not ordered[-1].done:
            continue
        last = ordered[-1]
        if last.success or (min_score is not None and last.score >= min_score):
            good.append(ordered)
    good.sort(key=lambda t: (t[0].ts, t[0].trajectory_id))
    return good


def _seed_of(task_id: str) -> int:
    tail = task_id.rsplit(":", 1)[-1]
    if not tail.lstrip("-").isdigit():
        raise ValueError(f"task id {task_id!r} does not end in a seed (expected '<env>:<seed>')")
    return int(tail)


async def export_run(cfg: Config, out: str, *, bus_override: str | None = None,
                     min_score: float | None = None, limit: int = 0) -> dict[str, Any]:
    """Write the run's good trajectories to ``out`` (JSONL); returns counts."""
    import asyncio

    trajectories = await successful_trajectories(cfg, bus_override, min_score)
    if limit:
        trajectories = trajectories[:limit]
    env_config = dict(cfg.task.env_config)

    def verify_all() -> tuple[list[Demonstration], int]:
        env = make_env(cfg.task.env, **env_config)
        if not isinstance(env, TextGameEnv):
            raise ValueError(f"export needs a replayable text game, not {cfg.task.env!r}")
        kept, mismatched = [], 0
        try:
            for steps in trajectories:
                task_id = steps[0].task_id
                demo = replay(env, [s.action_text for s in steps], task_id, _seed_of(task_id),
                              env_name=cfg.task.env, env_config=env_config,
                              source=f"export:{cfg.run.run_id}")
                last = steps[-1]
                if (len(demo.steps) == len(steps) and demo.success == last.success
                        and abs(demo.score - last.score) < 1e-6):
                    kept.append(demo)
                else:
                    mismatched += 1
        finally:
            env._release()
        return kept, mismatched

    kept, mismatched = await asyncio.to_thread(verify_all)
    written = write_demonstrations(out, kept)
    return {"trajectories": len(trajectories), "written": written,
            "replay_mismatches": mismatched, "out": out,
            "steps": sum(len(d.steps) for d in kept)}
