"""Replay audit: re-feed an actor its recorded inputs on a scratch bus, diff its outputs.

Because outputs carry deterministic ids derived from their inputs, a deterministic actor
must reproduce every recorded output under the same id with the same content. The report
lists outputs that are missing, extra, or changed (field by field); timestamps are ignored.
"""

from __future__ import annotations

import asyncio
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import msgspec

from gyre_async.bus import Bus
from gyre_async.bus.embedded import EmbeddedBus
from gyre_async.bus.reading import read_back_limit, read_events, read_topics
from gyre_async.runtime.actor import ActorRunner
from gyre_async.runtime.topology import build_actor
from schemas import to_builtins
from schemas.config import Config
from schemas.topics import TELEMETRY

IGNORED_FIELDS = {"ts"}
T = TypeVar("T")


@dataclass
class ReplayReport:
    role: str
    inputs: int = 0
    recorded_outputs: int = 0
    replayed_outputs: int = 0
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    changed: list[dict[str, Any]] = field(default_factory=list)
    not_reached: list[str] = field(default_factory=list)

    @property
    def differences(self) -> int:
        return len(self.missing) + len(self.extra) + len(self.changed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": self.role, "inputs": self.inputs,
            "recorded_outputs": self.recorded_outputs,
            "replayed_outputs": self.replayed_outputs, "differences": self.differences,
            "missing": self.missing, "extra": self.extra, "changed": self.changed,
            "not_reached": self.not_reached,
        }


async def _outputs_by_id(bus: Bus, topics: list[str], producer: str) -> dict[str, dict]:
    """``producer``'s events on ``topics`` by event id. An undecodable recorded output is
    skipped (and counted): it then shows in the report as a missing output, by its id."""
    out = {}
    async for record, event in read_events(bus, topics, on_bad="skip"):
        if event.producer != producer:
            continue
        body = {k: v for k, v in to_builtins(event).items() if k not in IGNORED_FIELDS}
        out[event.event_id] = {"topic": record.topic, **body}
    return out


def _diff(a: dict, b: dict) -> dict[str, Any]:
    keys = sorted(set(a) | set(b))
    return {k: {"recorded": a.get(k), "replayed": b.get(k)} for k in keys if a.get(k) != b.get(k)}


async def replay(recorded: Bus, role: str, cfg: Config, *, name: str | None = None,
                 settle_s: float = 0.5, timeout_s: float = 600.0) -> ReplayReport:
    """Run a fresh ``role`` over ``recorded``'s inputs; compare with its recorded outputs.

    The learner is audited differently (see :func:`replay_learner`): its advantages are
    re-derived per update instead of retraining.
    """
    if role == "learner":
        return await replay_learner(recorded, cfg)
    name = name or role
    actor = build_actor(role, cfg)
    report = ReplayReport(role=role)
    # a record over the live size limit was dead-lettered live: it is not an input to replay
    limit = read_back_limit(recorded)
    inputs = [r for r in await read_topics(recorded, actor.consumes) if len(r.value) <= limit]
    report.inputs = len(inputs)
    # A run stopped mid-stream leaves inputs its actor never got to; outputs the replay
    # makes from them are "not reached", not differences.
    recorded_lag = await recorded.lag(f"{cfg.run.run_id}.{actor.role}", actor.consumes)
    emitted = [t for t in actor.emits if t != TELEMETRY]
    recorded_out = await _outputs_by_id(recorded, emitted, name)
    partitions = {t.name: t.partitions for t in await recorded.topics()}
    with tempfile.TemporaryDirectory(prefix="gyre-replay-") as tmp:
        async with EmbeddedBus(f"{tmp}/scratch.db", max_message_bytes=limit) as scratch:
            for topic in actor.consumes:
                await scratch.create_topics([topic], partitions.get(topic, 4))
            by_topic: dict[str, list] = {}
            for r in sorted(inputs, key=lambda r: (r.timestamp, r.partition, r.offset)):
                by_topic.setdefault(r.topic, []).append((r.key, r.value))
            for topic, messages in by_topic.items():
                await scratch.publish(topic, messages)
            runner = ActorRunner(actor, scratch, run_id=cfg.run.run_id, name=name,
                                 heartbeat_s=3600)
            task = asyncio.create_task(runner.run())
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s

            async def settle() -> None:
                # Done when everything is committed, or when nothing moves any more (a
                # stateful actor keeps uncommitted the inputs of still-open state, e.g.
                # the segments of trajectories the recorded run left unfinished).
                last, still = None, 0
                while loop.time() < deadline and not task.done():
                    await asyncio.sleep(settle_s)
                    lag = await scratch.lag(runner.group, actor.consumes)
                    progress = (lag, runner.processed, sum(
                        sum(t.end_offsets.values()) for t in await scratch.topics()))
                    still = still + 1 if progress == last else 0
                    last = progress
                    if lag == 0 or still >= 4:
                        await asyncio.sleep(settle_s)
                        return

            await settle()
            if recorded_lag == 0:  # a drained run told the actor its input ended (gyre run)
                actor.inputs_ended()
                await settle()
            runner.stop()
            await task
            replayed = await _outputs_by_id(scratch, emitted, name)
    report.recorded_outputs = len(recorded_out)
    report.replayed_outputs = len(replayed)
    report.missing = sorted(set(recorded_out) - set(replayed))
    extra = sorted(set(replayed) - set(recorded_out))
    if recorded_lag > 0:
        report.not_reached = extra
    else:
        report.extra = extra
    for eid in sorted(set(recorded_out) & set(replayed)):
        diff = _diff(recorded_out[eid], replayed[eid])
        if diff:
            report.changed.append({"event_id": eid, "fields": diff})
    return report


def report_json(report: ReplayReport) -> bytes:
    return msgspec.json.format(msgspec.json.encode(report.to_dict()), indent=2)


def _elite_items(cfg: Config, hashes: list[str], scored: dict, store) -> list | None:
    """The elite segments an update mixed in (content hashes, in its order) as the learner
    trained them: from the run's elite pool, or from their source segment once the pool
    evicted them (the same content: the pool's id is the source's content hash). None when
    one is in neither any more."""
    from gyre_async.core.learner_batch import BatchItem
    from gyre_async.experience.elite import elite_scored, entry_arrays
    from gyre_async.storage.errors import SegmentStoreError
    from gyre_async.storage.segments import SegmentStore

    if not hashes:
        return []
    pool = SegmentStore(cfg.elite.store or f"{cfg.run.run_dir}/elite.zarr", read_only=True)
    sources = {s.content_hash: s for s in scored.values()}
    items = []
    for h in hashes:
        try:
            if pool.contains(h):
                [arrays] = pool.read_many([pool.address(h)])
            elif h in sources:
                [source] = store.read_many([sources[h].address])
                arrays = entry_arrays(sources[h], source)
            else:
                return None
        except SegmentStoreError:
            return None
        items.append(BatchItem(elite_scored(pool.address(h), h, arrays), arrays))
    return items


def _with_threads(threads: int, work: Callable[[], T]) -> T:
    """``work()`` on as many torch intra-op threads as the learner had (0: unrecorded, as
    they are): a reduction split over another number of threads may add up in another order."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        return work()
    finally:
        torch.set_num_threads(before)


async def replay_learner(recorded: Bus, cfg: Config) -> ReplayReport:
    """Re-derive every update's advantages from the log, the store and the parent checkpoint.

    Retraining is not needed to audit the learner's credit assignment: for each published
    update, load the weights it started from, read the segments it says it trained on (in
    its order) with their recorded rewards, recompute values and segment-level GAE, and
    compare the fingerprint with the one the learner recorded (bit for bit: with the same
    forward pass, ``prepare_batch``'s, and as many torch threads as the learner's update
    recorded). The global outcome
    advantages are re-derived from the log too (``gyre_async.folds.credit_log``), and the fusion
    weights the learner recorded per segment are compared with the replayed ones.
    """
    from gyre_async.compose import build_policy, load_weights
    from gyre_async.core.learner_batch import BatchItem, prepare_batch
    from gyre_async.folds.credit_log import read_credit_log, replay_outcome_book
    from gyre_async.rl.fusion import OutcomeBook
    from gyre_async.storage.roots import StorageRoots
    from gyre_async.storage.segments import SegmentNotFound
    from gyre_async.storage.store_set import SegmentStores
    from schemas.events import PolicyVersion
    from schemas.topics import POLICY_VERSION

    report = ReplayReport(role="learner")
    versions: dict[int, PolicyVersion] = {}
    async for _, event in read_events(recorded, [POLICY_VERSION], on_bad="raise"):
        if isinstance(event, PolicyVersion):
            versions[event.version] = event
    scored, all_updates = await read_credit_log(recorded, run_id=cfg.run.run_id)
    updates = [u for u in all_updates if u.advantage_digest]
    report.inputs = len(scored)
    report.recorded_outputs = len(updates)
    roots = StorageRoots.from_config(cfg)
    store = SegmentStores(roots)  # every segmenter's store of the run, as addresses name them
    policy = build_policy(cfg)
    settings = cfg.learner
    book = OutcomeBook(cfg.sampler.group_size, cfg.learner.mask_failed)
    for update, global_adv in replay_outcome_book(book, scored, all_updates):
        if not update.advantage_digest:
            continue
        parent = versions.get(update.parent if update.parent is not None else -1)
        missing = [sid for sid in update.trained_segments if sid not in scored]
        if parent is None or missing:
            report.missing.append(update.event_id)
            continue
        await asyncio.to_thread(load_weights, policy, roots.checkpoint_of(parent),
                                parent.checkpoint_hash)
        segments = [scored[sid] for sid in update.trained_segments]
        try:
            arrays = await asyncio.to_thread(store.read_many, [s.address for s in segments])
        except SegmentNotFound:  # deleted by retention (segmenter.retain_bytes)
            report.missing.append(update.event_id)
            continue
        items = [BatchItem(s, a) for s, a in zip(segments, arrays)]
        elite = await asyncio.to_thread(_elite_items, cfg, update.elite_segments, scored, store)
        if elite is None:  # neither in the pool nor in the segment store any more
            report.missing.append(update.event_id)
            continue
        global_adv = [*global_adv, *[math.nan] * len(elite)]  # none: their own trajectories
        work = partial(prepare_batch, policy, [*items, *elite], settings.gamma, settings.lam,
                       global_adv, settings.credit, settings.fusion_max_weight,
                       settings.mask_failed, silent_groups=settings.fusion_silent_groups)
        prep = await asyncio.to_thread(_with_threads, update.batch_threads, work)
        report.replayed_outputs += 1
        fields: dict[str, dict[str, Any]] = {}
        if prep.digest != update.advantage_digest:
            fields["advantage_digest"] = {"recorded": update.advantage_digest,
                                          "replayed": prep.digest}
        weights = prep.fusion_weights[:len(items)]  # the learner records the trained ones'
        if update.fusion_weights and update.fusion_weights != weights:
            fields["fusion_weights"] = {"recorded": update.fusion_weights, "replayed": weights}
        if fields:
            report.changed.append({"event_id": update.event_id, "version": update.version,
                                   "fields": fields})
    return report
