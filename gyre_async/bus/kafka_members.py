"""Kafka consumers of a :class:`~gyre_async.bus.kafka.KafkaBus`: group members and readers.

See the module docstring of ``gyre_async.bus.kafka`` for what each works around.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener
from aiokafka.errors import KafkaError
from aiokafka.structs import OffsetAndMetadata
from aiokafka.structs import TopicPartition as KafkaTP

from gyre_async.bus.base import BusError, Consumer, Record, TopicPartition
from gyre_async.bus.kafka_errors import bus_error

if TYPE_CHECKING:
    from gyre_async.bus.kafka import KafkaBus

log = structlog.get_logger("gyre_async.bus.kafka")


class _Member(Consumer):
    """What a group member and a group-less reader share: reading, seeking, closing."""

    group: str

    def __init__(self, bus: KafkaBus, topics: tuple[str, ...], **options: Any):
        self.bus = bus
        self.topics = topics
        self.joined = asyncio.Event()  # set while an assignment is in place
        self.failure: BusError | None = None  # raised by fetch (set in a rebalance callback)
        self._consumer = AIOKafkaConsumer(
            **bus.connection_config(),
            enable_auto_commit=False,
            isolation_level=bus.isolation_level,
            max_partition_fetch_bytes=bus.max_message_bytes + 64 * 1024,
            **options,
        )

    async def fetch(self, max_records: int = 500, timeout: float = 0.5) -> list[Record]:
        if self.failure is not None:
            raise self.failure
        try:
            batches = await self._consumer.getmany(timeout_ms=int(timeout * 1000),
                                                   max_records=max_records)
        except KafkaError as exc:
            raise bus_error(exc, f"fetching {list(self.topics)}") from exc
        return [
            Record(r.topic, r.partition, r.offset, r.key, r.value, r.timestamp / 1000)
            for records in batches.values() for r in records
        ]

    async def _wait_joined(self) -> None:
        try:
            await asyncio.wait_for(self.joined.wait(), self.bus.join_timeout)
        except TimeoutError:
            raise BusError(f"no partitions assigned after {self.bus.join_timeout}s "
                           f"(group {self.group!r})", retriable=True) from None

    async def seek(self, topic: str, partition: int, offset: int) -> None:
        await self._wait_joined()
        tp = KafkaTP(topic, partition)
        if tp not in self._consumer.assignment():
            raise BusError(f"cannot seek {topic}[{partition}]: not assigned to this member; "
                           f"it owns {sorted(self.assignment())}")
        self._consumer.seek(tp, offset)

    async def seek_to_time(self, timestamp: float) -> None:
        """Seek each owned partition to its first record at or after ``timestamp``.

        Partitions with no such record go to their end. Tansu answers "none" with offset 0
        and timestamp -1, so a negative timestamp counts as none too.
        """
        await self._wait_joined()
        owned = list(self._consumer.assignment())
        if not owned:
            return
        try:
            found = await self._consumer.offsets_for_times(
                {tp: int(timestamp * 1000) for tp in owned})
        except KafkaError as exc:
            raise bus_error(exc, "looking up offsets by time") from exc
        past_end = [tp for tp in owned if found.get(tp) is None or found[tp].timestamp < 0]
        ends = await self.bus.end_offsets(past_end) if past_end else {}
        for tp in owned:
            self._consumer.seek(tp, ends[tp] if tp in ends else found[tp].offset)

    def assignment(self) -> set[TopicPartition]:
        return {(tp.topic, tp.partition) for tp in self._consumer.assignment()}

    async def close(self) -> None:
        """Leave the group, within ``close_timeout`` seconds.

        Nothing is committed here (commits happen with each published batch), so giving up
        on a close loses nothing: records after the last commit are redelivered. Giving up is
        needed because aiokafka's consumer can wait forever in ``stop()`` once its metadata
        task has died (seen after a broker restart), and a role must still stop on SIGTERM.
        """
        # aiokafka cancels a background task in stop() and awaits it; if that task has not
        # run yet, the CancelledError escapes. Let it start first, and tell that race apart
        # from a real cancellation of the caller.
        await asyncio.sleep(0)
        stop = asyncio.ensure_future(self._consumer.stop())
        try:
            done, _ = await asyncio.wait([stop], timeout=self.bus.close_timeout)
            if not done:
                log.warning("kafka.consumer_close_timeout", group=self.group,
                            seconds=self.bus.close_timeout,
                            metadata_task=_task_state(getattr(self._consumer._client,
                                                              "_sync_task", None)),
                            note="left without LeaveGroup; uncommitted records are "
                                 "redelivered to the next member")
                stop.cancel()
                return
            stop.result()
        except KafkaError as exc:
            raise bus_error(exc, f"closing the consumer of {list(self.topics)}") from exc
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                stop.cancel()
                raise


def _task_state(task: asyncio.Task | None) -> str:
    """``running``, ``absent``, ``cancelled`` or ``died: <exception>`` (for diagnostics)."""
    if task is None:
        return "absent"
    if not task.done():
        return "running"
    if task.cancelled():
        return "cancelled"
    return f"died: {task.exception()!r}" if task.exception() else "finished"


class _Rebalance(ConsumerRebalanceListener):
    """Marks each join, and starts un-committed partitions at the true end if asked.

    aiokafka's own "latest" reset uses ListOffsets, which Tansu gets wrong. aiokafka starts
    fetching as soon as partitions are assigned, before this listener finishes, so the
    partitions stay paused until they point at the right offset. aiokafka logs and drops
    listener exceptions, so a failure is kept and raised by the member's next ``fetch``.
    """

    def __init__(self, member: KafkaConsumer):
        self.member = member

    async def on_partitions_revoked(self, revoked: Any) -> None:
        self.member.joined.clear()
        log.debug("kafka.partitions_revoked", group=self.member.group,
                  partitions=sorted((tp.topic, tp.partition) for tp in revoked))

    async def on_partitions_assigned(self, assigned: Any) -> None:
        member = self.member
        try:
            if not member.from_beginning and assigned:
                await member.start_uncommitted_at_end(list(assigned))
        except Exception as exc:  # noqa: BLE001 - aiokafka would swallow it; fetch raises it
            member.failure = bus_error(exc, f"positioning new partitions of {member.group!r}")
            log.error("kafka.assignment_failed", group=member.group, error=str(exc))
        finally:
            member.joined.set()
        log.debug("kafka.partitions_assigned", group=member.group,
                  partitions=sorted((tp.topic, tp.partition) for tp in assigned))


class KafkaConsumer(_Member):
    """One member of a Kafka consumer group; offsets are committed only by :meth:`commit`."""

    def __init__(self, bus: KafkaBus, group: str, topics: tuple[str, ...], *,
                 from_beginning: bool):
        super().__init__(bus, topics, group_id=group,
                         auto_offset_reset="earliest" if from_beginning else "latest")
        self.group = group
        self.from_beginning = from_beginning

    async def start(self) -> None:
        """Subscribe, join, and return once the first assignment is in place.

        aiokafka would wait for the join forever; a group that cannot settle (noida-db
        keeps a crashed member as group leader for good) raises a retriable error instead.
        """
        try:
            self._consumer.subscribe(list(self.topics), listener=_Rebalance(self))
            await asyncio.wait_for(self._consumer.start(), self.bus.join_timeout)
            await self._wait_joined()
        except (TimeoutError, KafkaError, BusError) as exc:
            await self._consumer.stop()
            if isinstance(exc, asyncio.TimeoutError):
                raise BusError(
                    f"group {self.group!r} gave no assignment within {self.bus.join_timeout}s "
                    "(a member that crashed without leaving can block it until the broker "
                    "expires it; noida-db never does)", retriable=True) from None
            raise bus_error(exc, f"joining group {self.group!r}") from exc

    async def start_uncommitted_at_end(self, assigned: list[KafkaTP]) -> None:
        """Seek partitions without a committed offset to their high watermark."""
        self._consumer.pause(*assigned)  # nothing from the wrong offset reaches fetch()
        for attempt in range(5):
            try:
                committed: set[KafkaTP] = set()
                for topic in {tp.topic for tp in assigned}:
                    parts = await self.bus.committed(self.group, topic)
                    committed.update(KafkaTP(topic, p) for p in parts)
                fresh = [tp for tp in assigned if tp not in committed]
                ends = await self.bus.end_offsets(fresh) if fresh else {}
                break
            except BusError as exc:
                if not exc.retriable or attempt == 4:
                    raise
                await asyncio.sleep(0.2 * 2**attempt)
        for tp, end in ends.items():
            self._consumer.seek(tp, end)
        self._consumer.resume(*assigned)

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Commit offsets of the partitions this member still owns.

        Offsets of partitions a rebalance moved away are dropped and logged, not raised:
        their new owner resumes from the last commit (the at-least-once contract), and an
        error here would crash the actor, whose restart rebalances the group again.
        """
        owned = self._consumer.assignment()
        payload = {}
        for (topic, partition), offset in offsets.items():
            tp = KafkaTP(topic, partition)
            if tp in owned:
                payload[tp] = OffsetAndMetadata(offset, "")
        if len(payload) < len(offsets):
            log.info("kafka.commit_skipped_unowned", group=self.group,
                     partitions=sorted(set(offsets) - {(tp.topic, tp.partition) for tp in payload}))
        if not payload:
            return
        try:
            await self._consumer.commit(payload)
        except KafkaError as exc:
            raise bus_error(exc, f"committing for group {self.group!r}") from exc


class KafkaReader(_Member):
    """Every partition of some topics, by manual assignment: no group, no join, no commits."""

    group = ""

    def __init__(self, bus: KafkaBus, topics: tuple[str, ...]):
        super().__init__(bus, topics, group_id=None, auto_offset_reset="earliest")

    async def start(self) -> None:
        cluster = await self.bus._cluster()
        missing = [t for t in self.topics if not cluster.partitions_for_topic(t)]
        if missing:
            raise BusError(f"cannot read unknown topics {missing}")
        tps = [KafkaTP(t, p) for t in self.topics for p in sorted(cluster.partitions_for_topic(t))]
        try:
            await self._consumer.start()
            self._consumer.assign(tps)
        except KafkaError as exc:
            await self._consumer.stop()
            raise bus_error(exc, f"starting a reader of {list(self.topics)}") from exc
        self.joined.set()

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        raise BusError("a reader has no group and cannot commit")
