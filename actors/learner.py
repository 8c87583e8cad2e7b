"""Learner: PPO on scored segments as they come, publishing a policy version per update.

consumes: scored (Scored, RewardFailed), keeper (Rollback)
emits:    policy-version (PolicyVersion), telemetry (SegmentDropped, CriticReset)
reads:    policy-version, scored (its versions, credit log and last batches: folds, on a
          restart)

A thin adapter over :class:`gyre_async.core.learner.LearnerCore`, which decides what to
train on, runs the update and follows rollbacks: this module moves events and bytes
(segment arrays in, checkpoints out) and keeps the slow parts off the event loop.
Trust: a ``scored`` event whose address is not in the run's segment stores, and a
``rollback`` not announced by this run's keeper with its file in the keeper's store, are
refused before any I/O (:mod:`gyre_async.storage.roots`) and dead-lettered, never buffered.
A buffered segment whose later processing fails on its own (unreadable, arrays that do not
match its event, an update that raises) is refused once, visibly (``segment-dropped`` and a
dead letter with the reason), and leaves the buffer: never kept to fail every later batch.
Restart: it resumes from its latest ``policy-version`` checkpoint (the newest trusted one
that loads: one announced in its name whose file is missing or corrupt is skipped, so a
forged announcement cannot keep it from starting); buffered, untrained
segments are redelivered because the runtime never commits past them (``commit_floor``).
Data-parallel (``learner.world_size > 1``): this is rank 0, the only learner on the bus;
``self.group`` hands each update, rollback and restart to the others (``core.learner_dp``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from functools import cached_property
from typing import TypeVar

import torch

from gyre_async import timing
from gyre_async.bus import Record
from gyre_async.compose import build_policy, build_tokenizer, load_weights, save_weights
from gyre_async.core.learner import Dropped, LearnerCore, TrainResult, VersionReason
from gyre_async.core.learner_dp import LearnerGroup, membership
from gyre_async.errors import is_retriable
from gyre_async.experience.elite import open_elite_pool
from gyre_async.folds.credit_log import CreditLog
from gyre_async.folds.redelivery import RecentlyTrained
from gyre_async.folds.runlog import VersionsInForce
from gyre_async.runtime.actor import Actor, Emit
from gyre_async.storage.checkpoints import CheckpointStore
from gyre_async.storage.errors import CheckpointError
from gyre_async.storage.readable import unreadable_segments
from gyre_async.storage.roots import StorageRoots
from gyre_async.storage.store_set import SegmentStores
from schemas import encode
from schemas.config import Config
from schemas.events import PolicyVersion, RewardFailed, Rollback, Scored
from schemas.topics import KEEPER, POLICY_VERSION, SCORED, TELEMETRY

T = TypeVar("T")


def _timed(category: str, work: Callable[[], T]) -> T:
    with timing.timed(category):
        return work()


class Learner(Actor):
    role = "learner"
    consumes = (SCORED, KEEPER)
    emits = (POLICY_VERSION, TELEMETRY)
    reads = (POLICY_VERSION,)  # its restart folds (scored: consumed too)

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.group = LearnerGroup(membership(cfg))  # alone unless learner.world_size > 1
        torch.manual_seed(cfg.run.seed)
        self.policy = build_policy(cfg, build_tokenizer(cfg))
        self.core = LearnerCore(cfg, self.policy, open_elite_pool(cfg),
                                self.group.attach(self.policy))
        self.roots = StorageRoots.from_config(cfg)  # what an event may name (and nothing else)
        self.checkpoints = CheckpointStore(self.roots.checkpoints)
        self.train_seconds = 0.0
        self.ending = False  # the run is ending (gyre run's drain): no further update
        # what a start resumes from, restored by the runner in one read (dropped once used)
        self.restart: tuple[VersionsInForce, CreditLog, RecentlyTrained] | None = None

    @classmethod
    def from_config(cls, cfg: Config) -> Learner:
        return cls(cfg)

    @cached_property
    def segments(self) -> SegmentStores:
        """Each segmenter's store, opened when an address first names it (one segmenter
        per store: gyre_async.storage.store_set)."""
        return SegmentStores(self.roots)

    def folds(self):
        """The versions in force, the credit log and the last batches (not trained again)."""
        self.restart = (VersionsInForce(self.roots.trusts), CreditLog(), RecentlyTrained())
        return self.restart

    async def on_start(self) -> None:
        assert self.restart is not None
        versions, credit, recent = self.restart
        self.restart = None  # the scored events it holds are not needed after the start
        latest = await self._load_version_in_force(versions.in_force())
        if latest is None:
            await self.runner.emit([await self._publish("init", {})])
        else:
            book = credit.outcome_book(self.cfg.sampler.group_size, self.cfg.learner.mask_failed)
            self.core.restore(latest, book, recent.segment_ids())
        await asyncio.to_thread(self.group.started, self.core, latest is not None)

    async def _load_version_in_force(self, in_force: list[PolicyVersion]) -> PolicyVersion | None:
        """Load the newest trusted version whose checkpoint loads, and return it (None: the
        run has none yet). One whose checkpoint is missing, corrupt or non-finite (a
        version announced in the learner's name by someone else, or damage) is skipped,
        logged, and the one before it is tried: an event on the bus must not keep the
        learner from starting. Numbering goes on from the version loaded. If none loads,
        the newest one's error is raised: the checkpoints themselves are gone."""
        newest_error: CheckpointError | None = None
        for version in in_force:
            try:
                await asyncio.to_thread(load_weights, self.policy,
                                        self.roots.checkpoint_of(version),
                                        version.checkpoint_hash)
                return version
            except CheckpointError as exc:
                self.runner.log.error("learner.version_unloadable", version=version.version,
                                      producer=version.producer, error=str(exc))
                newest_error = newest_error or exc
        if newest_error is not None:
            raise newest_error
        return None

    async def on_stop(self) -> None:
        await asyncio.to_thread(self.group.stop)

    async def handle(self, event, record):
        match event:
            case Scored() if not self.core.already_trained(event):
                self.roots.segment(event.address)  # UntrustedAddress: dead-lettered, not kept
                dropped = self.core.add(event, (record.partition, record.offset))
                return [self._dropped(dropped)] if dropped else await self._train_if_ready()
            case RewardFailed():  # withheld, never trained, but it may end its trajectory
                return await self._train_if_ready() if self.core.withheld(event) else []
            case Rollback() if self.core.follows(event):
                await asyncio.to_thread(load_weights, self.policy, self.roots.checkpoint_of(event),
                                        event.checkpoint_hash)
                await asyncio.to_thread(self.group.rolled_back, self.core, event)
                dropped_all = self.core.rollback(event)
                stats = {"keeper/restored_version": float(event.restore_version),
                         "keeper/regressed_version": float(event.regressed_version)}
                return [*map(self._dropped, dropped_all), await self._publish("rollback", stats)]
        return []

    def run_ending(self) -> None:
        self.ending = True

    async def after_batch(self):
        """While the run ends, what was buffered is refused as ``budget-spent`` (as after
        ``learner.max_versions``): counted and committed, not held for an update that will
        not come."""
        return [self._dropped(d) for d in self.core.drop_buffer("budget-spent")] \
            if self.ending else []

    async def _train_if_ready(self) -> list[Emit]:
        if self.ending or not self.core.batch_ready():
            return []
        started = time.monotonic()
        addresses = self.core.buffered_addresses()
        try:
            arrays = await asyncio.to_thread(
                _timed, "storage", lambda: self.segments.read_many(addresses))
        except Exception as exc:  # noqa: BLE001 - corrupt, missing, foreign: refuse those
            if is_retriable(exc):
                raise  # a busy store: the runtime retries
            bad = await asyncio.to_thread(unreadable_segments, self.segments, addresses)
            # read together they fail, alone each reads: none is kept to fail again
            bad = bad or dict.fromkeys(addresses, f"batch read failed: {exc!r}")
            return self._refused(self.core.drop_buffer("unreadable", bad, bad_input=True))
        mismatched = self.core.attach_arrays(arrays)
        if mismatched:  # the rest trains with the next input (as after an unreadable one)
            return self._refused(mismatched)
        outcome = await asyncio.to_thread(_timed, "learner", lambda: self.group.update(self.core))
        if not isinstance(outcome, TrainResult):
            return self._refused(outcome)
        self.train_seconds += time.monotonic() - started
        update = await self._publish("update", outcome.metrics, outcome)
        return [update, *self._critic_resets(outcome.skipped)]

    async def _publish(self, reason: VersionReason, metrics: dict[str, float],
                       update: TrainResult | None = None) -> Emit:
        version, meta = self.core.version + 1, {"run_id": self.cfg.run.run_id, "reason": reason,
                                                "parent": str(self.core.version)}
        ref = await asyncio.to_thread(_timed, "storage", lambda: save_weights(
            self.checkpoints, self.policy, version, meta))
        return Emit(POLICY_VERSION,
                    self.core.publish(reason, ref, self.runner.name, metrics, update))

    def _critic_resets(self, skipped: bool) -> list[Emit]:
        return [Emit(TELEMETRY, e) for e in self.core.critic_reset_events(self.runner.name, skipped)]

    def _refused(self, dropped: list[Dropped]) -> list[Emit]:
        """Refused segments announced, and those that failed on their own (``bad_input``)
        dead-lettered as well: each once, with the reason, then gone from the buffer."""
        out = []
        for d in dropped:
            out.append(self._dropped(d))
            if d.bad_input and d.where is not None:
                partition, offset = d.where
                record = Record(SCORED, partition, offset, d.scored.trajectory_id.encode(),
                                encode(d.scored), d.scored.ts)
                out.append(self.runner.dead_letter(record, d.reason))
        return out

    def _dropped(self, dropped: Dropped) -> Emit:
        """A refused segment, announced: counted by the core, never silently lost."""
        return Emit(TELEMETRY, dropped.event(self.runner.name))

    def commit_floor(self) -> dict[tuple[str, int], int]:
        return {(SCORED, partition): off for partition, off in self.core.commit_floor().items()}

    def stats(self) -> dict[str, float]:
        return {**self.core.stats(), "train_s": self.train_seconds}
