"""Sampler: many environments, acting with the current policy, one event per step.

consumes: policy-version (PolicyVersion), telemetry (SegmentDropped: the learner's
          consumed count, for the staleness gate)
emits:    trajectory-step (TrajectoryStep, EnvError)
reads:    trajectory-step (its own earlier steps), policy-version (folds, on a restart)

The environments, the batched policy and the staleness gate are
:class:`gyre_async.core.sampler.SamplerCore`'s. This adapter hands it every policy version,
runs it as the actor's ``produce`` loop, and publishes the events it makes in batches every
``sampler.flush_interval_s``. On start it folds what a previous incarnation (same actor
name) published: its count of steps goes on under the staleness gate, and the episodes it
left open are handed to the core, which rebuilds and continues them (or, for environments
that cannot be rebuilt, ends them visibly; :mod:`gyre_async.core.resumption`).

Many samplers per run (``gyre actor sampler --replica I/N``, or ``gyre launch --replicas
sampler=N``): every replica must see every policy version, so each reads
``policy-version`` in a consumer group of its own (``group_per_name``: ``<run_id>.<name>``)
instead of sharing one that would split the topic's partitions between them. Ids, seeds
and the staleness share per replica are the core's (:mod:`gyre_async.core.sampler`).
"""

from __future__ import annotations

import asyncio

from gyre_async.core.resumption import UnfinishedTrajectories
from gyre_async.core.sampler import SamplerCore
from gyre_async.folds.restart import OwnSteps
from gyre_async.folds.runlog import VersionsInForce
from gyre_async.runtime.actor import Actor, Emit
from gyre_async.storage.errors import CheckpointError
from schemas import Event
from schemas.config import Config
from schemas.events import PolicyVersion, SegmentDropped
from schemas.topics import POLICY_VERSION, TELEMETRY, TRAJECTORY_STEP


class Sampler(Actor):
    role = "sampler"
    consumes = (POLICY_VERSION, TELEMETRY)
    emits = (TRAJECTORY_STEP,)
    reads = (TRAJECTORY_STEP,)  # its own earlier steps, on a restart
    group_per_name = True

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.core = SamplerCore.from_config(cfg)
        self._outbox: list[Emit] = []
        self.unfinished = UnfinishedTrajectories()  # both restored on start (folds)
        self.versions = VersionsInForce(self.core.roots.trusts)

    @classmethod
    def from_config(cls, cfg: Config) -> Sampler:
        return cls(cfg)

    @property
    def holder(self):
        """The policy the sampler acts with (its version is the one steps are stamped with)."""
        return self.core.holder

    def folds(self):
        """This sampler's earlier steps (its name's, in this run) and the versions in force."""
        self.unfinished = UnfinishedTrajectories()  # fresh for each start
        self.versions = VersionsInForce(self.core.roots.trusts)
        return (OwnSteps(self.runner.name, self.unfinished.fold), self.versions)

    async def on_start(self) -> None:
        # the trajectories its name left open (see
        # :class:`~gyre_async.core.resumption.UnfinishedTrajectories`) and its step count
        self.core.resume(self.unfinished.steps, self.unfinished.open_episodes(self.cfg.task.env))
        # the newest trusted version that loads: one whose checkpoint is missing, corrupt or
        # non-finite (announced in the learner's name by someone else, or damaged) is
        # skipped; waiting for a next version instead could wait for good, as the learner
        # makes none until the sampler acts
        for version in self.versions.in_force():
            try:
                await self.core.follow(version)
                break
            except CheckpointError as exc:
                self.runner.log.error("sampler.version_unloadable", version=version.version,
                                      producer=version.producer, error=str(exc))

    async def on_stop(self) -> None:
        self.holder.close()

    async def handle(self, event, record):
        match event:
            case PolicyVersion() if event.run_id == self.cfg.run.run_id:  # not another run's
                await self.core.follow(event)                             # on a shared cluster
            case SegmentDropped() if event.run_id == self.cfg.run.run_id:
                await self.core.follow_drop(event)
        return []

    async def produce(self) -> None:
        flusher = asyncio.create_task(self._flush_loop(), name=f"{self.runner.name}-flush")
        episodes = asyncio.create_task(
            self.core.run(self.runner.name, self._publish, self.runner.stopping),
            name=f"{self.runner.name}-episodes")
        try:
            # a publish that failed for good must crash the actor (its supervisor restarts
            # it), not leave the slots stepping into an outbox nobody sends
            done, _ = await asyncio.wait([episodes, flusher], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                task.result()
        finally:
            # every task is awaited to its end, so none dies with an unretrieved exception
            episodes.cancel()
            await asyncio.gather(episodes, return_exceptions=True)
            try:
                await self._flush()
            finally:
                flusher.cancel()
                await asyncio.gather(flusher, return_exceptions=True)

    def _publish(self, event: Event) -> None:
        self._outbox.append(Emit(TRAJECTORY_STEP, event))

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.sampler.flush_interval_s)
            await self._flush()

    async def _flush(self) -> None:
        if self._outbox:
            batch, self._outbox = self._outbox, []
            await self.runner.emit(batch)

    def stats(self):
        return self.core.stats()
