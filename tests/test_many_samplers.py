"""Many samplers in one run: two sampler replicas on a real bus.

The loop runs in one process on one event loop (as ``gyre run`` does), but each actor has
its own runner, name and consumer group exactly as ``gyre actor ROLE --replica I/N`` would
give it, so the bus sees what a multi-process run makes it see. Checked on the log and on
the samplers' live counters:

- trajectory ids and environment seeds never collide between the replicas (each replica
  owns the seeds ``i mod 2``);
- both replicas follow every policy version (each reads ``policy-version`` in its own group);
- the staleness bound holds for the two together: at every poll the steps both emitted stay
  within the single-sampler capacity for all their slots, and the learner trained nothing
  beyond ``max_staleness`` (the shared invariant checker);
- a restarted replica ends only its own open trajectories, resuming its own step count.
"""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from actors.sampler import Sampler
from gyre_async.audit.invariants import check_run, read_run
from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_events
from gyre_async.core.sampler import UnfinishedTrajectories
from gyre_async.rl.staleness import StalenessGate
from gyre_async.runtime.actor import ActorRunner
from gyre_async.runtime.topology import build_actor
from schemas import encode, event_id
from schemas.events import EnvError, PolicyVersion, TrajectoryStep
from schemas.topics import ALL_TOPICS, POLICY_VERSION, TRAJECTORY_STEP

REPLICAS = 2


def replica_config(cfg, index: int):
    return msgspec.structs.replace(cfg, sampler=msgspec.structs.replace(
        cfg.sampler, replicas=REPLICAS, replica=index))


async def run_loop_with_replicas(url: str, cfg, versions: int, timeout_s: float):
    """Two samplers, segmenter, arbiter, learner until ``versions`` (many segmenters and
    arbiters: tests/test_many_segmenters.py)."""
    async with open_bus(url) as bus:
        await bus.create_topics(ALL_TOPICS, cfg.bus.partitions)
        samplers = [Sampler(replica_config(cfg, i)) for i in range(REPLICAS)]
        named = [(s, f"sampler-{i}") for i, s in enumerate(samplers)]
        named += [(build_actor(role, cfg), role) for role in ("segmenter", "arbiter", "learner")]
        runners = [ActorRunner(actor, bus, run_id=cfg.run.run_id, name=name,
                               partitions=cfg.bus.partitions, heartbeat_s=1.0)
                   for actor, name in named]
        tasks = [asyncio.create_task(r.run(), name=r.name) for r in runners]
        # one gate for both replicas' slots together: the bound the run must stay within
        whole = StalenessGate(cfg.loop.max_staleness, cfg.learner.batch_steps,
                              REPLICAS * cfg.sampler.num_envs * cfg.segmenter.max_segment_steps)
        worst, at_share = 0.0, 0
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            while loop.time() < deadline:
                for task in tasks:
                    if task.done():
                        task.result()  # an actor crashed: show why
                cores = [s.core for s in samplers]
                version = max(c.learner_version for c in cores)
                consumed = max(c.learner_consumed for c in cores)
                emitted = sum(c.steps_emitted for c in cores)
                worst = max(worst, emitted / whole.capacity(version, consumed))
                at_share += sum(c.at_gate > 0 for c in cores)  # slots held by the gate
                if min(c.learner_version for c in cores) >= versions:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"no version {versions} in {timeout_s:.0f} s: "
                                     f"{[s.core.stats() for s in samplers]}")
        finally:
            # the learner first: a version it publishes while the samplers stop would be
            # left unread; then the samplers read what it published
            learner = runners[-1]
            learner.stop()
            await asyncio.gather(tasks[-1], return_exceptions=True)
            for _ in range(200):
                end = await _end(bus)
                if all(sum(o for (t, _), o in r.position.items() if t == POLICY_VERSION) >= end
                       for r in runners[:REPLICAS]):
                    break
                await asyncio.sleep(0.05)
            for r in runners:
                r.stop()
            await asyncio.gather(*tasks, return_exceptions=True)
        published = sorted({e.version async for _, e in read_events(bus, [POLICY_VERSION],
                                                                    on_bad="raise")
                            if isinstance(e, PolicyVersion) and e.run_id == cfg.run.run_id})
        run = await read_run(bus, cfg.run.run_id)
        follows = {f"sampler-{i}": await bus.lag(f"{cfg.run.run_id}.sampler-{i}",
                                                 [POLICY_VERSION]) for i in range(REPLICAS)}
    return samplers, published, run, worst, at_share, follows


async def _end(bus) -> int:
    """The end offset of ``policy-version`` (one partition: one key)."""
    ends = {t.name: t.end_offsets for t in await bus.topics()}[POLICY_VERSION]
    return sum(ends.values())


TANSU = pytest.param("tansu", marks=[pytest.mark.kafka, pytest.mark.slow])


@pytest.mark.parametrize("backend", ["embedded", TANSU])
@pytest.mark.slow  # an end-to-end run: the full tier (the fast tier stays under 3 minutes)
def test_two_samplers_share_the_gate_and_never_collide(backend, tiny, tmp_path, request):
    run_id = f"replicas-{backend}-{tmp_path.name[-12:]}"
    # max_staleness 1 and batches of 256, 8 slots each, segments of 16: one gate for all 16
    # slots admits 2 * 256 + 16 * 16 = 768 steps before version 1; each replica 384
    cfg = tiny.config(run={"run_id": run_id}, loop={"max_staleness": 1},
                      learner={"max_versions": 0})
    broker = None
    if backend == "embedded":
        url = f"sqlite:///{tmp_path}/events.db"
    else:  # a broker of its own: on a broker shared with other runs this run's roles are
        # misled by their policy-version events (an open cross-run defect, see docs/bus.md)
        from brokers import start_broker

        broker = start_broker("tansu", data_dir=str(tmp_path / "tansu"),
                              log_path=str(tmp_path / "tansu.log"))
        url = f"kafka://{broker.bootstrap}"
    try:
        samplers, published, run, worst, at_share, follows = asyncio.run(
            run_loop_with_replicas(url, cfg, versions=5, timeout_s=120))
    finally:
        if broker is not None:
            broker.stop()  # 5 x 256 steps: every
    # slot's first episode has reached the tiny task's 80-step cap, so some have finished

    report = check_run(run, segment_store=f"{cfg.run.run_dir}/segments.zarr",
                       checkpoint_dir=f"{cfg.run.run_dir}/checkpoints",
                       max_staleness=cfg.loop.max_staleness)
    assert report.ok, report.describe()
    assert report.counts["trained"] > 0 and report.counts["finished_trajectories"] > 0

    steps = run.events(TRAJECTORY_STEP, TrajectoryStep)
    by_replica = {f"sampler-{i}": [s for s in steps if s.producer == f"sampler-{i}"]
                  for i in range(REPLICAS)}
    assert all(by_replica.values()), {k: len(v) for k, v in by_replica.items()}
    tids = {name: {s.trajectory_id for s in mine} for name, mine in by_replica.items()}
    seeds = {name: {int(s.task_id.split(":")[1]) for s in mine}
             for name, mine in by_replica.items()}
    assert not tids["sampler-0"] & tids["sampler-1"]
    assert all(t.startswith(f"{name}-") for name, ts in tids.items() for t in ts)
    assert not seeds["sampler-0"] & seeds["sampler-1"]
    assert all(seed % REPLICAS == i for i in range(REPLICAS) for seed in seeds[f"sampler-{i}"])

    # both followed every version: each read the whole topic in its own group
    assert published[:4] == [0, 1, 2, 3]
    assert follows == {"sampler-0": 0, "sampler-1": 0}
    assert [s.core.learner_version for s in samplers] == [published[-1]] * REPLICAS
    assert all(max(s.policy_version for s in mine) >= 1 for mine in by_replica.values())

    # the gate bound (each replica's slots waited at its share: pacing holds a new segment
    # at the open share, a step of an open one at the share), and both together stayed
    # within the whole run's capacity
    assert at_share > 0, "the staleness gate never closed: the test shows nothing"
    assert worst <= 1.0, worst


def test_restarted_replica_ends_only_its_own_trajectories(tiny, tmp_path):
    """``sampler`` is a prefix of ``sampler-1``'s trajectory ids: a restart of ``sampler``
    must not end ``sampler-1``'s open trajectory, nor count its steps."""
    cfg = tiny.config(run={"run_id": "tiny"})

    def step(producer: str, tid: str, i: int, done: bool = False) -> TrajectoryStep:
        return TrajectoryStep(event_id=event_id("s", tid, i), run_id="tiny", producer=producer,
                              key=tid, trajectory_id=tid, task_id="workshop:1", step_index=i,
                              policy_version=0, context_tokens=[1], action_tokens=[2],
                              action_logprobs=[-0.1], done=done)

    async def go():
        async with open_bus(f"sqlite:///{tmp_path}/events.db") as bus:
            events = [step("sampler", "sampler-0a0a0a0a-0", i) for i in range(3)]   # open
            events += [step("sampler", "sampler-0a0a0a0a-1", 0, done=True)]
            events += [step("sampler-1", "sampler-1-1b1b1b1b-0", i) for i in range(5)]  # open
            await bus.publish(TRAJECTORY_STEP, [(e.key.encode(), encode(e)) for e in events])
            sampler = Sampler(cfg)
            runner = ActorRunner(sampler, bus, run_id="tiny", name="sampler")
            task = asyncio.create_task(runner.run())
            await asyncio.sleep(3)  # no policy version: it ends the open ones and waits
            runner.stop()
            await task
            return sampler.core.steps_emitted, [
                e async for _, e in read_events(bus, [TRAJECTORY_STEP], on_bad="raise")]

    resumed, events = asyncio.run(go())
    errors = [e for e in events if isinstance(e, EnvError)]
    assert [(e.trajectory_id, e.step_index) for e in errors] == [("sampler-0a0a0a0a-0", 3)]
    assert resumed == 3 + 1  # its own steps only: 3 of the open one and 1 of the ended one


@pytest.mark.slow
def test_launcher_restarts_a_killed_sampler_replica_which_resumes_only_its_own_episodes(
        tiny, tmp_path):
    """``gyre launch --replicas sampler=2`` with the core roles on the embedded bus; one
    replica is SIGKILLed mid-run and restarted under its name: it continues its own open
    trajectories (the workshop's episodes can be rebuilt: same ids, steps it produced, the
    indices going on), the other replica goes on untouched, and the run's invariants hold."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from gyre_async.runtime.launcher import read_status, wait_until

    root = Path(__file__).resolve().parents[1]
    # episodes of up to 400 steps: the gate stops the slots mid-episode, not between two
    overrides = {"run": {"run_id": "replica-kill"}, "learner": {"max_versions": 0},
                 "task": {"env_config": {"n_orders": 6, "max_steps": 400}}}
    config = tiny.write(**overrides)
    cfg = tiny.config(**overrides)
    url = f"sqlite:///{tmp_path}/events.db"
    status = tmp_path / "status.json"
    log_path = tmp_path / "launcher.log"

    def versions() -> int:
        async def count():
            async with open_bus(url) as bus:
                if POLICY_VERSION not in {t.name for t in await bus.topics()}:
                    return 0
                return len({e.version async for _, e in read_events(bus, [POLICY_VERSION],
                                                                    on_bad="skip")})
        return asyncio.run(count())

    def open_trajectories(producer: str) -> int:
        async def count():
            unfinished = UnfinishedTrajectories()
            async with open_bus(url) as bus:
                if TRAJECTORY_STEP not in {t.name for t in await bus.topics()}:
                    return 0
                async for _, event in read_events(bus, [TRAJECTORY_STEP], on_bad="skip"):
                    if event.producer == producer:
                        unfinished.fold(event)
            return len(unfinished.abandoned("replica-kill", producer))
        return asyncio.run(count())

    def steps_of(producer: str) -> int:
        async def count():
            async with open_bus(url) as bus:
                return len({e.event_id async for _, e in read_events(
                    bus, [TRAJECTORY_STEP], on_bad="skip")
                    if isinstance(e, TrajectoryStep) and e.producer == producer})
        return asyncio.run(count())

    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "gyre_async.cli", "launch",
                                 str(config), "--bus", url, "--status-file", str(status),
                                 "--replicas", "sampler=2", "--max-restarts", "2"],
                                cwd=root, stdout=log, stderr=subprocess.STDOUT)
    try:
        try:
            # kill it mid-episode (between episodes, at the gate, there is nothing to end)
            wait_until("sampler-1 mid-episode after two versions",
                       lambda: versions() >= 2 and open_trajectories("sampler-1"), 150,
                       every=0.5)
            killed = read_status(status)["roles"]["sampler-1"]["pid"]
            os.kill(killed, signal.SIGKILL)
            killed_at = time.time()
            published_at_kill = steps_of("sampler-1")
            wait_until("sampler-1 restarted", lambda: (s := read_status(status)["roles"]
                       ["sampler-1"])["restarts"] == 1 and s["alive"], 30)
            reached = versions()
            wait_until("the restarted sampler-1 stepping",
                       lambda: steps_of("sampler-1") > published_at_kill, 150, every=1)
            wait_until("a version after the restart", lambda: versions() > reached, 150,
                       every=1)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}:\n{log_path.read_text()[-4000:]}") from None
        roles = read_status(status)["roles"]
        assert roles["sampler-0"]["restarts"] == 0 and roles["sampler-0"]["alive"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0, log_path.read_text()[-4000:]

    async def read():
        async with open_bus(url) as bus:
            return await read_run(bus, "replica-kill")

    run = asyncio.run(read())
    report = check_run(run, segment_store=f"{cfg.run.run_dir}/segments.zarr",
                       checkpoint_dir=f"{cfg.run.run_dir}/checkpoints",
                       max_staleness=cfg.loop.max_staleness)
    assert report.ok, report.describe()
    steps = run.events(TRAJECTORY_STEP, TrajectoryStep)
    assert not [e for e in run.events(TRAJECTORY_STEP, EnvError) if e.reason]  # none ended
    before = [s for s in steps if s.producer == "sampler-1" and s.ts < killed_at]
    left_open = UnfinishedTrajectories()
    for event in before:
        left_open.fold(event)
    open_ids = {e.trajectory_id for e in left_open.open_episodes(cfg.task.env)}
    assert open_ids, "the killed replica left no open trajectory to continue"
    continued = {s.trajectory_id for s in steps if s.ts > killed_at} & open_ids
    assert continued, "the restarted replica continued none of its open trajectories"
    for tid in continued:
        mine = [s for s in steps if s.trajectory_id == tid]
        assert {s.producer for s in mine} == {"sampler-1"} and tid.startswith("sampler-1-")
        assert sorted(s.step_index for s in mine) == list(range(len(mine)))
    assert {s.producer for s in steps} == {"sampler-0", "sampler-1"}
