"""The one event-bus interface every backend implements.

A bus is a set of named topics, each split into partitions. Messages are ``(key, value)``
byte pairs; the key chooses the partition (``partition_for``), so all events of one
trajectory stay in order on one partition. Consumers belong to a group: the group's members
split the partitions between them and commit the offset of the *next* record to read, so a
restarted member resumes right after the last committed record. Delivery is at-least-once;
handlers are idempotent by event id.

Offsets are per partition, start at 0 and have no gaps. ``publish`` returns only when the
messages are durable (embedded: the SQLite transaction committed; Kafka: acks from the
broker), which is what lets an actor commit its input offsets afterwards.
"""

from __future__ import annotations

import abc
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import msgspec


class Record(msgspec.Struct, frozen=True, gc=False):
    """A message as read back from the log."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    timestamp: float  # seconds since the epoch, set at publish


@dataclass(frozen=True)
class TopicInfo:
    name: str
    partitions: int
    end_offsets: dict[int, int]  # partition -> offset of the next record to be written


class BusError(Exception):
    """A bus operation failed. ``retriable`` says whether trying again may succeed."""

    def __init__(self, message: str, *, retriable: bool = False):
        super().__init__(message)
        self.retriable = retriable


class BusUnreachable(BusError):
    """The bus could not be reached at start (no broker there, wrong address, refused
    credentials). Commands report it in one line with the fix, not a traceback."""


class MessageTooLarge(BusError):
    def __init__(self, size: int, limit: int):
        super().__init__(
            f"message of {size} bytes exceeds the bus limit of {limit} bytes; keep large "
            "arrays in the segment store and put their address on the bus",
            retriable=False,
        )


def partition_for(key: bytes | None, partitions: int, fallback: int = 0) -> int:
    """Stable key -> partition mapping (CRC32; never Python's salted ``hash``)."""
    if key is None:
        return fallback % partitions
    return zlib.crc32(key) % partitions


TopicPartition = tuple[str, int]


class Consumer(abc.ABC):
    """One member of a consumer group, reading a fixed set of topics."""

    group: str | None  # None: a reader outside any group (replay, tail)
    topics: tuple[str, ...]

    @abc.abstractmethod
    async def fetch(self, max_records: int = 500, timeout: float = 0.5) -> list[Record]:
        """Up to ``max_records`` new records from this member's partitions.

        Waits at most ``timeout`` seconds when there is nothing to read, then returns [].
        """

    @abc.abstractmethod
    async def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Commit ``{(topic, partition): next_offset_to_read}`` for this group."""

    @abc.abstractmethod
    async def seek(self, topic: str, partition: int, offset: int) -> None:
        """Read ``(topic, partition)`` from ``offset`` next (replay)."""

    @abc.abstractmethod
    async def seek_to_time(self, timestamp: float) -> None:
        """Read every assigned partition from the first record at or after ``timestamp``."""

    @abc.abstractmethod
    def assignment(self) -> set[TopicPartition]:
        """Partitions this member currently owns."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Leave the group (its partitions go to the other members)."""


class Bus(abc.ABC):
    """A durable, replayable, partitioned log shared by every actor of a run."""

    url: str
    max_message_bytes: int = 1_000_000

    async def __aenter__(self) -> Bus:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @abc.abstractmethod
    async def start(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    @abc.abstractmethod
    async def create_topics(self, names: Iterable[str], partitions: int = 4) -> None:
        """Create missing topics (existing ones are left as they are)."""

    @abc.abstractmethod
    async def publish(self, topic: str, messages: Sequence[tuple[bytes | None, bytes]]) -> None:
        """Append ``(key, value)`` messages; returns once they are durable."""

    @abc.abstractmethod
    async def consumer(
        self, group: str, topics: Sequence[str], *, from_beginning: bool = True
    ) -> Consumer:
        """Join ``group`` as a new member reading ``topics``.

        Partitions without a committed offset start at the beginning (``from_beginning``)
        or at the end.
        """

    async def reader(self, topics: Sequence[str]) -> Consumer:
        """A consumer of every partition of ``topics`` outside any group (replay, tail).

        It never commits. Backends override this with manual assignment; the fallback joins
        a fresh single-member group.
        """
        import uuid

        return await self.consumer(f"gyre-reader-{uuid.uuid4().hex[:12]}", topics)

    @abc.abstractmethod
    async def topics(self) -> list[TopicInfo]:
        """All topics with their partition count and end offsets."""

    @abc.abstractmethod
    async def committed(self, group: str, topic: str) -> dict[int, int]:
        """Committed next-offset per partition of ``topic`` for ``group`` (absent = none)."""

    #: True when ``publish_and_commit`` writes outputs and offsets in one transaction.
    atomic_commit: bool = False

    async def publish_and_commit(
        self,
        batches: Sequence[tuple[str, Sequence[tuple[bytes | None, bytes]]]],
        consumer: Consumer | None = None,
        offsets: Mapping[TopicPartition, int] | None = None,
    ) -> None:
        """Publish every batch durably, then commit ``offsets`` (at-least-once).

        Backends that can do both in one transaction override this (``atomic_commit``).
        """
        for topic, messages in batches:
            if messages:
                await self.publish(topic, messages)
        if offsets and consumer is not None:
            await consumer.commit(offsets)

    async def lag(self, group: str, topics: Sequence[str]) -> int:
        """Records written but not yet committed by ``group`` across ``topics``."""
        infos = {t.name: t for t in await self.topics()}
        total = 0
        for name in topics:
            info = infos.get(name)
            if info is None:
                continue
            done = await self.committed(group, name)
            total += sum(end - done.get(p, 0) for p, end in info.end_offsets.items())
        return total

    async def groups(self) -> list[str]:
        """Consumer groups known to the bus (backends that cannot list return [])."""
        return []

    def check_size(self, messages: Sequence[tuple[bytes | None, bytes]]) -> None:
        for _key, value in messages:
            if len(value) > self.max_message_bytes:
                raise MessageTooLarge(len(value), self.max_message_bytes)
