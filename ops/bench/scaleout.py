"""Scale-out: environment steps/s with 1, 2, 4 and 8 sampler processes on Kafka (noida-db).

For each count N: a fresh noida-db broker (started through ``ops/brokers.py``, stopped by
PID), a fresh run, and N processes ``gyre actor sampler --replica I/N``. The task is the
built-in workshop with log-normal tool latency (mean ``--latency`` 0.3 s, sigma
``--sigma``); every sampler runs ``--num-envs`` environments, fixed, so the ideal rate is
linear in N: about ``N * num_envs / latency`` while the policy's compute is small.

Learner stand-in, not the other roles: before the samplers start, the bench saves the
initial weights as version 0 and publishes one ``policy-version`` whose ``consumed_steps``
(10**12) opens the staleness gate for good. What is measured is the samplers' own scaling:
neither the learner's pace (the gate would make sampling wait for it) nor the CPU a
segmenter, arbiter and learner would take from the samplers on the same machine.

Measurement: once every sampler has published a step (start-up: imports, policy build,
joining the broker), a window of ``--seconds`` wall time. Steps: the run's
``trajectory-step`` events stamped inside the window. CPU over the same window: the
sampler processes' user+sys seconds per second (in cores, psutil) and the whole machine's
busy share of all its cores (psutil), which says whether the machine, not Gyre, is the limit.
Every sampler runs with ``OMP_NUM_THREADS = --torch-threads`` (default 1), the same for
every N so the comparison is fair: the acting policy is small, and torch's default of one
intra-op thread per core costs far more CPU than it saves once the cores are shared
(see docs/bus.md, "Many samplers on Kafka").

Last line: {"bench": "scaleout", "steps_per_s": {"1": x, "2": x, "4": x, "8": x},
            "efficiency": {"2": x, "4": x, "8": x}, "cpu_utilisation": {...}, ...}
with efficiency = rate_N / (N * rate_1).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
from _common import (
    QUICKSTART,
    ROOT,
    make_config,
    ops_script,
    print_result,
    scratch_dir,
    write_config,
)

from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_events
from gyre_async.compose import build_policy, build_tokenizer, save_weights
from gyre_async.config import load_config
from gyre_async.runtime.logs import configure_logging
from gyre_async.storage.checkpoints import CheckpointStore
from schemas import encode, event_id
from schemas.events import PolicyVersion, TrajectoryStep
from schemas.topics import ALL_TOPICS, POLICY_VERSION, TRAJECTORY_STEP

GATE_OPEN = 10**12  # consumed steps announced by the stand-in: the gate never closes


def scaleout_config(args, run_dir: Path, run_id: str) -> Path:
    """The base config with the bench's task, run and sampler settings, as a TOML file."""
    cfg = make_config(args.config, run={"run_id": run_id, "run_dir": str(run_dir)},
                      task={"env_config": {"latency_mean_s": args.latency,
                                           "latency_sigma": args.sigma, "latency_max_s": 5.0}},
                      sampler={"num_envs": args.num_envs})
    return write_config(cfg, run_dir / "scaleout.toml")


async def publish_version_zero(url: str, config: Path) -> None:
    """The learner stand-in: version 0 = the initial weights, gate opened for good."""
    cfg = load_config(config)
    ref = save_weights(CheckpointStore(f"{cfg.run.run_dir}/checkpoints"),
                       build_policy(cfg, build_tokenizer(cfg)), 0)
    v0 = PolicyVersion(event_id=event_id("scaleout-v0", cfg.run.run_id), run_id=cfg.run.run_id,
                       producer="learner", key="policy", version=0,  # its stand-in
                       checkpoint=ref.address, checkpoint_hash=ref.sha256, reason="init",
                       consumed_steps=GATE_OPEN)
    async with open_bus(url) as bus:
        await bus.create_topics(ALL_TOPICS, cfg.bus.partitions)
        await bus.publish(POLICY_VERSION, [(v0.key.encode(), encode(v0))])


async def step_times(url: str, run_id: str) -> dict[str, list[float]]:
    """Producer -> the timestamps of its trajectory steps in this run."""
    out: dict[str, list[float]] = {}
    async with open_bus(url) as bus:
        async for _, event in read_events(bus, [TRAJECTORY_STEP], on_bad="skip"):
            if isinstance(event, TrajectoryStep) and event.run_id == run_id:
                out.setdefault(event.producer, []).append(event.ts)
    return out


async def wait_all_stepping(url: str, count: int, procs: list[subprocess.Popen],
                            timeout_s: float) -> None:
    """Until ``count`` producers have published a step (one client, following the topic)."""
    producers: set[str] = set()
    deadline = time.monotonic() + timeout_s

    async def follow(bus) -> None:
        async for _, event in read_events(bus, [TRAJECTORY_STEP], on_bad="skip", follow=True):
            producers.add(event.producer)
            if len(producers) >= count:
                return

    async with open_bus(url) as bus:
        task = asyncio.create_task(follow(bus))
        try:
            while not task.done():
                if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                    raise RuntimeError(f"{count} samplers: {len(producers)} stepping after "
                                       f"{timeout_s:.0f} s")
                await asyncio.sleep(0.5)
            task.result()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def cpu_seconds(procs: list[psutil.Process]) -> float:
    total = 0.0
    for proc in procs:
        try:
            times = proc.cpu_times()
            total += times.user + times.system + times.children_user + times.children_system
        except psutil.NoSuchProcess:
            pass
    return total


def measure(args, count: int, work: Path) -> dict:
    """One count: broker, stand-in, ``count`` samplers, a window, then stop all by PID."""
    run_id = f"scaleout-{count}"
    run_dir = work / run_id
    run_dir.mkdir(parents=True)
    broker = ops_script("brokers").start_broker("noida", data_dir=str(run_dir / "noida"),
                                                log_path=str(run_dir / "noida.log"))
    procs: list[subprocess.Popen] = []
    try:
        config = scaleout_config(args, run_dir, run_id)
        asyncio.run(publish_version_zero(broker.url, config))
        env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "OMP_NUM_THREADS": str(args.torch_threads)}
        for index in range(count):
            with open(run_dir / f"sampler-{index}.log", "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "gyre_async.cli", "actor", "sampler", "--config",
                     str(config), "--bus", broker.url, "--replica", f"{index}/{count}"],
                    cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
        asyncio.run(wait_all_stepping(broker.url, count, procs, args.startup_timeout))
        watched = [psutil.Process(p.pid) for p in procs]
        psutil.cpu_percent(None)  # starts the machine-wide measurement
        cpu_before, started = cpu_seconds(watched), time.time()
        time.sleep(args.seconds)
        cpu_after, ended = cpu_seconds(watched), time.time()
        machine = psutil.cpu_percent(None) / 100.0
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        try:
            times = asyncio.run(step_times(broker.url, run_id)) if procs else {}
        finally:
            broker.stop()
    window = ended - started
    steps = sum(started <= ts < ended for stamps in times.values() for ts in stamps)
    per_sampler = sorted(sum(started <= ts < ended for ts in stamps) / window
                         for stamps in times.values())
    result = {"steps_per_s": steps / window, "window_s": window,
              "per_sampler_steps_per_s": [round(r, 1) for r in per_sampler],
              "samplers_cores": (cpu_after - cpu_before) / window,
              "machine_busy_share": machine}
    print(f"{count} sampler(s): {result['steps_per_s']:.1f} steps/s over {window:.0f} s "
          f"(per sampler {result['per_sampler_steps_per_s']}), samplers use "
          f"{result['samplers_cores']:.2f} cores, machine {machine:.0%} busy",
          file=sys.stderr)
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(QUICKSTART))
    p.add_argument("--counts", default="1,2,4,8", help="sampler process counts")
    p.add_argument("--seconds", type=float, default=60.0, help="measured wall time per count")
    p.add_argument("--num-envs", type=int, default=16, help="environments per sampler")
    p.add_argument("--latency", type=float, default=0.3, help="mean tool latency (s)")
    p.add_argument("--sigma", type=float, default=0.5, help="log-normal sigma")
    p.add_argument("--torch-threads", type=int, default=1,
                   help="OMP_NUM_THREADS of every sampler process (default 1)")
    p.add_argument("--startup-timeout", type=float, default=300.0,
                   help="seconds for all samplers to publish their first step")
    args = p.parse_args(argv)
    configure_logging("WARNING")
    counts = [int(c) for c in args.counts.split(",")]
    with scratch_dir("gyre-scaleout-") as tmp:
        results = {n: measure(args, n, Path(tmp)) for n in counts}
    rate = {str(n): round(r["steps_per_s"], 2) for n, r in results.items()}
    first = results[counts[0]]["steps_per_s"] / counts[0]
    print_result({
        "bench": "scaleout",
        "steps_per_s": rate,
        "efficiency": {str(n): round(r["steps_per_s"] / (n * first), 3)
                       for n, r in results.items() if n != counts[0]},
        "cpu_utilisation": {
            "machine_cores": psutil.cpu_count(),
            "samplers_cores": {str(n): round(r["samplers_cores"], 2) for n, r in results.items()},
            "machine_busy_share": {str(n): round(r["machine_busy_share"], 3)
                                   for n, r in results.items()},
        },
        "ideal_steps_per_s_per_sampler": round(args.num_envs / args.latency, 1),
        "num_envs_per_sampler": args.num_envs, "latency_mean_s": args.latency,
        "latency_sigma": args.sigma, "seconds": args.seconds,
        "torch_threads": args.torch_threads,
        "learner": "stand-in (one policy-version with the gate open)",
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
