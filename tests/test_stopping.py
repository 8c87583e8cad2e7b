"""A role asked to stop stops within its grace period, in every state.

Two layers: the sampler's slots leave the staleness gate by themselves when the sampler
stops (a stop never waits on the learner, nor on a cancellation reaching each slot), and
the runtime cancels again whatever outlives a round of its stop, then leaves behind (and
names) what still runs, so ``ActorRunner.run`` always returns. Both were missing when a
cancellation got lost (Python 3.11's ``asyncio.wait_for`` drops one that comes as its
inner task finishes; ``tests/test_envs.py`` covers the step guard that used it): a slot
played on to the gate, and the sampler's stop waited for it for ever.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from gyre_async.bus import open_bus
from gyre_async.compose import build_policy, build_tokenizer, save_weights
from gyre_async.core.sampler import SamplerCore
from gyre_async.runtime.actor import STOP_ROUNDS, Actor, ActorRunner
from gyre_async.storage.checkpoints import CheckpointStore
from schemas import event_id
from schemas.events import PolicyVersion


def version_zero(cfg, run_dir) -> PolicyVersion:
    """The learner's first version, its weights saved in the run's checkpoint directory."""
    ref = save_weights(CheckpointStore(f"{run_dir}/checkpoints"),
                       build_policy(cfg, build_tokenizer(cfg)), 0)
    return PolicyVersion(event_id=event_id("pv", 0), run_id=cfg.run.run_id, producer="learner",
                         key="policy", version=0, checkpoint=ref.address,
                         checkpoint_hash=ref.sha256, reason="init")


async def test_a_sampler_whose_slots_all_wait_at_the_gate_stops_without_a_cancel(tiny,
                                                                                tmp_path):
    cfg = tiny.config(run={"run_dir": str(tmp_path)})
    core = SamplerCore.from_config(cfg)
    await core.follow(version_zero(cfg, tmp_path))
    stopping = asyncio.Event()
    steps: list = []
    run = asyncio.create_task(core.run("sampler", steps.append, stopping))
    deadline = time.monotonic() + 120
    while core.at_gate < cfg.sampler.num_envs and not run.done():  # no learner: all wait
        assert time.monotonic() < deadline, f"only {core.at_gate} slots reached the gate"
        await asyncio.sleep(0.05)
    assert core.at_gate == cfg.sampler.num_envs and steps

    stopping.set()  # nothing is cancelled: the slots must leave the gate by themselves
    done, _ = await asyncio.wait([run], timeout=5)
    try:
        assert done, "the slots still wait at the gate 5 s after the stop"
        run.result()
        assert core.at_gate == 0
    finally:
        run.cancel()
        await asyncio.gather(run, return_exceptions=True)


class Stubborn(Actor):
    """A produce loop that loses cancellations: ``lost`` of them, then it ends on the next."""

    role = "stubborn"
    consumes = ()
    emits = ()

    def __init__(self, lost: int):
        self.lost = lost
        self.running = asyncio.Event()
        self.release = asyncio.Event()  # lets a loop that loses them all end after the test

    async def produce(self) -> None:
        self.running.set()
        while True:
            try:
                await self.release.wait()
                return
            except asyncio.CancelledError:
                if not self.lost:
                    raise
                self.lost -= 1  # as asyncio.wait_for on Python 3.11 loses one


@pytest.mark.slow  # an end-to-end run: the full tier (the fast tier stays under 3 minutes)
async def test_the_runner_stops_an_actor_that_lost_a_cancellation(tmp_path):
    async with open_bus(f"sqlite:///{tmp_path}/events.db") as bus:
        for lost, rounds_needed in ((1, 2), (STOP_ROUNDS + 5, STOP_ROUNDS)):
            actor = Stubborn(lost)
            runner = ActorRunner(actor, bus, run_id="r", name=f"stubborn-{lost}",
                                 heartbeat_s=3600, stop_grace_s=0.1)
            task = asyncio.create_task(runner.run())
            await asyncio.wait_for(actor.running.wait(), 30)
            started = time.monotonic()
            runner.stop()
            # grace, then one second per round of cancellation at most (and some slack)
            done, _ = await asyncio.wait([task], timeout=0.1 + rounds_needed + 3)
            took = time.monotonic() - started
            actor.release.set()  # a produce left behind ends now
            assert done, f"a stop that lost {lost} cancellations has not returned"
            task.result()
            assert took < 0.1 + rounds_needed + 1, took
