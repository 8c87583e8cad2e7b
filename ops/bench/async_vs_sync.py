"""Async vs sync against the overlap bound: how close Gyre's loop comes to perfect overlap.

sync  = strict sample-then-train: every version samples one episode per environment slot,
        waits for the slowest one, then the learner trains while sampling stands still;
async = Gyre's loop: sampling, scoring and learning overlap, bounded by max_staleness.

Both modes run the quickstart policy and learner on the workshop task for the same wall
time, in each of three settings (``--settings``):

- ``latency_bound``: 0.3 s mean log-normal tool latency (sigma 1) per step;
- ``compute_bound``: 0.01 s mean tool latency: the policy's forward passes and the learner
  share the CPU;
- ``long_tail``: 0.2 s mean latency and heavy-tailed episode lengths, as in the async RL
  papers (a few very long rollouts hold a synchronous batch back): each episode's step cap
  is drawn from its seed, ``min(128, ceil(6 * Pareto(alpha=1.1)))`` (median 11 steps, one
  episode of 32 usually at the 128 cap), environment ``workshop-longtail`` registered here.

Latency- and compute-bound episodes use 4 orders and a 64-step cap (the untrained policy
runs every episode to the cap), so that a sync round takes seconds, not minutes, and a
short run holds several rounds. The async learner's batch is set to the steps of a sync
round (2,048; 714 expected with the long tail), so both modes make updates of one size and
the learner's cost per update means the same in both.

What is measured, from the sync run's own event log (same run, no second pass):
per update ``v`` (rounds 1.. when there are more than two: round 0 also pays the initial
validation), with ``t0`` = publication of version ``v``, ``t1`` = the last step sampled
with ``v``, ``t2`` = publication of ``v + 1``:

- ``T_sample`` = ``t1 - t0``: wall time of the sampling phase (the slowest slot's episode);
- ``T_learn``  = ``t2 - t1``: wall time of the learning phase (segmenting, scoring, the PPO
  update, checkpoint, publication: everything the sampler waits for);
- ``T_learner_busy``: the learner's own busy seconds (:mod:`gyre_async.timing`) per update;
  the rest of ``T_learn`` is segmenting, scoring and the hand-offs between roles;
- ``T_sample_busy``: the mean over slots of (its episode's last step - ``t0``): the time a
  slot actually works. It equals ``T_sample`` when episodes are equally long; with a long
  tail most slots idle while the slowest finishes.

Sync's period per update is ``T_sample + T_learn``. Perfect overlap (sampler and learner
each always busy, no slot waiting for a straggler) would give a period of
``max(T_sample_busy, T_learn)``, so ``bound = (T_sample + T_learn) / max(T_sample_busy,
T_learn)``; ``bound_phases = (T_sample + T_learn) / max(T_sample, T_learn)`` is the same
with the straggler wait kept (the two agree when there is no tail). ``achieved`` = async
env steps/s / sync env steps/s (each over its sampling span); ``achieved_rounds`` = async
env steps/s over sync's rate in the *same rounds the bound is measured on* (their steps
over their ``T_sample + T_learn``), and ``achieved_over_bound`` = achieved_rounds / bound,
which is async's steps/s over the ideal ``steps_per_update / max(T_sample_busy, T_learn)``.
The span-based ratio (``achieved_span_over_bound``) mixes in what the rounds leave out:
round 0 (it also pays the initial validation) and a round cut by the end of the run, so
with 2-3 rounds it moved by ~0.1 between runs. Sync trains every step it samples; async
may sample steps the learner then drops as too stale, so ``achieved_trained`` compares trained steps/s (the
newest version's ``env_steps`` over the time from version 0 to it) as well: where
sampling outruns the learner, the sampled ratio can exceed the bound and only the trained
one means anything. The bound assumes sampling and learning use separate resources; on a
shared 2-core machine they compete for the same CPU. The busy-seconds
counters of :mod:`gyre_async.timing` (policy, env, learner, bus, codec, storage), the
process's CPU seconds per wall second and the sampler's seconds paused at the staleness gate
are reported per run: they say where async loses against the bound.

Last line: {"bench": "async_vs_sync", "seconds": ..., "settings": {name: {"async_steps_per_s",
"sync_steps_per_s", "achieved", "bound", "bound_phases", "achieved_over_bound",
"T_sample_s", "T_sample_busy_s", "T_learn_s", ...}}, "speedup": <latency_bound achieved>}
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
import time
from collections import defaultdict

from _common import QUICKSTART, make_config, print_result, run_summary, scratch_dir

from gyre_async import timing
from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_events
from gyre_async.config import bus_url, load_config
from gyre_async.envs import register_env
from gyre_async.envs.base import EnvVocabulary
from gyre_async.envs.workshop import ACTION_WORDS, VOCAB, WorkshopEnv
from gyre_async.runtime.logs import configure_logging
from schemas.events import Heartbeat, PolicyVersion, TrajectoryStep
from schemas.topics import POLICY_VERSION, TELEMETRY, TRAJECTORY_STEP

SHORT = {"n_orders": 4, "max_steps": 64}
SETTINGS: dict[str, dict] = {
    "latency_bound": {"env": "workshop", "latency_mean_s": 0.3, "latency_sigma": 1.0, **SHORT},
    "compute_bound": {"env": "workshop", "latency_mean_s": 0.01, "latency_sigma": 1.0, **SHORT},
    "long_tail": {"env": "workshop-longtail", "latency_mean_s": 0.2, "latency_sigma": 1.0,
                  "n_orders": 4, "max_steps": 128},
}
TAIL_MIN_STEPS, TAIL_ALPHA = 6, 1.1


class LongTailWorkshop(WorkshopEnv):
    """The workshop with a heavy-tailed step cap drawn per episode from its seed."""

    async def reset(self, task_id: str, seed: int) -> str:
        rng = random.Random(f"longtail|{task_id}|{seed}")
        self.max_steps = min(self.config.max_steps,
                             math.ceil(TAIL_MIN_STEPS * rng.paretovariate(TAIL_ALPHA)))
        return await super().reset(task_id, seed)


register_env("workshop-longtail", LongTailWorkshop,
             vocabulary=lambda _config: EnvVocabulary(VOCAB, ACTION_WORDS))


def steps_per_round(setting: dict, num_envs: int) -> int:
    """Steps a sync round samples (the untrained policy runs every episode to its cap): the
    async learner's batch too, so that both modes make updates of the same size."""
    if setting["env"] != "workshop-longtail":
        return num_envs * setting["max_steps"]
    rng = random.Random(0)  # the expected heavy-tailed cap, by Monte Carlo
    mean_cap = statistics.mean(min(setting["max_steps"], math.ceil(
        TAIL_MIN_STEPS * rng.paretovariate(TAIL_ALPHA))) for _ in range(100_000))
    return round(num_envs * mean_cap)


def configure(cfg, mode: str, run_dir: str, seconds: float, setting: dict):
    env_config = {k: v for k, v in setting.items() if k != "env"}
    return make_config(
        cfg,
        run={"run_dir": run_dir, "run_id": f"bench-{mode}", "mode": mode},
        loop={"max_wall_s": seconds, "target_success": 0.0},
        learner={"max_versions": 0,
                 "batch_steps": steps_per_round(setting, cfg.sampler.num_envs)},
        evaluator={"every_versions": 10_000},  # only version 0 and the final one
        task={"env": setting["env"], "env_config": {**env_config, "latency_max_s": 5.0}},
    )


async def read_back(url: str) -> dict:
    """Per-update phase times (meaningful for a sync run: see the top) and the last
    heartbeat of the sampler and the learner, read back from the run's event log."""
    published: dict[int, float] = {}
    newest: PolicyVersion | None = None
    steps: dict[int, dict[str, float]] = defaultdict(dict)  # version -> trajectory -> last ts
    counts: dict[int, int] = defaultdict(int)
    beats: dict[str, Heartbeat] = {}
    async with open_bus(url) as bus:
        async for _record, event in read_events(bus, [POLICY_VERSION, TRAJECTORY_STEP,
                                                      TELEMETRY]):
            if isinstance(event, PolicyVersion):
                published.setdefault(event.version, event.ts)
                if newest is None or event.version > newest.version:
                    newest = event
            elif isinstance(event, TrajectoryStep):
                ends = steps[event.policy_version]
                ends[event.trajectory_id] = max(ends.get(event.trajectory_id, 0.0), event.ts)
                counts[event.policy_version] += 1
            elif isinstance(event, Heartbeat):
                beats[event.role] = event
    seen = {}
    if "sampler" in beats:
        seen["sampler_paused_s"] = round(beats["sampler"].stats.get("paused_s", 0.0), 1)
    if "learner" in beats:
        seen["learner_lag"] = beats["learner"].lag
    if newest is not None and newest.version > 0:  # trained (not merely sampled) steps/s
        span = max(newest.ts - published[0], 1e-9)
        seen["trained_steps_per_s"] = newest.env_steps / span
        seen["dropped_steps"] = newest.consumed_steps - newest.env_steps
    return {**seen, **phases(published, steps, counts)}


def phases(published: dict[int, float], steps: dict[int, dict[str, float]],
           counts: dict[int, int]) -> dict:
    rounds = []
    for v in sorted(steps):
        if v not in published or v + 1 not in published:
            continue  # the round cut by the end of the run
        t0, t2 = published[v], published[v + 1]
        ends = steps[v].values()
        t1 = max(ends)
        rounds.append({"sample": t1 - t0, "busy": statistics.mean(e - t0 for e in ends),
                       "learn": t2 - t1, "steps": counts[v]})
    used = rounds[1:] if len(rounds) > 2 else rounds
    if not used:
        return {"rounds": 0}
    mean = {k: statistics.mean(r[k] for r in used) for k in ("sample", "busy", "learn", "steps")}
    period = sum(r["sample"] + r["learn"] for r in used)
    return {"rounds": len(used), "T_sample_s": mean["sample"], "T_sample_busy_s": mean["busy"],
            "T_learn_s": mean["learn"], "steps_per_update": mean["steps"],
            "rounds_steps_per_s": sum(r["steps"] for r in used) / period}


def run_mode(base, mode: str, seconds: float, setting: dict) -> dict:
    with scratch_dir(f"gyre-{mode}-") as tmp:
        cfg = configure(base, mode, tmp, seconds, setting)
        timing.reset()
        cpu0 = time.process_time()
        s = run_summary(cfg)
        cpu = time.process_time() - cpu0
        busy = {k: round(v, 1) for k, v in sorted(timing.snapshot().items())}
        out = {"steps_per_s": s["env_steps_per_s"], "success": s["final_success"],
               "versions": s["policy_versions"], "env_steps": s["env_steps"], "busy_s": busy,
               "cpu_per_wall": round(cpu / s["wall_seconds"], 2)}
        out.update(asyncio.run(read_back(bus_url(cfg))))
    return out


def compare(sync: dict, asyn: dict) -> dict:
    achieved = asyn["steps_per_s"] / max(sync["steps_per_s"], 1e-9)
    trained = (asyn["trained_steps_per_s"] / sync["trained_steps_per_s"]
               if asyn.get("trained_steps_per_s") and sync.get("trained_steps_per_s") else None)
    row = {"async_steps_per_s": round(asyn["steps_per_s"], 2),
           "sync_steps_per_s": round(sync["steps_per_s"], 2), "achieved": round(achieved, 3),
           "async_versions": asyn["versions"], "sync_versions": sync["versions"],
           "async_success": asyn["success"], "sync_success": sync["success"],
           "async_trained_steps_per_s": round(asyn.get("trained_steps_per_s", 0.0), 2),
           "sync_trained_steps_per_s": round(sync.get("trained_steps_per_s", 0.0), 2),
           "achieved_trained": round(trained, 3) if trained else None,
           "async_dropped_steps": asyn.get("dropped_steps"),
           "sync_rounds_measured": sync["rounds"],
           "async_sampler_paused_s": asyn.get("sampler_paused_s"),
           "cpu_per_wall": {"sync": sync["cpu_per_wall"], "async": asyn["cpu_per_wall"]},
           "busy_s": {"sync": sync["busy_s"], "async": asyn["busy_s"]}}
    if sync["rounds"]:
        ts, busy, tl = sync["T_sample_s"], sync["T_sample_busy_s"], sync["T_learn_s"]
        bound = (ts + tl) / max(busy, tl)
        # both sides of the ratio from the same sync rounds as the bound (the run's span
        # also holds round 0's initial validation and a round cut by the end of the run)
        sync_rounds_rate = sync["rounds_steps_per_s"]
        achieved_rounds = asyn["steps_per_s"] / max(sync_rounds_rate, 1e-9)
        row.update(bound=round(bound, 3), bound_phases=round((ts + tl) / max(ts, tl), 3),
                   sync_rounds_steps_per_s=round(sync_rounds_rate, 2),
                   achieved_rounds=round(achieved_rounds, 3),
                   achieved_over_bound=round(achieved_rounds / bound, 3),
                   achieved_span_over_bound=round(achieved / bound, 3),
                   achieved_trained_over_bound=round(trained / bound, 3) if trained else None,
                   T_sample_s=round(ts, 2), T_sample_busy_s=round(busy, 2),
                   T_learn_s=round(tl, 2), steps_per_update=round(sync["steps_per_update"]),
                   T_learner_busy_s=round(sync["busy_s"].get("learner", 0.0)
                                          / max(sync["versions"] - 1, 1), 2))
    else:
        row.update(bound=None, bound_phases=None, achieved_over_bound=None)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(QUICKSTART))
    p.add_argument("--seconds", type=float, default=150.0,
                   help="wall-clock budget per mode and setting (150 s holds 3-4 sync rounds "
                        "in the latency-bound and long-tail settings: the bound needs them)")
    p.add_argument("--settings", default=",".join(SETTINGS),
                   help=f"comma list of: {', '.join(SETTINGS)}")
    args = p.parse_args(argv)
    configure_logging("WARNING", json=False)  # the per-setting lines only, no actor logs
    base = load_config(args.config)
    table = {}
    for name in args.settings.split(","):
        runs = {}
        for mode in ("sync", "async"):
            runs[mode] = run_mode(base, mode, args.seconds, SETTINGS[name])
            r = runs[mode]
            print(f"{name} {mode:>5}: {r['env_steps']} env steps, {r['steps_per_s']:.1f} steps/s,"
                  f" {r['versions']} versions, final success {r['success']}, busy s {r['busy_s']},"
                  f" CPU/wall {r['cpu_per_wall']}, sampler paused {r.get('sampler_paused_s')} s",
                  file=sys.stderr, flush=True)
        table[name] = compare(runs["sync"], runs["async"])
        print(f"{name}: {json.dumps(table[name])}", file=sys.stderr, flush=True)
    print_result({"bench": "async_vs_sync", "seconds": args.seconds, "settings": table,
                  "speedup": table.get("latency_bound", {}).get("achieved")})
    return 0


if __name__ == "__main__":
    sys.exit(main())
