"""The Kafka backend of the bus, on aiokafka.

Choices, and why:

- Partitions are chosen here with :func:`partition_for` (CRC32 of the key), not by
  aiokafka's murmur2 partitioner, so a key lands on the same partition number in the
  embedded and the Kafka backend and a run can move between them.
- ``acks="all"`` and, where the broker supports it, the idempotent producer: a publish that
  returns is durable, and a retried batch is not written twice. ``enable_idempotence="auto"``
  first asks the broker for a producer id itself (InitProducerId) and goes without when it
  is refused (Tansu answers UNKNOWN_SERVER_ERROR; noida-db and Apache Kafka grant it).
  ``bus.idempotent`` says which.
- Publish fills one record batch per partition and only then awaits the acks, so a call of
  1000 messages goes out as a few large batches, not 1000 round trips (see ``publish``).
- End offsets are read as the *high watermark of a Fetch response*, not from ListOffsets:
  Tansu answers ListOffsets(latest) with the base offset of the last batch + 1 (e.g. 11 for a
  partition holding 15 records in three batches), while every broker fills the high
  watermark of a Fetch correctly. Tansu also answers a Fetch with max_wait 0 with no data at
  all, hence the 10 ms wait. The same bug would make ``auto_offset_reset="latest"`` start
  inside the last batch, so ``from_beginning=False`` seeks to the high watermark itself.
- Committed offsets are asked for with explicit partitions: Tansu drops the connection on
  the "all partitions of the group" form of OffsetFetch.
- Topic names are checked here against Kafka's rules, because Tansu creates topics with any
  name at all (even ``""``); CreateTopics errors other than TOPIC_ALREADY_EXISTS raise.
  Topics used before being created are created with ``default_partitions``, as the embedded
  bus does (never through broker auto-creation, whose partition count differs).
- Joining a group is bounded by ``join_timeout``: aiokafka waits forever, and noida-db never
  expires a member that died without leaving (it stays group leader and every later
  member's SyncGroup times out, for good), so a stuck join becomes a retriable error.
- Under uvloop a write to a connection the broker closed raised an error aiokafka does not
  catch, which killed its metadata task after a broker restart; ``kafka_compat`` fixes that.
- Closing is bounded by ``close_timeout`` (per client): aiokafka's consumer can wait forever
  in ``stop()`` after a broker restart, and a role must still stop on SIGTERM. Nothing is
  committed on close, so giving up loses nothing.
- A commit for partitions a rebalance moved away is dropped (logged), not raised: their new
  owner resumes from the last commit, and crashing the actor would rebalance again.
- aiokafka errors become :class:`BusError`, ``retriable`` for connection loss, timeouts and
  errors aiokafka itself marks retriable, so the actor runtime retries them with backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import structlog
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.client import AIOKafkaClient
from aiokafka.cluster import ClusterMetadata
from aiokafka.errors import (
    IncompatibleBrokerVersion,
    KafkaError,
    MessageSizeTooLargeError,
    NoError,
    OutOfOrderSequenceNumber,
    UnsupportedVersionError,
    for_code,
)
from aiokafka.helpers import create_ssl_context
from aiokafka.protocol.fetch import FetchRequest
from aiokafka.protocol.offset import OffsetRequest
from aiokafka.protocol.transaction import InitProducerIdRequest
from aiokafka.structs import TopicPartition as KafkaTP

from gyre_async.bus.base import (
    Bus,
    BusError,
    BusUnreachable,
    MessageTooLarge,
    TopicInfo,
    partition_for,
)
from gyre_async.bus.kafka_compat import apply as _apply_aiokafka_fixes
from gyre_async.bus.kafka_errors import RETRIABLE, bus_error, raise_for_code
from gyre_async.bus.kafka_members import KafkaConsumer, KafkaReader

log = structlog.get_logger(__name__)
_apply_aiokafka_fixes()  # uvloop's closed-transport RuntimeError (see kafka_compat.py)

TOPIC_ALREADY_EXISTS = 36
_LEGAL_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")
_SECURITY_KEYS = frozenset({
    "security_protocol", "ssl_cafile", "ssl_certfile", "ssl_keyfile", "ssl_password",
    "sasl_mechanism", "sasl_plain_username", "sasl_plain_password",
})
#: Producer settings, shared with the raw-aiokafka baseline of ops/bench/bus.py. No linger:
#: publish hands over whole batches it built itself, so waiting merges nothing and only adds
#: latency (a 1-message publish on noida: 0.3 ms at linger 0, 5.8 ms at linger 5).
PRODUCER_TUNING: dict[str, Any] = {"linger_ms": 0, "max_batch_size": 256 * 1024}


def check_topic_name(name: str) -> None:
    """Kafka's topic-name rules, enforced client-side so every broker behaves alike."""
    if not _LEGAL_TOPIC.fullmatch(name) or name in (".", ".."):
        raise BusError(
            f"illegal topic name {name!r}: use 1-249 of [A-Za-z0-9._-], not '.' or '..'"
        )


def _as_bool_or_auto(value: bool | str) -> bool | str:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text == "auto":
        return "auto"
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"enable_idempotence must be true, false or auto, not {value!r}")


def client_config(bootstrap: str, client_id: str, security: Mapping[str, str]) -> dict[str, Any]:
    """aiokafka connection settings (bootstrap, TLS context, SASL) from URL-style options."""
    unknown = sorted(set(security) - _SECURITY_KEYS)
    if unknown:
        raise ValueError(
            f"unknown Kafka option(s) {', '.join(unknown)}; "
            f"known: {', '.join(sorted(_SECURITY_KEYS))}"
        )
    protocol = str(security.get("security_protocol", "PLAINTEXT")).upper()
    cfg: dict[str, Any] = {
        "bootstrap_servers": [h.strip() for h in bootstrap.split(",") if h.strip()],
        "client_id": client_id,
        "security_protocol": protocol,
    }
    if protocol in ("SSL", "SASL_SSL"):
        cfg["ssl_context"] = create_ssl_context(
            cafile=security.get("ssl_cafile"),
            certfile=security.get("ssl_certfile"),
            keyfile=security.get("ssl_keyfile"),
            password=security.get("ssl_password"),
        )
    elif any(k.startswith("ssl_") for k in security):
        raise ValueError(f"ssl_* options need security_protocol SSL or SASL_SSL, not {protocol}")
    if protocol.startswith("SASL_"):
        cfg["sasl_mechanism"] = security.get("sasl_mechanism", "PLAIN")
        cfg["sasl_plain_username"] = security.get("sasl_plain_username")
        cfg["sasl_plain_password"] = security.get("sasl_plain_password")
    return cfg


@contextlib.contextmanager
def _bootstrap_errors_raised_not_logged() -> Iterator[None]:
    """aiokafka logs each refused bootstrap connection at ERROR, then raises; the raised
    error becomes :class:`BusUnreachable`, which says the same and how to fix it. So while
    bootstrapping, its ERROR lines are dropped: a command that cannot reach the bus prints
    one line, not two. Nothing else is filtered, nor at any other time."""
    quiet = _BelowCritical()
    logger = logging.getLogger("aiokafka")
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)


class _BelowCritical(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.CRITICAL


class KafkaBus(Bus):
    """A :class:`Bus` on a Kafka-protocol cluster (Apache Kafka, Redpanda, noida-db, Tansu)."""

    def __init__(
        self,
        bootstrap: str,
        *,
        client_id: str = "gyre",
        enable_idempotence: bool | str = "auto",
        max_message_bytes: int | str = 1_000_000,
        replication_factor: int | str = 1,
        isolation_level: str = "read_uncommitted",
        join_timeout: float | str = 60.0,
        close_timeout: float | str = 15.0,
        default_partitions: int | str = 4,
        **security: str,
    ):
        self.bootstrap = bootstrap
        self.url = f"kafka://{bootstrap}"  # never the query: it may hold a password
        self.client_id = client_id
        self.max_message_bytes = int(max_message_bytes)
        self.replication_factor = int(replication_factor)
        # Gyre publishes without Kafka transactions (dedup is by event id), so reading
        # uncommitted data costs nothing and avoids waiting on a last-stable offset.
        self.isolation_level = isolation_level
        self.join_timeout = float(join_timeout)
        self.close_timeout = float(close_timeout)
        self.default_partitions = int(default_partitions)
        self.idempotent: bool | None = None  # known after start()
        self._idempotence = _as_bool_or_auto(enable_idempotence)
        self._client_cfg = client_config(bootstrap, client_id, security)
        self._security_protocol = self._client_cfg["security_protocol"]
        self._producer: AIOKafkaProducer | None = None
        self._admin: AIOKafkaAdminClient | None = None
        self._meta: AIOKafkaClient | None = None
        self._partition_counts: dict[str, int] = {}

    def __repr__(self) -> str:
        return f"KafkaBus({self.bootstrap!r}, security_protocol={self._security_protocol!r})"

    # -- lifecycle -----------------------------------------------------------------------

    def connection_config(self) -> dict[str, Any]:
        """Bootstrap, client id, TLS and SASL settings, as aiokafka clients take them."""
        return dict(self._client_cfg)

    def producer_config(self, *, idempotent: bool) -> dict[str, Any]:
        """Everything AIOKafkaProducer gets (the benchmark's raw baseline reuses it)."""
        return {
            **self._client_cfg,
            **PRODUCER_TUNING,
            "acks": "all",
            "enable_idempotence": idempotent,
            # A batch holds at least one record; leave room for the key and record framing.
            "max_request_size": self.max_message_bytes + 64 * 1024,
        }

    async def start(self) -> None:
        if self._producer is not None:
            return
        try:
            self._meta = AIOKafkaClient(**self._client_cfg)
            with _bootstrap_errors_raised_not_logged():
                await self._meta.bootstrap()
            self._producer = await self._start_producer(self._meta)
            self._admin = AIOKafkaAdminClient(**self._client_cfg)
            await self._admin.start()
        except Exception as exc:
            await self.close()
            if isinstance(exc, BusError):  # already says what is wrong (and how to fix it)
                raise
            detail = str(exc) if str(exc).startswith(type(exc).__name__) else \
                f"{type(exc).__name__}: {exc}"
            raise BusUnreachable(
                f"cannot connect to Kafka at {self.bootstrap}: {detail}; check that the broker "
                "runs and listens there, and that the bus URL (--bus, bus.url or $GYRE_BUS) "
                "names it with the right security settings",
                retriable=bus_error(exc, "").retriable) from exc
        log.info("kafka.started", bootstrap=self.bootstrap, idempotent=self.idempotent,
                 security_protocol=self._security_protocol)

    async def _start_producer(self, meta: AIOKafkaClient) -> AIOKafkaProducer:
        """Start the producer, idempotent if asked or ("auto") if the broker grants it."""
        want = self._idempotence
        if want == "auto":
            want = await self._broker_grants_producer_id(meta)
        producer = AIOKafkaProducer(**self.producer_config(idempotent=bool(want)))
        try:
            await producer.start()
        except KafkaError as exc:
            await producer.stop()
            if want and not (isinstance(exc, RETRIABLE) or exc.retriable):
                raise BusError(
                    f"broker at {self.bootstrap} refused the idempotent producer "
                    f"(enable_idempotence=true): {type(exc).__name__}: {exc}; use "
                    "enable_idempotence=auto or false for this broker"
                ) from exc
            raise
        self.idempotent = bool(want)
        return producer

    async def _broker_grants_producer_id(self, meta: AIOKafkaClient) -> bool:
        """Ask for a producer id (InitProducerId, what an idempotent producer does first).

        Asking ourselves, rather than letting a producer fail, tells a broker that lacks
        the feature (Tansu answers UNKNOWN_SERVER_ERROR) from one that is unreachable, and
        keeps aiokafka from logging a scary error for a plain capability check.
        """
        try:
            response = await meta.send(meta.get_random_node(),
                                       InitProducerIdRequest(None, 60_000))
        except (UnsupportedVersionError, IncompatibleBrokerVersion) as exc:
            log.info("kafka.idempotence_unsupported", bootstrap=self.bootstrap, error=repr(exc))
            return False
        error = for_code(response.error_code)
        if error is NoError:
            return True
        if getattr(error, "retriable", False):
            raise BusError(f"InitProducerId: {error.__name__}", retriable=True)
        log.info("kafka.idempotence_unsupported", bootstrap=self.bootstrap,
                 error=f"InitProducerId answered {response.error_code} {error.__name__}")
        return False

    async def close(self) -> None:
        """Stop every client; the first failure is raised after all were tried."""
        first: BaseException | None = None
        for closer in (self._producer and self._producer.stop,
                       self._admin and self._admin.close, self._meta and self._meta.close):
            if closer is None:
                continue
            try:
                await asyncio.wait_for(closer(), self.close_timeout)
            except TimeoutError:
                log.warning("kafka.client_close_timeout", seconds=self.close_timeout,
                            client=getattr(closer, "__qualname__", repr(closer)))
            except Exception as exc:  # noqa: BLE001 - close the others, then raise it
                first = first or exc
        self._producer = self._admin = self._meta = None
        if first is not None:
            raise bus_error(first, "closing the Kafka bus")

    def _started(self) -> tuple[AIOKafkaProducer, AIOKafkaAdminClient, AIOKafkaClient]:
        if self._producer is None or self._admin is None or self._meta is None:
            raise BusError("KafkaBus is not started: use 'async with bus' or await bus.start()")
        return self._producer, self._admin, self._meta

    # -- topics --------------------------------------------------------------------------

    async def create_topics(self, names: Iterable[str], partitions: int | None = None) -> None:
        _, admin, _ = self._started()
        partitions = self.default_partitions if partitions is None else partitions
        names = list(dict.fromkeys(names))
        for name in names:
            check_topic_name(name)
        if partitions < 1:
            raise BusError(f"a topic needs at least 1 partition, not {partitions}")
        if not names:
            return
        new = [NewTopic(n, partitions, self.replication_factor) for n in names]
        try:
            response = await admin.create_topics(new)
        except KafkaError as exc:
            raise bus_error(exc, f"creating topics {names}") from exc
        # aiokafka returns per-topic error codes instead of raising: check every one.
        for entry in response.topic_errors:
            topic, code = entry[0], entry[1]
            message = entry[2] if len(entry) > 2 else None
            if code in (0, TOPIC_ALREADY_EXISTS):
                continue
            err = for_code(code)
            raise BusError(
                f"cannot create topic {topic!r}: error {code} {err.__name__}"
                + (f": {message}" if message else ""),
                retriable=bool(getattr(err, "retriable", False)),
            )
        await self._wait_for_topics(names)
        log.info("kafka.topics_created", topics=names, partitions=partitions)

    async def _cluster(self) -> ClusterMetadata:
        """Fresh metadata of every topic (the client's own view tracks only some)."""
        _, _, meta = self._started()
        try:
            return await meta.fetch_all_metadata()
        except KafkaError as exc:
            # aiokafka raises a bare KafkaError when no broker answered: worth a retry.
            raise BusError(f"reading metadata from {self.bootstrap}: {exc}",
                           retriable=True) from exc

    async def _wait_for_topics(self, names: list[str]) -> None:
        """Creation is asynchronous in Kafka: wait until metadata lists every partition."""
        deadline = time.monotonic() + self.join_timeout
        while True:
            cluster = await self._cluster()
            missing = [n for n in names if not cluster.partitions_for_topic(n)]
            if not missing:
                return
            if time.monotonic() > deadline:
                raise BusError(f"topics {missing} not in metadata after {self.join_timeout}s",
                               retriable=True)
            await asyncio.sleep(0.1)

    async def _partitions(self, topic: str) -> int:
        """Partition count of ``topic``, cached: keys map to partitions by this count.

        A missing topic is created with ``default_partitions``, as the embedded bus does
        (and explicitly, not through broker auto-creation, whose partition count differs).
        """
        n = self._partition_counts.get(topic)
        if n is None:
            parts = (await self._cluster()).partitions_for_topic(topic)
            if not parts:
                await self.create_topics([topic], self.default_partitions)
                parts = (await self._cluster()).partitions_for_topic(topic)
            n = self._partition_counts[topic] = len(parts)
        return n

    async def topics(self) -> list[TopicInfo]:
        cluster = await self._cluster()
        names = sorted(t for t in cluster.topics() if not t.startswith("__"))
        tps = [KafkaTP(t, p) for t in names for p in sorted(cluster.partitions_for_topic(t) or ())]
        ends = await self.end_offsets(tps, cluster)
        out = []
        for name in names:
            parts = {tp.partition: off for tp, off in ends.items() if tp.topic == name}
            out.append(TopicInfo(name=name, partitions=len(parts), end_offsets=parts))
        return out

    async def end_offsets(
        self, tps: Sequence[KafkaTP], cluster: ClusterMetadata | None = None
    ) -> dict[KafkaTP, int]:
        """Offset of the next record to be written, per partition (see module docstring)."""
        _, _, meta = self._started()
        cluster = cluster or await self._cluster()
        by_leader: dict[int, list[KafkaTP]] = defaultdict(list)
        for tp in tps:
            leader = cluster.leader_for_partition(tp)
            if leader is None or leader < 0:
                raise BusError(f"no leader for {tp.topic}[{tp.partition}]", retriable=True)
            by_leader[leader].append(tp)
        out: dict[KafkaTP, int] = {}
        try:
            for leader, group in by_leader.items():
                out.update(await self._high_watermarks(meta, leader, group))
        except KafkaError as exc:
            raise bus_error(exc, "reading end offsets") from exc
        return out

    async def _high_watermarks(
        self, meta: AIOKafkaClient, node: int, tps: list[KafkaTP]
    ) -> dict[KafkaTP, int]:
        by_topic: dict[str, list[KafkaTP]] = defaultdict(list)
        for tp in tps:
            by_topic[tp.topic].append(tp)
        latest = await meta.send(node, OffsetRequest(
            -1, 0, [(t, [(tp.partition, -1) for tp in group]) for t, group in by_topic.items()]))
        start: dict[KafkaTP, int] = {}
        for topic, parts in latest.topics:
            for part, code, *rest in parts:
                raise_for_code(code, f"ListOffsets {topic}[{part}]")
                start[KafkaTP(topic, part)] = max(0, rest[-1] if rest else 0)
        # Fetch one byte from there: the response carries the true high watermark.
        fetched = await meta.send(node, FetchRequest(
            10, 0, 1, 0,
            [(t, [(tp.partition, start[tp], 1) for tp in group]) for t, group in by_topic.items()]))
        out = {}
        for topic, parts in fetched.topics:
            for part, code, highwater, *_ in parts:
                raise_for_code(code, f"Fetch {topic}[{part}]")
                out[KafkaTP(topic, part)] = highwater
        missing = set(tps) - set(out)
        if missing:
            raise BusError(f"broker gave no high watermark for {sorted(missing)}", retriable=True)
        return out

    # -- publish -------------------------------------------------------------------------

    async def publish(self, topic: str, messages: Sequence[tuple[bytes | None, bytes]]) -> None:
        """Fill one record batch per partition, hand them over, then wait for all acks.

        Building batches here (``create_batch``/``send_batch``) rather than calling
        ``send()`` per message skips aiokafka's per-message coroutine, metadata check and
        future: a 1000-message publish becomes a few appends in C and one await per
        partition. A batch stops growing at ``max_batch_size``; the first record always
        fits, so one message up to ``max_message_bytes`` goes out alone. On an error some
        batches may already be written: a retry can duplicate them (consumers drop
        duplicates by event id).
        """
        if not messages:
            return
        self.check_size(messages)
        producer, _, _ = self._started()
        n = self._partition_counts.get(topic) or await self._partitions(topic)
        builders: dict[int, Any] = {}
        parts: dict[bytes | None, int] = {}  # keys repeat in a batch (a trajectory's steps)
        futures = []
        try:
            for key, value in messages:
                part = parts.get(key)
                if part is None:
                    part = parts[key] = partition_for(key, n)
                builder = builders.get(part)
                if builder is None:
                    builder = builders[part] = producer.create_batch()
                if builder.append(key=key, value=value, timestamp=None) is None:  # full
                    futures.append(await producer.send_batch(builder, topic, partition=part))
                    builder = builders[part] = producer.create_batch()
                    builder.append(key=key, value=value, timestamp=None)
            for part, builder in builders.items():
                futures.append(await producer.send_batch(builder, topic, partition=part))
        except KafkaError as exc:
            _observe(futures)
            raise self._publish_error(exc, topic, messages) from exc
        results = await asyncio.gather(*futures, return_exceptions=True)
        for result in results:
            if isinstance(result, OutOfOrderSequenceNumber):
                await self._replace_producer(result)
                raise BusError(f"publishing to {topic!r}: {result!r}; the producer was "
                               "replaced, retry", retriable=True) from result
            if isinstance(result, BaseException):
                raise self._publish_error(result, topic, messages) from result

    async def _replace_producer(self, why: BaseException) -> None:
        """A broker that lost an idempotent producer's sequence state (noida-db after a
        restart answers OutOfOrderSequenceNumber for good) needs a new producer id: start a
        new producer. The retried batch may duplicate records; consumers drop duplicates
        by event id."""
        old = self._producer
        _, _, meta = self._started()
        self._producer = await self._start_producer(meta)
        log.warning("kafka.producer_replaced", bootstrap=self.bootstrap, error=repr(why))
        if old is not None:
            try:
                await asyncio.wait_for(old.stop(), self.close_timeout)
            except Exception as exc:  # noqa: BLE001 - the old producer is abandoned anyway
                log.info("kafka.old_producer_stop_failed", error=repr(exc))

    def _publish_error(self, exc: BaseException, topic: str,
                       messages: Sequence[tuple[bytes | None, bytes]]) -> BusError:
        if isinstance(exc, MessageSizeTooLargeError):  # the broker's limit is below ours
            return MessageTooLarge(max(len(v) for _, v in messages), self.max_message_bytes)
        return bus_error(exc, f"publishing to {topic!r}")

    # -- consume -------------------------------------------------------------------------

    async def consumer(
        self, group: str, topics: Sequence[str], *, from_beginning: bool = True
    ) -> KafkaConsumer:
        for topic in topics:
            await self._partitions(topic)  # creates missing topics, as the embedded bus does
        member = KafkaConsumer(self, group, tuple(topics), from_beginning=from_beginning)
        await member.start()
        return member

    async def reader(self, topics: Sequence[str]) -> KafkaReader:
        """Every partition of ``topics`` from offset 0, outside any group (replay, tail)."""
        for topic in topics:
            await self._partitions(topic)
        reader = KafkaReader(self, tuple(topics))
        await reader.start()
        return reader

    async def committed(self, group: str, topic: str) -> dict[int, int]:
        _, admin, _ = self._started()
        parts = (await self._cluster()).partitions_for_topic(topic)
        if not parts:
            return {}
        try:
            offsets = await admin.list_consumer_group_offsets(
                group, partitions=[KafkaTP(topic, p) for p in sorted(parts)])
        except KafkaError as exc:
            raise bus_error(exc, f"reading offsets of group {group!r}") from exc
        return {tp.partition: om.offset for tp, om in offsets.items() if om.offset >= 0}

    async def groups(self) -> list[str]:
        _, admin, _ = self._started()
        try:
            return sorted(g[0] for g in await admin.list_consumer_groups())
        except KafkaError as exc:
            raise bus_error(exc, "listing consumer groups") from exc


def _observe(futures: list[asyncio.Future]) -> None:
    """Let batches already handed over finish on their own, without "never retrieved"
    warnings: the caller gets the first error, and a retry re-publishes everything."""
    for future in futures:
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
