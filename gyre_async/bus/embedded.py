"""Embedded bus: a durable, replayable, multi-process log in one SQLite file (WAL mode).

Why SQLite: it is everywhere, needs no server, survives ``kill -9`` of any process (WAL with
``synchronous=NORMAL`` loses nothing that a committed transaction wrote when a process dies),
and lets several processes append to and read the same log concurrently. Offsets are
assigned inside one ``BEGIN IMMEDIATE`` transaction per publish, so they are gap-free and
each partition is totally ordered, across processes.

Consumer groups: members register in the ``members`` table and heartbeat on every fetch;
each topic's partitions are split round-robin over the live members (sorted by member id),
so a member that dies stops owning partitions once its session times out. Commits are
monotonic and only accepted for partitions the member owns, so a stale member cannot move
a group backwards. ``publish_and_commit`` writes outputs and input offsets in one
transaction: exactly-once processing for actors on this backend.

All SQLite calls run on one worker thread per connection, keeping the event loop free.
"""

from __future__ import annotations

import asyncio
import os
import sqlite3
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from gyre_async import timing
from gyre_async.bus.base import Bus, BusError, Consumer, Record, TopicInfo, TopicPartition, partition_for

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS topics(name TEXT PRIMARY KEY, partitions INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS heads(topic TEXT, part INTEGER, next_offset INTEGER NOT NULL,
    PRIMARY KEY(topic, part)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS log(topic TEXT, part INTEGER, off INTEGER, key BLOB,
    value BLOB NOT NULL, ts REAL NOT NULL, PRIMARY KEY(topic, part, off)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS commits(grp TEXT, topic TEXT, part INTEGER,
    next_offset INTEGER NOT NULL, PRIMARY KEY(grp, topic, part)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS members(grp TEXT, member TEXT, topics TEXT, heartbeat REAL,
    PRIMARY KEY(grp, member)) WITHOUT ROWID;
"""


#: Every connection's settings: the durability (WAL, synchronous=NORMAL) the module docstring
#: promises. ``ops/bench/bus.py`` opens its raw-SQLite baseline with these same settings.
SQLITE_PRAGMAS = (
    "PRAGMA page_size=32768",
    "PRAGMA journal_mode=WAL",
    "PRAGMA synchronous=NORMAL",
    "PRAGMA busy_timeout=60000",
    "PRAGMA cache_size=-65536",
)


#: how long opening a log waits for another process that holds it locked
CONNECT_BUSY_S = 60.0


def _connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=CONNECT_BUSY_S, isolation_level=None,
                           check_same_thread=False)
    for pragma in SQLITE_PRAGMAS:
        _execute_while_locked(conn, pragma, CONNECT_BUSY_S)
    return conn


def _execute_while_locked(conn: Any, sql: str, budget_s: float) -> Any:
    """``conn.execute(sql)``, again after a short wait while SQLite answers "database is
    locked", for at most ``budget_s``. Why: switching a fresh log to WAL takes an exclusive
    lock, and where another process is opening or recovering the same log at that moment
    SQLite can answer BUSY at once, without the busy timeout (seen in CI: one of three
    processes opening one log failed to start)."""
    deadline = time.monotonic() + budget_s
    delay = 0.005
    while True:
        try:
            return conn.execute(sql)
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 0.25)


def _timed_call(fn: Callable[..., T], args: tuple) -> T:
    with timing.timed("bus"):
        return fn(*args)


class _Worker:
    """One SQLite connection driven by its own thread."""

    def __init__(self, path: str):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gyre-sqlite")
        self.conn: sqlite3.Connection = self._pool.submit(_connect, path).result()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._pool, _timed_call, fn, args)
        except sqlite3.OperationalError as exc:  # locked, disk I/O: may pass
            raise BusError(f"embedded bus: {exc}", retriable=True) from exc

    def close(self) -> None:
        self._pool.submit(self.conn.close).result()
        self._pool.shutdown(wait=True)


class EmbeddedBus(Bus):
    """The default bus: ``sqlite:///runs/x/events.db``."""

    atomic_commit = True

    def __init__(
        self,
        path: str,
        *,
        default_partitions: int = 4,
        session_timeout_s: float = 10.0,
        max_message_bytes: int = 1_000_000,
        poll_interval_s: float = 0.005,
    ):
        self.path = os.path.abspath(path)
        self.url = f"sqlite:///{self.path}"  # absolute path: sqlite:////abs/events.db
        self.default_partitions = default_partitions
        self.session_timeout_s = session_timeout_s
        self.max_message_bytes = max_message_bytes
        self.poll_interval_s = poll_interval_s
        self._worker: _Worker | None = None
        self._partitions: dict[str, int] = {}

    # -- lifecycle ---------------------------------------------------------------------------
    async def start(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self._worker = _Worker(self.path)
        await self._w.run(self._w.conn.executescript, _SCHEMA)

    async def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    @property
    def _w(self) -> _Worker:
        if self._worker is None:
            raise BusError("embedded bus is not started: use `async with bus:` or `await bus.start()`")
        return self._worker

    # -- topics --------------------------------------------------------------------------------
    async def create_topics(self, names: Iterable[str], partitions: int | None = None) -> None:
        n = partitions or self.default_partitions
        names = list(names)

        def create(conn: sqlite3.Connection) -> None:
            conn.execute("BEGIN IMMEDIATE")
            try:
                for name in names:
                    conn.execute("INSERT OR IGNORE INTO topics VALUES (?, ?)", (name, n))
                    row = conn.execute("SELECT partitions FROM topics WHERE name=?", (name,))
                    for p in range(row.fetchone()[0]):
                        conn.execute("INSERT OR IGNORE INTO heads VALUES (?, ?, 0)", (name, p))
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

        await self._w.run(create, self._w.conn)

    async def _partition_count(self, topic: str) -> int:
        n = self._partitions.get(topic)
        if n is None:
            row = await self._w.run(
                lambda: self._w.conn.execute(
                    "SELECT partitions FROM topics WHERE name=?", (topic,)
                ).fetchone()
            )
            if row is None:
                await self.create_topics([topic])
                return await self._partition_count(topic)
            n = self._partitions[topic] = int(row[0])
        return n

    async def topics(self) -> list[TopicInfo]:
        def read(conn: sqlite3.Connection) -> list[TopicInfo]:
            parts = conn.execute("SELECT name, partitions FROM topics ORDER BY name").fetchall()
            heads: dict[str, dict[int, int]] = {}
            for topic, p, nxt in conn.execute("SELECT topic, part, next_offset FROM heads"):
                heads.setdefault(topic, {})[p] = nxt
            return [TopicInfo(name, n, heads.get(name, {})) for name, n in parts]

        return await self._w.run(read, self._w.conn)

    async def committed(self, group: str, topic: str) -> dict[int, int]:
        rows = await self._w.run(
            lambda: self._w.conn.execute(
                "SELECT part, next_offset FROM commits WHERE grp=? AND topic=?", (group, topic)
            ).fetchall()
        )
        return {p: o for p, o in rows}

    async def groups(self) -> list[str]:
        rows = await self._w.run(
            lambda: self._w.conn.execute(
                "SELECT DISTINCT grp FROM commits UNION SELECT DISTINCT grp FROM members"
            ).fetchall()
        )
        return sorted(r[0] for r in rows)

    # -- publish -------------------------------------------------------------------------------
    async def publish(self, topic: str, messages: Sequence[tuple[bytes | None, bytes]]) -> None:
        await self.publish_and_commit([(topic, messages)])

    async def publish_and_commit(
        self,
        batches: Sequence[tuple[str, Sequence[tuple[bytes | None, bytes]]]],
        consumer: Consumer | None = None,
        offsets: Mapping[TopicPartition, int] | None = None,
    ) -> None:
        """Append every batch and commit ``offsets`` for ``consumer``'s group atomically."""
        for _topic, messages in batches:
            self.check_size(messages)
        counts = {topic: await self._partition_count(topic) for topic, _ in batches}
        now = time.time()
        # Partitions and offsets are assigned in one pass on the worker thread (below): the
        # event loop does no per-message work, and no intermediate list is built.
        rows_by_topic = [(topic, counts[topic], messages) for topic, messages in batches]
        commit_rows = []
        if offsets:
            if not isinstance(consumer, EmbeddedConsumer):
                raise BusError("publish_and_commit needs this bus's own consumer")
            commit_rows = consumer._commit_rows(offsets)

        def write(conn: sqlite3.Connection) -> None:
            conn.execute("BEGIN IMMEDIATE")
            try:
                for topic, n, messages in rows_by_topic:
                    heads = dict(
                        conn.execute(
                            "SELECT part, next_offset FROM heads WHERE topic=?", (topic,)
                        ).fetchall()
                    )
                    out = []
                    for i, (k, v) in enumerate(messages):
                        p = partition_for(k, n, i)
                        off = heads[p]
                        heads[p] = off + 1
                        out.append((topic, p, off, k, v, now))
                    conn.executemany("INSERT INTO log VALUES (?, ?, ?, ?, ?, ?)", out)
                    conn.executemany(
                        "UPDATE heads SET next_offset=? WHERE topic=? AND part=?",
                        [(o, topic, p) for p, o in heads.items()],
                    )
                if commit_rows:
                    _upsert_commits(conn, commit_rows)
                conn.execute("COMMIT")
            except BaseException:
                conn.execute("ROLLBACK")
                raise

        if rows_by_topic or commit_rows:
            await self._w.run(write, self._w.conn)

    # -- consume -------------------------------------------------------------------------------
    async def consumer(
        self, group: str, topics: Sequence[str], *, from_beginning: bool = True
    ) -> EmbeddedConsumer:
        for topic in topics:
            await self._partition_count(topic)
        consumer = EmbeddedConsumer(self, group, tuple(topics), from_beginning)
        await consumer._join()
        return consumer

    async def reader(self, topics: Sequence[str]) -> EmbeddedConsumer:
        for topic in topics:
            await self._partition_count(topic)
        consumer = EmbeddedConsumer(self, None, tuple(topics), True)
        await consumer._join()
        return consumer


def _upsert_commits(conn: sqlite3.Connection, rows: list[tuple[str, str, int, int]]) -> None:
    conn.executemany(
        "INSERT INTO commits VALUES (?, ?, ?, ?) ON CONFLICT(grp, topic, part) DO UPDATE "
        "SET next_offset=MAX(next_offset, excluded.next_offset)",
        rows,
    )


class EmbeddedConsumer(Consumer):
    """A group member with its own SQLite connection."""

    def __init__(self, bus: EmbeddedBus, group: str | None, topics: tuple[str, ...], from_beginning: bool):
        self.bus = bus
        self.group = group
        self.topics = topics
        self.from_beginning = from_beginning
        self.member = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._worker = _Worker(bus.path)
        self._positions: dict[TopicPartition, int] = {}
        self._owned: set[TopicPartition] = set()
        self._last_heartbeat = 0.0
        self._rr = 0

    async def _join(self) -> None:
        await self._heartbeat(force=True)

    async def _heartbeat(self, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last_heartbeat < min(1.0, self.bus.session_timeout_s / 4):
            return
        self._last_heartbeat = now
        if self.group is None:  # a reader: every partition, no membership
            owned, positions = await self._worker.run(self._all_partitions)
        else:
            owned, positions = await self._worker.run(self._sync_membership, now)
        self._owned = owned
        for tp in list(self._positions):
            if tp not in owned:
                del self._positions[tp]
        for tp, pos in positions.items():
            self._positions.setdefault(tp, pos)

    def _all_partitions(self) -> tuple[set[TopicPartition], dict[TopicPartition, int]]:
        owned: set[TopicPartition] = set()
        for topic in self.topics:
            row = self._worker.conn.execute(
                "SELECT partitions FROM topics WHERE name=?", (topic,)
            ).fetchone()
            owned.update((topic, p) for p in range(row[0]))
        return owned, {tp: 0 for tp in owned}

    def _sync_membership(self, now: float) -> tuple[set[TopicPartition], dict[TopicPartition, int]]:
        conn = self._worker.conn
        conn.execute(
            "INSERT INTO members VALUES (?, ?, ?, ?) ON CONFLICT(grp, member) DO UPDATE "
            "SET heartbeat=excluded.heartbeat",
            (self.group, self.member, ",".join(self.topics), now),
        )
        cutoff = now - self.bus.session_timeout_s
        members = conn.execute(
            "SELECT member, topics FROM members WHERE grp=? AND heartbeat>=? ORDER BY member",
            (self.group, cutoff),
        ).fetchall()
        owned: set[TopicPartition] = set()
        positions: dict[TopicPartition, int] = {}
        for topic in self.topics:
            subscribers = [m for m, ts in members if topic in ts.split(",")]
            n = conn.execute("SELECT partitions FROM topics WHERE name=?", (topic,)).fetchone()[0]
            me = subscribers.index(self.member)
            for p in range(me, n, len(subscribers)):
                owned.add((topic, p))
                if (topic, p) not in self._positions:
                    row = conn.execute(
                        "SELECT next_offset FROM commits WHERE grp=? AND topic=? AND part=?",
                        (self.group, topic, p),
                    ).fetchone()
                    if row is not None:
                        positions[(topic, p)] = row[0]
                    elif self.from_beginning:
                        positions[(topic, p)] = 0
                    else:
                        positions[(topic, p)] = conn.execute(
                            "SELECT next_offset FROM heads WHERE topic=? AND part=?", (topic, p)
                        ).fetchone()[0]
        return owned, positions

    def assignment(self) -> set[TopicPartition]:
        return set(self._owned)

    async def fetch(self, max_records: int = 500, timeout: float = 0.5) -> list[Record]:
        deadline = time.monotonic() + timeout
        sleep = self.bus.poll_interval_s
        while True:
            await self._heartbeat()
            records = await self._worker.run(self._read, max_records)
            if records or time.monotonic() >= deadline:
                return records
            await asyncio.sleep(min(sleep, max(0.0, deadline - time.monotonic())))
            sleep = min(sleep * 2, 0.05)

    def _read(self, max_records: int) -> list[Record]:
        conn = self._worker.conn
        tps = sorted(self._positions)
        if not tps:
            return []
        self._rr = (self._rr + 1) % len(tps)
        tps = tps[self._rr :] + tps[: self._rr]
        out: list[Record] = []
        conn.execute("BEGIN")  # one snapshot for the whole read
        try:
            heads = {}
            for topic in self.topics:  # cheap: skip partitions with nothing new
                for p, nxt in conn.execute(
                        "SELECT part, next_offset FROM heads WHERE topic=?", (topic,)):
                    heads[(topic, p)] = nxt
            for topic, p in tps:
                if len(out) >= max_records:
                    break
                pos = self._positions[(topic, p)]
                if pos >= heads.get((topic, p), 0):
                    continue
                rows = conn.execute(
                    "SELECT off, key, value, ts FROM log WHERE topic=? AND part=? AND off>=? "
                    "ORDER BY off LIMIT ?",
                    (topic, p, pos, max_records - len(out)),
                ).fetchall()
                if rows:
                    out.extend(Record(topic, p, o, k, v, ts) for o, k, v, ts in rows)
                    self._positions[(topic, p)] = rows[-1][0] + 1
        finally:
            conn.execute("COMMIT")
        return out

    def _commit_rows(self, offsets: Mapping[TopicPartition, int]) -> list[tuple[str, str, int, int]]:
        if self.group is None:
            raise BusError("a reader has no group and cannot commit")
        rows = []
        for (topic, p), nxt in offsets.items():
            if (topic, p) not in self._owned:
                raise BusError(
                    f"commit for {topic}[{p}] refused: partition now owned by another member "
                    "of group " + repr(self.group),
                    retriable=False,
                )
            rows.append((self.group, topic, p, int(nxt)))
        return rows

    async def commit(self, offsets: Mapping[TopicPartition, int]) -> None:
        rows = self._commit_rows(offsets)
        if rows:
            await self._worker.run(_upsert_commits, self._worker.conn, rows)

    async def seek(self, topic: str, partition: int, offset: int) -> None:
        if (topic, partition) not in self._owned:
            raise BusError(f"cannot seek {topic}[{partition}]: not assigned to this member")
        self._positions[(topic, partition)] = offset

    async def seek_to_time(self, timestamp: float) -> None:
        def find(conn: sqlite3.Connection) -> dict[TopicPartition, int]:
            found = {}
            for topic, p in self._owned:
                row = conn.execute(
                    "SELECT MIN(off) FROM log WHERE topic=? AND part=? AND ts>=?",
                    (topic, p, timestamp),
                ).fetchone()
                if row[0] is None:
                    row = conn.execute(
                        "SELECT next_offset FROM heads WHERE topic=? AND part=?", (topic, p)
                    ).fetchone()
                found[(topic, p)] = row[0]
            return found

        self._positions.update(await self._worker.run(find, self._worker.conn))

    async def close(self) -> None:
        if self.group is None:
            self._worker.close()
            return
        try:
            await self._worker.run(
                lambda: self._worker.conn.execute(
                    "DELETE FROM members WHERE grp=? AND member=?", (self.group, self.member)
                )
            )
        finally:
            self._worker.close()
