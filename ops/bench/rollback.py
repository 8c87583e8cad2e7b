"""Rollback drill: train to a good policy, poison one update, watch the keeper undo it.

Two runs of the same short task (one workshop order, 40-step cap, the tiny policy) with
the same injected fault: the update that makes version ``--poison-at`` uses the learning
rate times ``--factor`` (``learner.fault_lr_spike_*``, the fault-injection knob).

- ``keeper``: every role of ``gyre run``, keeper included;
- ``no-keeper``: the same roles without the keeper (what the poisoned run does alone).

Everything printed is read back from each run's event log: validation success per
evaluated version, the keeper's ``rollback`` order (why, which version, learning rate
before/after), the learner's rollback version, its validation next to the best version's
(``within_noise``: the keeper's own regression rule finds no regression), and the final
validation of both runs.

Last line: {"bench": "rollback", "best_before_poison": ..., "poisoned": ...,
            "rollback_version": ..., "recovered": ..., "within_noise": ...,
            "final_keeper": ..., "final_no_keeper": ..., ...}
"""

from __future__ import annotations

import argparse
import asyncio

from _common import make_config, print_result, run_summary, scratch_dir

from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_events
from gyre_async.core.keeper_rules import judge
from gyre_async.runtime.topology import RUN_ROLES
from schemas.config import Config, KeeperConfig
from schemas.events import EvalResult, PolicyVersion, Rollback
from schemas.topics import EVAL, KEEPER, POLICY_VERSION


def drill_config(run_dir: str, name: str, versions: int, poison_at: int, factor: float,
                 seed: int) -> Config:
    return make_config(
        run={"run_id": f"rollback-{name}", "run_dir": run_dir, "seed": seed},
        loop={"max_staleness": 2, "max_wall_s": 900},
        task={"env": "workshop", "env_config": {"n_orders": 1, "max_steps": 40}},
        policy={"d_model": 32, "n_layers": 1, "n_heads": 2, "context_tokens": 64,
                "history_turns": 0},
        sampler={"num_envs": 16},
        segmenter={"max_segment_steps": 16},
        learner={"batch_steps": 512, "minibatch_steps": 128, "epochs": 2,
                 "learning_rate": 0.003, "max_versions": versions,
                 "fault_lr_spike_version": poison_at, "fault_lr_spike_factor": factor},
        evaluator={"every_versions": 2, "episodes": 32, "greedy": False},
    )


async def read_log(run_dir: str):
    async with open_bus(f"sqlite:///{run_dir}/events.db", reader=True) as bus:
        # a measurement: a log that does not read back in full stops it (raise)
        events = [e async for _, e in read_events(
            bus, [POLICY_VERSION, EVAL, KEEPER], on_bad="raise")]
    return sorted(events, key=lambda e: e.ts)


def run(cfg: Config, roles: tuple[str, ...]) -> list:
    run_summary(cfg, roles)
    return asyncio.run(read_log(cfg.run.run_dir))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--versions", type=int, default=50, help="learner.max_versions")
    p.add_argument("--poison-at", type=int, default=30, help="version made by the spike")
    p.add_argument("--factor", type=float, default=100.0, help="learning-rate multiplier")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args(argv)
    out: dict = {"bench": "rollback", "poison_at": args.poison_at, "factor": args.factor}
    logs = {}
    for name, roles in (("keeper", RUN_ROLES),
                        ("no-keeper", tuple(r for r in RUN_ROLES if r != "keeper"))):
        with scratch_dir(f"gyre-rollback-{name}-") as tmp:
            cfg = drill_config(tmp, name, args.versions, args.poison_at, args.factor, args.seed)
            logs[name] = run(cfg, roles)
        evals = [e for e in logs[name] if isinstance(e, EvalResult)]
        print(f"{name:>9}: " + " ".join(f"v{e.policy_version}:{e.success_rate:.2f}"
                                        for e in evals), flush=True)
        out[f"final_{name.replace('-', '_')}"] = evals[-1].success_rate if evals else None

    events = logs["keeper"]
    evals = {e.policy_version: e for e in events if isinstance(e, EvalResult)}
    orders = [e for e in events if isinstance(e, Rollback)]
    before = [e for v, e in evals.items() if v < args.poison_at]
    out["best_before_poison"] = max((e.success_rate for e in before), default=None)
    out["poisoned"] = evals[args.poison_at].success_rate if args.poison_at in evals else None
    out["rollbacks"] = len(orders)
    if orders:
        order = orders[0]
        print(f"   keeper: {order.why}")
        rollback = next(e for e in events if isinstance(e, PolicyVersion)
                        and e.reason == "rollback")
        best, recovered = evals[order.restore_version], evals.get(rollback.version)
        out.update({
            "regressed_version": order.regressed_version,
            "restored_version": order.restore_version, "restored_slot": order.slot,
            "rollback_version": rollback.version,
            "lr_before": order.previous_learning_rate, "lr_after": rollback.learning_rate,
            "best": best.success_rate,
            "recovered": recovered.success_rate if recovered else None,
            "within_noise": (not judge(best, recovered, KeeperConfig().noise_k,
                                       KeeperConfig().min_regressed_metrics).regressed)
            if recovered else None,
        })
    print_result(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
