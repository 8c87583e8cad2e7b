"""Bus throughput: events published AND consumed per second, per backend.

Each run publishes N real ``trajectory-step`` events (48 context tokens, 3 action tokens,
keyed by 64 trajectory ids, encoded with ``schemas.encode``) in batches, while one consumer
reads them all; the clock runs from the first publish to the last record consumed. Runs:

- ``embedded``: Gyre's SQLite log (``sqlite:///<tmp>/events.db``);
- ``raw_sqlite``: plain ``sqlite3`` with the embedded bus's own settings (its
  ``SQLITE_PRAGMAS``: WAL, ``synchronous=NORMAL``, 32 KiB pages), table layout (a
  ``WITHOUT ROWID`` log keyed by topic, partition, offset; 4 partitions by CRC32 of the key)
  and batching (one ``BEGIN IMMEDIATE`` transaction per batch): a writer thread and a
  reader thread on their own connections, the reader polling partition ranges in one
  snapshot per poll. The ceiling the embedded bus is measured against
  (``embedded_vs_raw_sqlite``; ``embedded_vs_raw_sqlite_cpu`` compares CPU per event,
  which moves far less with the machine's load than a rate does);
- ``raw_sqlite_rowid``: the plainest SQLite queue (one append-only rowid table, no
  partitions or offsets, same settings): what the partitioned layout itself costs
  (``embedded_vs_raw_sqlite_rowid``);
- ``kafka``: Gyre's KafkaBus;
- ``raw_aiokafka``: plain AIOKafkaProducer/AIOKafkaConsumer on the same broker with the
  *same* producer settings, batching exactly as KafkaBus does (one ``create_batch`` per
  partition, ``send_batch``, await the futures) and consuming with ``getmany``: the ceiling
  KafkaBus is measured against. The textbook ``send()``-per-message variant runs too and is
  printed for comparison.

The machine is noisy, so the runs alternate (raw SQLite, embedded, rowid, ...; then raw,
kafka, raw-send, raw, kafka, ...). The JSON gives the median of each and, as
``embedded_vs_raw_sqlite`` and ``kafka_vs_raw``, the medians of the per-round ratios
(neighbouring runs see the same load). A noida-db broker is started
through ``ops/brokers.py`` unless ``--bus kafka://...`` names one, and stopped at the end.
The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sqlite3
import statistics
import sys
import threading
import time
import uuid
import zlib

from _common import SideBySide, alternate_async, ops_script, print_result, scratch_dir
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from gyre_async.bus import open_bus
from gyre_async.bus.embedded import SQLITE_PRAGMAS
from gyre_async.bus.kafka import KafkaBus
from gyre_async.runtime.logs import configure_logging
from schemas import encode, event_id
from schemas.events import TrajectoryStep

PARTITIONS = 4
TRAJECTORIES = 64


def progress(msg: str) -> None:
    print(msg, flush=True)


def make_events(n: int, seed: int = 0) -> list[tuple[bytes, bytes]]:
    """``n`` encoded trajectory steps, round-robin over 64 trajectories, keyed by trajectory."""
    rng = random.Random(seed)
    out = []
    steps = [0] * TRAJECTORIES
    for i in range(n):
        t = i % TRAJECTORIES
        traj = f"traj-{t:04d}-{seed}"
        ev = TrajectoryStep(
            event_id=event_id("bench", traj, steps[t]), run_id="bench-bus",
            producer="rollout-0", key=traj, trajectory_id=traj, task_id=f"task-{t % 8}",
            step_index=steps[t], policy_version=3,
            context_tokens=[rng.randrange(32000) for _ in range(48)],
            action_tokens=[rng.randrange(32000) for _ in range(3)],
            action_logprobs=[-rng.random() * 3 for _ in range(3)],
            action_text="move north", observation_ref=f"obs/{traj}/{steps[t]}",
            feedback=rng.random(), tool_latency_s=0.01,
        )
        steps[t] += 1
        out.append((traj.encode(), encode(ev)))
    return out


def batches(events: list, size: int) -> list[list]:
    return [events[i:i + size] for i in range(0, len(events), size)]


#: CPU seconds of this process during the last timed run (the broker's CPU is not in it).
last_cpu: list[float] = [0.0]


async def _timed(publish_all, consume_all) -> float:
    """Seconds from the first publish to the last record consumed, consumer already ready."""
    t0, c0 = time.perf_counter(), time.process_time()
    consumer = asyncio.ensure_future(consume_all())
    await publish_all()
    await consumer
    last_cpu[0] = time.process_time() - c0
    return time.perf_counter() - t0


async def run_gyre(url: str, events: list, batch: int, fetch: int) -> float:
    """Events/s through Gyre's bus at ``url`` (embedded or Kafka)."""
    topic, group = f"bench-{uuid.uuid4().hex[:8]}", f"bench-{uuid.uuid4().hex[:8]}"
    async with open_bus(url) as bus:
        await bus.create_topics([topic], PARTITIONS)
        consumer = await bus.consumer(group, [topic])
        try:
            async def publish_all() -> None:
                for chunk in batches(events, batch):
                    await bus.publish(topic, chunk)

            async def consume_all() -> None:
                seen = 0
                while seen < len(events):
                    seen += len(await consumer.fetch(fetch, 0.5))

            secs = await _timed(publish_all, consume_all)
        finally:
            await consumer.close()
    return len(events) / secs


#: The raw-SQLite tables: ``log`` is the embedded bus's own layout (a partitioned log with
#: gap-free per-partition offsets, read back by partition ranges); ``rowid`` is the plainest
#: queue SQLite can hold (one append-only rowid table, no partitions), the absolute ceiling.
RAW_SQLITE_LAYOUTS = {
    "log": ("CREATE TABLE log(topic TEXT, part INTEGER, off INTEGER, key BLOB, "
            "value BLOB NOT NULL, ts REAL NOT NULL, PRIMARY KEY(topic, part, off)) WITHOUT ROWID"),
    "rowid": "CREATE TABLE log(id INTEGER PRIMARY KEY, key BLOB, value BLOB NOT NULL, ts REAL NOT NULL)",
}


def _raw_connect(path: str) -> sqlite3.Connection:
    conn = sqlite3.connect(path, timeout=60.0, isolation_level=None, check_same_thread=False)
    for pragma in SQLITE_PRAGMAS:  # the embedded bus's durability and cache settings
        conn.execute(pragma)
    return conn


def run_raw_sqlite(events: list, batch: int, fetch: int, layout: str = "log",
                   poll_s: float = 0.005) -> float:
    """Rows/s through plain ``sqlite3``: one writer thread, one reader thread, own connections.

    The writer appends each batch in one ``BEGIN IMMEDIATE`` transaction (``executemany``),
    as the embedded bus does, with partitions by CRC32 of the key and offsets counted in
    memory (a single writer needs no ``heads`` table). The reader polls its next rows by
    partition range (``layout="log"``) or by rowid, at most ``fetch`` per poll, sleeping
    ``poll_s`` (the bus's poll interval) when there is nothing new. No asyncio, no objects
    per row beyond the fetched tuples: the cost of SQLite itself.
    """
    topic = "bench-raw"
    with scratch_dir("gyre-bench-raw-") as tmp:
        path = f"{tmp}/raw.db"
        writer, reader = _raw_connect(path), _raw_connect(path)
        writer.execute(RAW_SQLITE_LAYOUTS[layout])
        seen = [0]

        def consume_all() -> None:
            if layout == "rowid":
                last = 0
                while seen[0] < len(events):
                    rows = reader.execute("SELECT id, key, value, ts FROM log WHERE id>? "
                                          "ORDER BY id LIMIT ?", (last, fetch)).fetchall()
                    if rows:
                        last = rows[-1][0]
                        seen[0] += len(rows)
                    else:
                        time.sleep(poll_s)
                return
            positions = [0] * PARTITIONS
            first = 0
            while seen[0] < len(events):
                got = 0
                first = (first + 1) % PARTITIONS  # round-robin, so no partition starves
                reader.execute("BEGIN")  # one snapshot per poll
                for p in [*range(first, PARTITIONS), *range(first)]:
                    if got >= fetch:
                        break
                    rows = reader.execute(
                        "SELECT off, key, value, ts FROM log WHERE topic=? AND part=? AND off>=? "
                        "ORDER BY off LIMIT ?", (topic, p, positions[p], fetch - got)).fetchall()
                    if rows:
                        positions[p] = rows[-1][0] + 1
                        got += len(rows)
                reader.execute("COMMIT")
                seen[0] += got
                if not got:
                    time.sleep(poll_s)

        def publish_all() -> None:
            heads = [0] * PARTITIONS
            for chunk in batches(events, batch):
                now = time.time()
                if layout == "rowid":
                    rows = [(key, value, now) for key, value in chunk]
                    sql = "INSERT INTO log(key, value, ts) VALUES (?, ?, ?)"
                else:
                    rows = []
                    for key, value in chunk:
                        p = zlib.crc32(key) % PARTITIONS
                        rows.append((topic, p, heads[p], key, value, now))
                        heads[p] += 1
                    sql = "INSERT INTO log VALUES (?, ?, ?, ?, ?, ?)"
                writer.execute("BEGIN IMMEDIATE")
                writer.executemany(sql, rows)
                writer.execute("COMMIT")

        try:
            consumer = threading.Thread(target=consume_all, name="raw-sqlite-reader")
            t0, c0 = time.perf_counter(), time.process_time()
            consumer.start()
            publish_all()
            consumer.join()
            secs = time.perf_counter() - t0
            last_cpu[0] = time.process_time() - c0
        finally:
            writer.close()
            reader.close()
    return len(events) / secs


async def run_raw(url: str, events: list, batch: int, fetch: int, mode: str = "batch") -> float:
    """Events/s through plain aiokafka, with KafkaBus's producer settings.

    ``mode="batch"`` does what KafkaBus does, by hand: one ``create_batch`` per partition
    (CRC32 of the key), ``send_batch``, await the futures. ``mode="send"`` is the textbook
    way: ``send()`` every message of the batch, then await all futures.
    """
    topic, group = f"bench-{uuid.uuid4().hex[:8]}", f"bench-{uuid.uuid4().hex[:8]}"
    async with open_bus(url) as bus:  # for topic creation and the shared settings only
        assert isinstance(bus, KafkaBus)
        await bus.create_topics([topic], PARTITIONS)
        producer = AIOKafkaProducer(**bus.producer_config(idempotent=bool(bus.idempotent)))
        consumer = AIOKafkaConsumer(
            topic, **bus.connection_config(),
            group_id=group, enable_auto_commit=False, auto_offset_reset="earliest",
        )
        await producer.start()
        await consumer.start()
        try:
            async def publish_batches(chunk: list) -> list:
                builders: dict = {}
                futures = []
                for key, value in chunk:
                    part = zlib.crc32(key) % PARTITIONS
                    b = builders.get(part)
                    if b is None:
                        b = builders[part] = producer.create_batch()
                    if b.append(key=key, value=value, timestamp=None) is None:
                        futures.append(await producer.send_batch(b, topic, partition=part))
                        b = builders[part] = producer.create_batch()
                        b.append(key=key, value=value, timestamp=None)
                for part, b in builders.items():
                    futures.append(await producer.send_batch(b, topic, partition=part))
                return futures

            async def publish_all() -> None:
                for chunk in batches(events, batch):
                    if mode == "batch":
                        futures = await publish_batches(chunk)
                    else:
                        futures = [await producer.send(topic, value, key=key)
                                   for key, value in chunk]
                    await asyncio.gather(*futures)

            async def consume_all() -> None:
                seen = 0
                while seen < len(events):
                    got = await consumer.getmany(timeout_ms=500, max_records=fetch)
                    seen += sum(len(records) for records in got.values())

            secs = await _timed(publish_all, consume_all)
        finally:
            await consumer.stop()
            await producer.stop()
    return len(events) / secs


async def bench(args: argparse.Namespace, kafka_url: str) -> dict:
    progress(f"building {args.events} trajectory-step events ...")
    events = make_events(args.events)
    sizes = [len(v) for _, v in events]
    progress(f"event size: mean {statistics.mean(sizes):.0f} B, "
             f"min {min(sizes)} B, max {max(sizes)} B")
    result: dict = {"bench": "bus", "embedded_eps": None, "raw_sqlite_eps": None,
                    "embedded_vs_raw_sqlite": None, "kafka_eps": None,
                    "raw_aiokafka_eps": None, "kafka_vs_raw": None}

    if "embedded" in args.backends:
        async def embedded() -> float:
            with scratch_dir("gyre-bench-") as tmp:
                return await run_gyre(f"sqlite:///{tmp}/events.db", events, args.batch,
                                      args.fetch)

        def raw_sqlite(layout: str):
            return lambda: asyncio.to_thread(run_raw_sqlite, events, args.batch, args.fetch,
                                             layout)

        cpu = SideBySide()

        def after_run(r: int, label: str, eps: float) -> None:
            cpu_us = last_cpu[0] / args.events * 1e6
            cpu.record(r, label, cpu_us)
            progress(f"round {r + 1}/{args.rounds} {label}: {eps:,.0f} events/s, "
                     f"{cpu_us:.1f} us CPU per event")

        runs = await alternate_async({"raw_sqlite": raw_sqlite("log"), "embedded": embedded,
                                      "raw_sqlite_rowid": raw_sqlite("rowid")},
                                     args.rounds, after_run=after_run)
        # CPU per event barely moves with the machine's load; wall-clock rates do.
        cpu_ratio = cpu.ratio("raw_sqlite", "embedded")
        ratio = runs.ratio("embedded", "raw_sqlite")
        ratio_rowid = runs.ratio("embedded", "raw_sqlite_rowid")
        progress(f"embedded / raw SQLite (same layout), median of per-round ratios: {ratio:.3f};"
                 f" embedded / raw SQLite rowid queue: {ratio_rowid:.3f}; raw / embedded CPU per "
                 f"event (same layout): {cpu_ratio:.3f}")
        result.update(embedded_eps=round(runs.median("embedded")),
                      raw_sqlite_eps=round(runs.median("raw_sqlite")),
                      embedded_vs_raw_sqlite=round(ratio, 3),
                      embedded_vs_raw_sqlite_cpu=round(cpu_ratio, 3),
                      raw_sqlite_rowid_eps=round(runs.median("raw_sqlite_rowid")),
                      embedded_vs_raw_sqlite_rowid=round(ratio_rowid, 3))

    if "kafka" in args.backends:
        def after_kafka_run(r: int, label: str, eps: float) -> None:
            progress(f"round {r + 1}/{args.rounds} {label}: {eps:,.0f} events/s, "
                     f"{last_cpu[0] / args.events * 1e6:.1f} us client CPU per event")

        runs = await alternate_async(
            {"raw": lambda: run_raw(kafka_url, events, args.batch, args.fetch, mode="batch"),
             "kafka": lambda: run_gyre(kafka_url, events, args.batch, args.fetch),
             "raw_send": lambda: run_raw(kafka_url, events, args.batch, args.fetch, mode="send")},
            args.rounds, after_run=after_kafka_run)
        for label in ("raw", "kafka", "raw_send"):
            progress(f"{label}: best {runs.best(label):,.0f}, "
                     f"median {runs.median(label):,.0f} events/s")
        # Neighbouring runs share the machine's load of the moment: compare them pairwise.
        paired = runs.ratio("kafka", "raw")
        progress(f"kafka / raw aiokafka (same batching), median of per-round ratios: "
                 f"{paired:.3f}; kafka / raw send() per message: "
                 f"{runs.ratio('kafka', 'raw_send'):.3f}")
        result.update(kafka_eps=round(runs.median("kafka")),
                      raw_aiokafka_eps=round(runs.median("raw")),
                      kafka_vs_raw=round(paired, 3))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python ops/bench/bus.py",
        description="Bus throughput (events published and consumed per second) for the "
                    "embedded backend against raw SQLite, Gyre's Kafka backend and raw "
                    "aiokafka on the same broker. Prints progress, then one JSON line.",
    )
    parser.add_argument("--events", type=int, default=200_000, help="events per run")
    parser.add_argument("--bus", default=None,
                        help="kafka://host:port of a running broker (default: start noida-db)")
    parser.add_argument("--broker", choices=("noida", "tansu"), default="noida",
                        help="broker to start when --bus is not given")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternations of raw/embedded SQLite and raw/kafka/raw-send() runs "
                             "(medians reported)")
    parser.add_argument("--batch", type=int, default=1000, help="events per publish call")
    parser.add_argument("--fetch", type=int, default=1000, help="max records per fetch")
    parser.add_argument("--backends", default="embedded,kafka",
                        help="comma list of: embedded (includes raw SQLite), kafka (includes raw "
                             "aiokafka)")
    args = parser.parse_args(argv)
    args.backends = set(args.backends.split(","))

    configure_logging("WARNING", json=False)  # progress lines only, no per-join logs
    with scratch_dir("gyre-bench-broker-") as data_dir:
        broker = None
        kafka_url = args.bus
        if kafka_url is None and "kafka" in args.backends:
            broker = ops_script("brokers").start_broker(args.broker, data_dir=data_dir)
            kafka_url = broker.url
            progress(f"started {args.broker} broker at {broker.bootstrap} (pid {broker.pid})")
        try:
            result = asyncio.run(bench(args, kafka_url))
        finally:
            if broker is not None:
                broker.stop()
                progress(f"stopped {args.broker} broker")
    print_result(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
