"""Actor runtime: consume -> decode -> handle -> emit, with the delivery guarantees of Gyre.

An :class:`Actor` is a thin adapter: it declares the topics it ``consumes`` and ``emits``
and turns one decoded event into zero or more output events (``handle``). Everything else
lives here, once, for every role:

- **at-least-once, commit after outputs**: a batch's outputs are published durably before
  the batch's input offsets are committed (on the embedded bus both go in one transaction);
- **idempotency by event id**: outputs carry ids derived from their inputs, and inputs
  already handled in this process are skipped, so redelivery never double-counts;
- **one run per runner**: topic names are shared by every run on a cluster, so an input
  whose ``run_id`` is not the runner's is skipped and counted (``foreign_events``), never
  handled: a second run on the same brokers does not feed on the first one's events;
- **bad input never stops an actor**: undecodable bytes, unknown schema versions, oversized
  events, failing constraints and non-retriable handler errors go to ``dead-letter`` with
  the reason and the original bytes; retriable errors are retried with backoff (bus errors,
  e.g. a restarting broker, for up to ``bus_retry_s``), and if they persist the actor
  crashes loudly so its supervisor restarts it from the committed offset;
- **an output too large for the bus is never a crash loop**: every output is encoded and
  measured against the bus limit as soon as it is made; an input whose handling made one
  goes to ``dead-letter`` instead (``output too large``, with the size and the limit), its
  outputs are dropped and its offset committed; an oversized output of ``after_batch`` or
  ``produce`` (no input of its own) is dead-lettered itself. A broker whose own limit is
  lower than ours (``MessageTooLarge`` at publish) gets the same treatment, largest first;
- **backpressure**: at most ``max_in_flight`` records are fetched per batch, and an actor can
  hold consumption with ``ready()`` (e.g. the learner while it trains);
- **heartbeats** with lag and counters on ``telemetry``; graceful stop on SIGTERM. The lag
  is the committed one (what ``gyre topics`` shows: it includes input an actor handled but
  holds on purpose, see ``commit_floor``); ``unconsumed`` in the stats counts only input
  not handled yet, which is what says whether an actor keeps pace.

Actors that also *produce* on their own (the sampler) override ``produce``: it runs beside
the consume loop and publishes through :meth:`ActorRunner.emit`.
"""

from __future__ import annotations

import asyncio
import collections
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import msgspec
import structlog

from gyre_async import timing
from gyre_async.bus import Bus, Consumer, MessageTooLarge, Record
from gyre_async.bus.base import TopicPartition
from gyre_async.bus.reading import ReadCounts
from gyre_async.errors import is_retriable
from gyre_async.folds.fold import Fold, restore
from schemas import DecodeError, Event, decode, encode, event_id
from schemas.events import DeadLetter, Heartbeat, finite_reading
from schemas.topics import DEAD_LETTER, TELEMETRY

log = structlog.get_logger(__name__)
#: rounds of cancellation a stopping actor's tasks get before they are left behind
STOP_ROUNDS = 3


@dataclass(frozen=True)
class Emit:
    """One output: an event for a topic."""

    topic: str
    event: Event


@dataclass(frozen=True)
class Encoded:
    """One output as the bus will carry it, with the input whose handling made it
    (``None``: made by ``after_batch`` or ``produce``): what goes to ``dead-letter`` in its
    place if the bus refuses it."""

    topic: str
    key: bytes | None
    value: bytes
    event: Event
    source: Record | None


def _tag(event: Event) -> str:
    return str(type(event).__struct_config__.tag)


def _clip(text: str, max_bytes: int) -> str:
    """``text`` cut to at most ``max_bytes`` of UTF-8 (a dead letter must fit the bus)."""
    data = text.encode()
    if len(data) <= max_bytes:
        return text
    return data[: max(max_bytes - 3, 0)].decode(errors="ignore") + "..."


class Actor:
    """Base class of every role. Subclasses set ``role``, ``consumes``, ``emits``."""

    role: ClassVar[str] = "actor"
    consumes: ClassVar[tuple[str, ...]] = ()
    emits: ClassVar[tuple[str, ...]] = ()
    #: topics read back outside the consumer group, neither consumed nor only emitted: the
    #: declared folds' and any follower's (the segmenter's retention follows the learner's
    #: topics). Every topic a role reads is in ``consumes``, ``emits`` or here
    #: (:func:`gyre_async.runtime.topology.inputs`), and the runner refuses a fold that
    #: reads anything else.
    reads: ClassVar[tuple[str, ...]] = ()
    #: at most this many records per batch (outputs are published once per batch): an actor
    #: whose handler takes long (an evaluation) sets 1 so each result goes out when it exists
    max_batch: ClassVar[int | None] = None
    #: every process of the role must read *every* input record (the samplers' policy
    #: versions): each consumes in a group named after itself, ``<run_id>.<name>``, instead
    #: of the role's shared group, which splits partitions between its processes
    group_per_name: ClassVar[bool] = False

    runner: ActorRunner

    def folds(self) -> Sequence[Fold]:
        """The state this actor rebuilds from the log, declared (:mod:`gyre_async.folds.fold`).

        The runner restores them in one read: those without ``restore_on`` before
        :meth:`on_start` (which then reads their state), those with it after
        :meth:`assignment_changed` whenever partitions of those topics are added. Called
        once, when the runner starts; an actor writes no restart reads of its own."""
        return ()

    async def on_start(self) -> None:
        """Called once before consuming, after the declared folds are restored."""

    async def on_stop(self) -> None:
        """Called once after the last batch was committed."""

    async def handle(self, event: Event, record: Record) -> Sequence[Emit]:
        """Turn one input event into outputs. Raise to dead-letter (or retry if retriable)."""
        return ()

    async def after_batch(self) -> Sequence[Emit]:
        """Outputs that depend on a whole batch (published with it, before its commit)."""
        return ()

    async def assignment_changed(self, added: set[TopicPartition],
                                 removed: set[TopicPartition]) -> None:
        """The consumer group moved input partitions to (``added``) or from (``removed``)
        this member: a replica of the role joined or left. Called before the first records
        of an added partition are handled (the first assignment counts as added), so an
        actor whose state is per partition can catch up on what another member did with it,
        and let go of state for partitions that are no longer its own. Folds declared with
        ``restore_on`` are restored right after this returns (:meth:`folds`)."""

    async def ready(self) -> None:
        """Wait here to hold consumption (backpressure); the default never waits."""

    async def produce(self) -> None:
        """Optional source loop run beside consumption; publish with ``self.runner.emit``."""

    def commit_floor(self) -> dict[tuple[str, int], int]:
        """Per-partition offsets the actor still needs re-delivered after a crash.

        Stateful actors that keep partial state in memory (open segments) return the offset
        of the oldest record that state depends on; the runtime never commits past it.
        """
        return {}

    def run_ending(self) -> None:
        """A draining run decided to stop (its sources stopped): start no new work that
        only a continuing run would use (e.g. the learner trains no further update)."""

    def inputs_ended(self) -> None:
        """A draining run says no more input will come (its sources stopped and everything
        upstream is handled): let go of state kept only for input that will never arrive."""

    def settled(self) -> bool:
        """False while consumed input still waits in memory for work that will happen on
        its own (e.g. closed segments waiting for their batched write); a draining run
        waits for it. State held on purpose (open segments, a partial batch) is settled."""
        return True

    def stats(self) -> dict[str, float]:
        """Counters for the heartbeat."""
        return {}


class ActorRunner:
    """Runs one actor against one bus until stopped."""

    def __init__(
        self,
        actor: Actor,
        bus: Bus,
        *,
        run_id: str,
        name: str | None = None,
        group: str | None = None,
        max_in_flight: int = 512,
        heartbeat_s: float = 5.0,
        max_retries: int = 5,
        retry_base_s: float = 0.05,
        fetch_timeout_s: float = 0.2,
        from_beginning: bool = True,
        partitions: int = 4,
        stop_grace_s: float = 2.0,
        bus_retry_s: float = 120.0,
        bus_retry_cap_s: float = 5.0,
    ):
        self.actor = actor
        self.bus = bus
        self.run_id = run_id
        self.name = name or actor.role
        self.group = group or f"{run_id}.{self.name if actor.group_per_name else actor.role}"
        self.max_in_flight = min(max_in_flight, actor.max_batch or max_in_flight)
        self.heartbeat_s = heartbeat_s
        self.max_retries = max_retries
        self.retry_base_s = retry_base_s
        self.fetch_timeout_s = fetch_timeout_s
        self.from_beginning = from_beginning
        self.partitions = partitions
        self.stop_grace_s = stop_grace_s
        self.bus_retry_s = bus_retry_s
        self.bus_retry_cap_s = bus_retry_cap_s
        self.stopping = asyncio.Event()
        self.processed = 0
        self.dead_letters = 0
        self.duplicates = 0
        self.foreign = 0  # events of other runs (topics are shared by every run on a cluster)
        #: ids of events handled, with the partition they came from (duplicates published
        #: twice are skipped; a partition that leaves this member takes its ids with it)
        self._seen: collections.OrderedDict[str, TopicPartition] = collections.OrderedDict()
        self._seen_cap = 200_000
        self._started = time.monotonic()
        self._hb_seq = 0
        self._consumer: Consumer | None = None
        self._held: dict[tuple[str, int], int] = {}  # next offsets held back by the floor
        self._assigned: set[TopicPartition] = set()  # as last told to the actor
        self.reassignments = 0  # times the group moved partitions to or from this member
        #: next offset to consume per partition (fetched *and* handled, outputs published)
        self.position: dict[tuple[str, int], int] = {}
        self.rebuild = ReadCounts()  # what restoring the folds read (undecodable: skipped)
        self._folds: list[Fold] = []
        self._busy = False  # a fetched batch (or an idle pass) whose outputs are not out yet
        self.log = log.bind(run_id=run_id, actor=self.name)
        actor.runner = self

    # -- public ------------------------------------------------------------------------------
    @property
    def assignment(self) -> frozenset[TopicPartition]:
        """The partitions this member owns, as last told to the actor."""
        return frozenset(self._assigned)

    def stop(self) -> None:
        self.stopping.set()

    async def emit(self, outputs: Sequence[Emit]) -> None:
        """Publish outputs now (durable on return); for ``produce`` loops. Retriable bus
        errors are retried like the consume loop's (see ``_publish_with_retry``); an output
        too large for the bus is dead-lettered in its place (see ``_encode``)."""
        await self._publish_fitting(self._encode(outputs, None), None, {})

    async def unconsumed(self) -> int:
        """Records of the consumed topics this actor has not handled yet (end offset minus
        position; the committed offset where it has not fetched a partition yet).

        Unlike the committed lag it leaves out what the actor has handled but holds on
        purpose (``commit_floor``): the measure of whether it keeps pace.
        """
        if not self.actor.consumes:
            return 0
        infos = {t.name: t for t in await self.bus.topics()}
        # partitions another member of the group owns are not this actor's to catch up on
        owned = self._consumer.assignment() if self._consumer is not None else None
        total = 0
        for topic in self.actor.consumes:
            info = infos.get(topic)
            if info is None:
                continue
            committed = await self.bus.committed(self.group, topic)
            for partition, end in info.end_offsets.items():
                if owned and (topic, partition) not in owned:
                    continue
                done = self.position.get((topic, partition), committed.get(partition, 0))
                total += max(end - done, 0)
        return total

    async def caught_up(self) -> bool:
        """Everything published to its topics so far is handled and its outputs are out."""
        return (not self._busy and self.actor.settled()
                and await self.unconsumed() == 0)

    async def sleep(self, seconds: float) -> bool:
        """Stop-aware sleep: returns True if the actor is stopping."""
        try:
            await asyncio.wait_for(self.stopping.wait(), timeout=seconds)
        except TimeoutError:
            return False
        return True

    async def start(self) -> None:
        """Create the actor's topics, restore its declared folds of the whole run (one
        read), then call its ``on_start``: what :meth:`run` does before consuming, and what
        a test of a restart calls alone."""
        await self.bus.create_topics(set(self.actor.consumes) | set(self.actor.emits)
                                     | {DEAD_LETTER, TELEMETRY}, self.partitions)
        self._folds = list(self.actor.folds())
        declared = {*self.actor.consumes, *self.actor.emits, *self.actor.reads}
        undeclared = sorted({t for f in self._folds for t in f.topics} - declared)
        if undeclared:
            raise TypeError(f"{type(self.actor).__name__} folds read {undeclared}, which it "
                            f"does not declare: add them to its `reads`")
        await restore(self.bus, [f for f in self._folds if not f.restore_on],
                      run_id=self.run_id, counts=self.rebuild)
        await self.actor.on_start()

    async def run(self) -> None:
        await self.start()
        self.log.info("actor.started", role=self.actor.role, consumes=self.actor.consumes)
        tasks = [asyncio.create_task(self._heartbeat_loop(), name=f"{self.name}-heartbeat")]
        if type(self.actor).produce is not Actor.produce:
            tasks.append(asyncio.create_task(self._produce(), name=f"{self.name}-produce"))
        if self.actor.consumes:
            tasks.append(asyncio.create_task(self._consume_loop(), name=f"{self.name}-consume"))
        try:
            # Any task failing crashes the actor loudly (a supervisor restarts it).
            stop_wait = asyncio.create_task(self.stopping.wait())
            done, _ = await asyncio.wait(
                [*tasks, stop_wait], return_when=asyncio.FIRST_COMPLETED
            )
            for task in done:
                if task is not stop_wait and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
            self.stopping.set()
            # The consume loop ends after committing its batch; a produce loop gets a
            # grace period to flush, then is cancelled (its ``finally`` still runs).
            _, pending = await asyncio.wait(tasks, timeout=self.stop_grace_s)
            for task in pending:
                task.cancel()
            for task in tasks:
                if not task.cancelled() and task.done() and task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        finally:
            self.stopping.set()
            for task in tasks:
                task.cancel()
            await self._ended(tasks)
            if self._consumer is not None:
                await self._consumer.close()
            await self.actor.on_stop()
            await self._send_heartbeat()
            self.log.info("actor.stopped", processed=self.processed,
                          dead_letters=self.dead_letters)

    # -- internals -----------------------------------------------------------------------------
    async def _ended(self, tasks: list[asyncio.Task]) -> None:
        """Wait for the cancelled ``tasks`` to end, cancelling again those that outlive a
        round of ``max(stop_grace_s, 1)`` seconds: a cancellation can be lost (Python 3.11's
        ``asyncio.wait_for`` drops one that comes as its inner task finishes) and a stop must
        not wait on it for ever. After ``STOP_ROUNDS`` rounds the tasks still running are
        named in the log and left behind: the actor stops anyway."""
        pending = {task for task in tasks if not task.done()}
        for round_ in range(STOP_ROUNDS):
            if round_:
                for task in pending:
                    task.cancel()
            _, pending = await asyncio.wait(pending, timeout=max(self.stop_grace_s, 1.0)) \
                if pending else (set(), set())
        if pending:
            self.log.error("actor.stop_abandoned", tasks=sorted(t.get_name() for t in pending),
                           why=f"still running after {STOP_ROUNDS} rounds of cancellation")
        for task in tasks:  # their errors were raised already, or are moot once stopping
            if task.done() and not task.cancelled():
                task.exception()

    async def _produce(self) -> None:
        await self.actor.produce()
        await self.stopping.wait()

    async def _consume_loop(self) -> None:
        self._consumer = await self.bus.consumer(
            self.group, self.actor.consumes, from_beginning=self.from_beginning
        )
        while not self.stopping.is_set():
            await self.actor.ready()
            records = await self._consumer.fetch(self.max_in_flight, self.fetch_timeout_s)
            await self._follow_assignment()
            # a partition revoked between the fetch and now is another member's: its records
            # are that member's to handle (from its committed offset), and state built from
            # them here would outlive the release the actor just made
            records = [r for r in records if (r.topic, r.partition) in self._assigned]
            self._busy = True  # until this pass's outputs are out (caught_up reads it)
            try:
                await self._handle_batch(records)
            finally:
                self._busy = False

    async def _follow_assignment(self) -> None:
        assert self._consumer is not None
        now = set(self._consumer.assignment())
        if now != self._assigned:
            added, removed = now - self._assigned, self._assigned - now
            self._assigned = now
            self.reassignments += 1
            self.log.info("actor.assignment", added=sorted(added), removed=sorted(removed))
            self._forget_seen(added | removed)
            await self.actor.assignment_changed(added, removed)
            topics = {topic for topic, _ in added}
            again = [f for f in self._folds if topics.intersection(f.restore_on)]
            if again:  # what other members did with the partitions while they had them
                await restore(self.bus, again, run_id=self.run_id, counts=self.rebuild)

    def _forget_seen(self, partitions: set[TopicPartition]) -> None:
        """A partition that moves away or comes (back) is read from its committed offset, as
        after a restart: the actor released what it held for it, so records it handled in
        an earlier ownership are new to it again and must not be skipped as duplicates."""
        if not partitions or not self._seen:
            return
        for eid in [eid for eid, tp in self._seen.items() if tp in partitions]:
            del self._seen[eid]

    async def _handle_batch(self, records: list[Record]) -> None:
        if not records:
            late = self._encode(await self.actor.after_batch(), None)
            if late or self._held:
                # commit what the actor no longer needs now that its state moved on
                await self._publish_with_retry(late, self._apply_floor(dict(self._held)))
            return
        outputs: list[Encoded] = []
        next_offsets: dict[tuple[str, int], int] = {}
        for record in records:
            outputs.extend(await self._process(record))
            next_offsets[(record.topic, record.partition)] = record.offset + 1
        outputs.extend(self._encode(await self.actor.after_batch(), None))
        self._held.update(next_offsets)
        # every held partition, not only this batch's: the floor of one may lift while the
        # batch brought records of others only (e.g. a batched write went out)
        await self._publish_with_retry(outputs, self._apply_floor(dict(self._held)))
        self.position.update(next_offsets)

    def _apply_floor(self, offsets: dict[tuple[str, int], int]) -> dict[tuple[str, int], int]:
        """Never commit past what the actor's in-memory state still needs (commit_floor).

        Offsets held back are remembered and committed once the state lets go of them.
        """
        floor = self.actor.commit_floor()
        owned: set[tuple[str, int]] = (self._consumer.assignment()
                                       if self._consumer is not None else set())
        for tp in [tp for tp in self._held if tp not in owned]:
            del self._held[tp]  # the partition moved to another member: not ours to commit
        out = {tp: min(o, floor.get(tp, o)) for tp, o in offsets.items() if tp in owned}
        for tp, o in list(self._held.items()):
            if floor.get(tp, o) >= o:
                del self._held[tp]  # fully committable now
        return out

    async def _publish_with_retry(self, outputs: list[Encoded], offsets: dict) -> None:
        """Publish, then commit; retriable bus errors (a broker restarting, a rebalance) are
        retried with exponential backoff capped at ``bus_retry_cap_s`` for up to
        ``bus_retry_s`` seconds in all, then the actor crashes for its supervisor."""
        await self._publish_fitting(outputs, self._consumer, offsets)

    async def _publish_fitting(self, outputs: list[Encoded], consumer: Consumer | None,
                               offsets: dict) -> None:
        """Publish (and commit) with retries; a ``MessageTooLarge`` from the bus (a broker
        whose own limit is below ours) refuses the largest output and tries again, so one
        oversized output never blocks the commit of everything else: an output is replaced
        by a dead letter, a dead letter keeps half as much of its original bytes. Each pass
        shrinks the largest, so it ends; a dead letter with no original bytes refused too
        means the broker's limit is far below ``bus.max_message_bytes``: raised."""
        while True:
            batches = self._batches(outputs)
            try:
                await self._retry_bus(
                    lambda b=batches: self.bus.publish_and_commit(b, consumer, offsets))
                return
            except MessageTooLarge as exc:
                outputs = self._refuse_largest(outputs, exc)

    def _refuse_largest(self, outputs: list[Encoded], exc: MessageTooLarge) -> list[Encoded]:
        largest = max(outputs, key=lambda o: len(o.value), default=None)
        if largest is None:
            raise exc
        if isinstance(largest.event, DeadLetter):  # it keeps less of the original bytes
            letter = largest.event
            if not letter.original:
                raise exc  # not even a bare dead letter fits: the broker's limit is far below
            shorter = msgspec.structs.replace(letter,
                                              original=letter.original[:len(letter.original) // 2])
            return ([o for o in outputs if o is not largest]
                    + self._encode([Emit(DEAD_LETTER, shorter)], None))
        reason = (f"output too large: {_tag(largest.event)} event of {len(largest.value)} "
                  f"bytes for {largest.topic!r} refused by the broker, whose own limit is "
                  f"below bus.max_message_bytes ({self.bus.max_message_bytes} bytes)")
        return self._refuse(outputs, largest, reason)

    async def _retry_bus(self, call) -> None:
        deadline = time.monotonic() + self.bus_retry_s
        attempt = 0
        while True:
            try:
                await call()
                return
            except Exception as exc:
                if not is_retriable(exc) or time.monotonic() >= deadline:
                    raise
                delay = min(self.bus_retry_cap_s, self.retry_base_s * 2**attempt)
                self.log.warning("bus.retry", attempt=attempt, retry_in_s=delay,
                                 error=str(exc))
                attempt += 1
                await asyncio.sleep(delay)

    async def _process(self, record: Record) -> list[Encoded]:
        try:
            with timing.timed("codec"):
                event = decode(record.topic, record.value, self.bus.max_message_bytes)
        except DecodeError as exc:
            return self._encode([self.dead_letter(record, exc.reason)], None)
        if event.run_id != self.run_id:  # another run's, on a cluster runs share
            self.foreign += 1
            return []
        if event.event_id in self._seen:
            self.duplicates += 1
            return []
        for attempt in range(self.max_retries + 1):
            try:
                outputs = list(await self.actor.handle(event, record))
                break
            except Exception as exc:  # noqa: BLE001 - routed by `retriable`
                if not is_retriable(exc):
                    self.log.warning("handler.failed", event_id=event.event_id, error=repr(exc))
                    return self._encode([self.dead_letter(record, f"handler error: {exc!r}")],
                                        None)
                if attempt == self.max_retries:
                    raise
                await asyncio.sleep(self.retry_base_s * 2**attempt)
        encoded = self._encode(outputs, record)
        if any(out.source is None for out in encoded):  # an output too large: refused
            return encoded
        self._remember(event.event_id, (record.topic, record.partition))
        self.processed += 1
        return encoded

    def _remember(self, eid: str, where: TopicPartition) -> None:
        self._seen[eid] = where
        if len(self._seen) > self._seen_cap:
            self._seen.popitem(last=False)

    def dead_letter(self, record: Record, reason: str) -> Emit:
        """``record`` to ``dead-letter`` with ``reason`` (and the start of its bytes). Actors
        use it too, for an input they held and whose later processing failed (the learner's
        buffer): refused once, visibly, never kept to fail every later batch."""
        self.dead_letters += 1
        self.log.warning("dead_letter", topic=record.topic, offset=record.offset, reason=reason)
        limit = self.bus.max_message_bytes
        return Emit(
            DEAD_LETTER,
            DeadLetter(
                event_id=event_id("dead-letter", record.topic, record.partition,
                                  record.offset, self.name),
                run_id=self.run_id,
                producer=self.name,
                key=record.key.decode(errors="replace") if record.key else "",
                actor=self.name,
                source_topic=record.topic,
                source_partition=record.partition,
                source_offset=record.offset,
                reason=_clip(reason, max(limit // 8, 128)),
                original=record.value[: limit // 2],
            ),
        )

    def _encode(self, outputs: Sequence[Emit], source: Record | None) -> list[Encoded]:
        """Encode ``outputs`` (made by handling ``source``, or by no input) and refuse any
        the bus would refuse: encoded once, measured here, where it is still known which
        input made them."""
        limit = self.bus.max_message_bytes
        with timing.timed("codec"):
            encoded = [Encoded(out.topic, out.event.key.encode() if out.event.key else None,
                               encode(out.event), out.event, source) for out in outputs]
        for out in [o for o in encoded if len(o.value) > limit]:
            reason = (f"output too large: {_tag(out.event)} event of {len(out.value)} bytes "
                      f"for {out.topic!r} > bus limit {limit} bytes")
            encoded = self._refuse(encoded, out, reason)
            if source is not None:
                break  # the input is dead-lettered: none of its outputs goes out
        return encoded

    def _refuse(self, outputs: list[Encoded], refused: Encoded, reason: str) -> list[Encoded]:
        """``outputs`` without ``refused``, and a dead letter in its place: of the input that
        made it (its other outputs go with it: the input was not handled), or, made by no
        input, of the output itself."""
        self.log.warning("output.too_large", topic=refused.topic, bytes=len(refused.value),
                         limit=self.bus.max_message_bytes)
        if refused.source is not None:
            kept = [o for o in outputs if o.source is not refused.source]
            return kept + self._encode([self.dead_letter(refused.source, reason)], None)
        kept = [o for o in outputs if o is not refused]
        as_record = Record(refused.topic, -1, -1, refused.key, refused.value, time.time())
        letter = self.dead_letter(as_record, reason)
        letter = Emit(DEAD_LETTER, msgspec.structs.replace(
            letter.event, event_id=event_id("dead-letter-output", refused.event.event_id)))
        return kept + self._encode([letter], None)

    def _batches(self, outputs: Sequence[Encoded]) -> list[tuple[str, list]]:
        by_topic: dict[str, list] = {}
        for out in outputs:
            by_topic.setdefault(out.topic, []).append((out.key, out.value))
        return list(by_topic.items())

    async def _heartbeat_loop(self) -> None:
        while not await self.sleep(self.heartbeat_s):
            await self._send_heartbeat()

    async def _send_heartbeat(self) -> None:
        lag = unconsumed = 0
        if self.actor.consumes:
            try:
                lag = await self.bus.lag(self.group, self.actor.consumes)
                unconsumed = await self.unconsumed()
            except Exception as exc:  # noqa: BLE001 - a heartbeat must not kill the actor
                self.log.warning("heartbeat.lag_failed", error=str(exc))
                lag = unconsumed = -1
        self._hb_seq += 1
        stats = {"dead_letters": float(self.dead_letters), "duplicates": float(self.duplicates),
                 "foreign_events": float(self.foreign),
                 "unconsumed": float(unconsumed),
                 "rebuild_skipped": float(self.rebuild.skipped)}
        # a stat with no reading (NaN) is left out, an infinite one capped: heartbeats, like
        # every event, carry finite floats only
        stats.update({k: finite_reading(v) for k, v in self.actor.stats().items()
                      if not math.isnan(v)})
        hb = Heartbeat(
            event_id=event_id("heartbeat", self.run_id, self.name, id(self), self._hb_seq),
            run_id=self.run_id,
            producer=self.name,
            key=self.name,
            actor=self.name,
            role=self.actor.role,
            processed=self.processed,
            lag=max(lag, 0),
            in_flight=0,
            uptime_s=time.monotonic() - self._started,
            stats=stats,
        )
        try:
            await self.bus.publish_and_commit([(TELEMETRY, [(hb.key.encode(), encode(hb))])])
        except Exception as exc:  # noqa: BLE001
            self.log.warning("heartbeat.publish_failed", error=str(exc))
