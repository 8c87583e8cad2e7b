"""What only the Kafka backend has to get right, checked against real brokers.

Both PyPI brokers are used (``_noida``, ``_tansu``: the session brokers of conftest.py,
started through ``ops/brokers.py`` or by ``.ci/run``) because they differ exactly where KafkaBus has
to paper over it: Tansu
accepts any topic name, refuses the idempotent producer and answers ListOffsets(latest)
wrongly; noida-db does none of that, but never expires a group member that died without
leaving, which leaves its group stuck for good. So every test uses fresh topic and group
names, and multi-member group tests run on Tansu.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid
from collections import Counter
from pathlib import Path

import pytest

from gyre_async.bus import BusError, MessageTooLarge, open_bus, partition_for
from gyre_async.bus.kafka import KafkaBus

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # `ops` is a folder of scripts, not an installed package

from ops.brokers import free_port, probe_metadata  # noqa: E402

pytestmark = pytest.mark.kafka


@pytest.fixture(scope="session")
def _noida(noida):
    """The session's noida-db broker (tests/conftest.py starts it, or reuses .ci/run's)."""
    return noida


@pytest.fixture(scope="session")
def _tansu(tansu):
    return tansu


@pytest.fixture(params=["noida", pytest.param("tansu", marks=pytest.mark.slow)])
def broker(request) -> tuple[str, str]:
    """(kind, bootstrap) for each broker."""
    return request.param, request.getfixturevalue(f"_{request.param}")


def name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


async def drain(consumer, n: int, timeout: float = 60.0) -> list:
    out: list = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out.extend(await consumer.fetch(500, 0.3))
    return out


# -- topics ------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["bad name!", "", "..", "x" * 250, "t/x"])
async def test_illegal_topic_names_raise_on_every_broker(broker, bad):
    _, bootstrap = broker
    async with KafkaBus(bootstrap) as bus:
        with pytest.raises(BusError) as info:
            await bus.create_topics([bad], 2)
        assert not info.value.retriable
        assert bad not in {t.name for t in await bus.topics()}  # Tansu would have made it


async def test_create_topics_is_idempotent_and_waits_for_metadata(broker):
    _, bootstrap = broker
    topic = name("create")
    async with KafkaBus(bootstrap) as bus:
        await bus.create_topics([topic, topic], 3)
        await bus.create_topics([topic], 5)  # exists: left as it is, no error
        info = {t.name: t for t in await bus.topics()}[topic]
        assert info.partitions == 3 and info.end_offsets == {0: 0, 1: 0, 2: 0}
        with pytest.raises(BusError):
            await bus.create_topics([name("zero")], 0)
        unknown = name("auto")  # publish creates a missing topic with default_partitions
        await bus.publish(unknown, [(b"k", b"v")])
        assert (await _info(bus, unknown)).partitions == bus.default_partitions


async def test_broker_side_create_error_is_raised_with_topic_and_code(_noida):
    # aiokafka's create_topics returns error codes instead of raising; we must not drop them.
    topic = name("rf")
    async with KafkaBus(_noida, replication_factor=3) as bus:  # one broker: cannot replicate
        with pytest.raises(BusError) as info:
            await bus.create_topics([topic], 1)
    assert topic in str(info.value) and "38" in str(info.value)


# -- producer ----------------------------------------------------------------------------


async def test_idempotent_producer_auto_detection(broker):
    kind, bootstrap = broker
    topic = name("idem")
    async with KafkaBus(bootstrap) as bus:
        assert bus.idempotent is (kind == "noida")  # Tansu refuses InitProducerId
        await bus.create_topics([topic], 2)
        await bus.publish(topic, [(b"k", b"v")])
    async with KafkaBus(bootstrap, enable_idempotence="false") as bus:
        assert bus.idempotent is False
        await bus.publish(topic, [(b"k", b"w")])
        assert sum((await _info(bus, topic)).end_offsets.values()) == 2


async def test_forcing_idempotence_on_tansu_fails_clearly(_tansu):
    bus = KafkaBus(_tansu, enable_idempotence=True)
    with pytest.raises(BusError) as info:
        await bus.start()
    assert "idempotent" in str(info.value) and not info.value.retriable


async def test_oversized_message_is_rejected_before_sending(broker):
    _, bootstrap = broker
    topic = name("size")
    async with KafkaBus(bootstrap) as bus:
        await bus.create_topics([topic], 1)
        with pytest.raises(MessageTooLarge):
            await bus.publish(topic, [(b"k", b"small"), (b"k", b"x" * (bus.max_message_bytes + 1))])
        assert (await _info(bus, topic)).end_offsets == {0: 0}  # nothing of the call written
        big = os.urandom(990_000)  # just under the limit: must go through both brokers
        await bus.publish(topic, [(b"k", big)])
        reader = await bus.reader([topic])
        got = await drain(reader, 1)
        await reader.close()
    assert [r.value for r in got] == [big]


# -- offsets -----------------------------------------------------------------------------


async def _info(bus, topic):
    return {t.name: t for t in await bus.topics()}[topic]


async def test_end_offsets_committed_and_lag(broker):
    _, bootstrap = broker
    topic, group = name("offsets"), name("g")
    keys = [f"traj-{i}".encode() for i in range(11)]
    async with KafkaBus(bootstrap) as bus:
        await bus.create_topics([topic], 3)
        sent = []
        for batch in range(5):  # several batches per partition: Tansu's ListOffsets bug case
            msgs = [(keys[(batch + j) % 11], f"{batch}-{j}".encode()) for j in range(37)]
            await bus.publish(topic, msgs)
            sent += msgs
        expected = Counter(partition_for(k, 3) for k, _ in sent)
        assert (await _info(bus, topic)).end_offsets == {p: expected[p] for p in range(3)}

        consumer = await bus.consumer(group, [topic])
        got = await drain(consumer, len(sent))
        assert len(got) == len(sent)
        now = time.time()
        for r in got:  # keys land where partition_for says; timestamps are in seconds
            assert r.partition == partition_for(r.key, 3) and abs(r.timestamp - now) < 120
        half = {(topic, p): n // 2 for p, n in expected.items()}
        await consumer.commit(half)
        assert await bus.committed(group, topic) == {p: n // 2 for p, n in expected.items()}
        assert await bus.lag(group, [topic]) == len(sent) - sum(half.values())
        await consumer.commit({(topic, p): n for p, n in expected.items()})
        assert await bus.lag(group, [topic]) == 0
        assert group in await bus.groups()
        await consumer.close()
        assert await bus.committed(name("never"), topic) == {}


async def test_from_end_and_seek_to_time_use_true_end_offsets(broker):
    _, bootstrap = broker
    topic = name("tail")
    async with KafkaBus(bootstrap) as bus:
        await bus.create_topics([topic], 1)
        for i in range(3):  # three batches: Tansu's ListOffsets says 11, the end is 30
            await bus.publish(topic, [(b"k", f"old-{i}-{j}".encode()) for j in range(10)])
        tail = await bus.consumer(name("g"), [topic], from_beginning=False)
        assert await tail.fetch(100, 0.5) == []
        await bus.publish(topic, [(b"k", b"new-1"), (b"k", b"new-2")])
        got = await drain(tail, 2, timeout=20)
        await asyncio.sleep(0.3)
        got += await tail.fetch(100, 0.3)
        assert [r.value for r in got] == [b"new-1", b"new-2"]
        assert [r.offset for r in got] == [30, 31]

        await tail.seek_to_time(time.time() + 3600)  # nothing that late: go to the end
        assert await tail.fetch(100, 0.5) == []
        await tail.seek_to_time(0)
        assert len(await drain(tail, 32, timeout=20)) == 32
        await tail.close()


async def test_reader_reads_every_partition_without_a_group(broker):
    _, bootstrap = broker
    topic = name("reader")
    async with KafkaBus(bootstrap) as bus:
        await bus.create_topics([topic], 4)
        await bus.publish(topic, [(f"k{i}".encode(), b"v") for i in range(40)])
        groups_before = set(await bus.groups())
        reader = await bus.reader([topic])
        assert reader.assignment() == {(topic, p) for p in range(4)}
        assert len(await drain(reader, 40)) == 40
        with pytest.raises(BusError):
            await reader.commit({(topic, 0): 1})
        await reader.close()
        assert set(await bus.groups()) == groups_before
        missing = name("missing")  # created on first use, as the embedded bus does
        empty = await bus.reader([missing])
        assert empty.assignment() == {(missing, p) for p in range(bus.default_partitions)}
        assert await empty.fetch(10, 0.2) == []
        await empty.close()


# -- groups ------------------------------------------------------------------------------


@pytest.mark.slow
async def test_two_members_split_partitions_and_survivor_takes_over_on_tansu(_tansu):
    topic, group = name("split"), name("g")
    async with KafkaBus(_tansu) as bus:
        await bus.create_topics([topic], 4)
        a = await bus.consumer(group, [topic])
        b = await bus.consumer(group, [topic])
        every = {(topic, p) for p in range(4)}
        deadline = time.monotonic() + 60  # Tansu joins take ~5 s each, a rebalance more
        while time.monotonic() < deadline:
            await asyncio.gather(a.fetch(100, 0.3), b.fetch(100, 0.3))
            sa, sb = a.assignment(), b.assignment()
            if sa and sb and not sa & sb and sa | sb == every:
                break
        assert len(a.assignment()) == len(b.assignment()) == 2
        assert a.assignment() | b.assignment() == every

        await bus.publish(topic, [(f"k{i}".encode(), str(i).encode()) for i in range(200)])
        got_a: list = []
        got_b: list = []
        while len(got_a) + len(got_b) < 200 and time.monotonic() < deadline + 30:
            ra, rb = await asyncio.gather(a.fetch(100, 0.3), b.fetch(100, 0.3))
            got_a += ra
            got_b += rb
        assert {(r.topic, r.partition) for r in got_a} <= a.assignment()
        assert {(r.topic, r.partition) for r in got_b} <= b.assignment()
        assert len(got_a) + len(got_b) == 200
        await a.commit({(r.topic, r.partition): r.offset + 1 for r in got_a})
        await b.commit({(r.topic, r.partition): r.offset + 1 for r in got_b})

        await b.close()  # leaves the group: its partitions move to a
        deadline = time.monotonic() + 60
        while a.assignment() != every and time.monotonic() < deadline:
            await a.fetch(100, 0.3)
        assert a.assignment() == every
        assert await bus.lag(group, [topic]) == 0
        await a.close()


_MEMBER = """
import asyncio, sys
from gyre_async.bus.kafka import KafkaBus

async def main():
    async with KafkaBus(sys.argv[1]) as bus:
        await bus.consumer(sys.argv[2], [sys.argv[3]])
        print("JOINED", flush=True)
        await asyncio.sleep(600)

asyncio.run(main())
"""


@pytest.mark.slow
async def test_join_that_cannot_settle_raises_instead_of_hanging(_noida):
    # noida-db 0.2.3 never expires a member that died without leaving the group, and keeps
    # it as group leader: every later member's SyncGroup waits for it for good. aiokafka
    # would wait forever too; KafkaBus gives up after join_timeout with a retriable error.
    topic, group = name("crash"), name("g")
    async with KafkaBus(_noida, join_timeout=8) as bus:
        await bus.create_topics([topic], 2)
        member = subprocess.Popen([sys.executable, "-c", _MEMBER, _noida, group, topic],
                                  stdout=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            lines = await asyncio.wait_for(asyncio.to_thread(_read_until, member, "JOINED"), 60)
            assert lines[-1].strip() == "JOINED"
        finally:
            member.kill()  # SIGKILL: no LeaveGroup
            member.wait()
        started = time.monotonic()
        with pytest.raises(BusError) as info:
            await bus.consumer(group, [topic])
        assert info.value.retriable and "no assignment" in str(info.value)
        assert time.monotonic() - started < 30


def _read_until(proc: subprocess.Popen, marker: str) -> list[str]:
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.strip() == marker:
            break
    return lines


# -- connection and configuration ---------------------------------------------------------


async def test_unreachable_broker_is_a_retriable_error():
    bus = KafkaBus(f"127.0.0.1:{free_port()}")
    with pytest.raises(BusError) as info:
        await bus.start()
    assert info.value.retriable


def test_url_options_reach_kafka_bus_and_secrets_stay_out_of_reprs():
    bus = open_bus(
        "kafka://h1:9092,h2:9092?security_protocol=SASL_PLAINTEXT&sasl_mechanism=PLAIN"
        "&sasl_plain_username=gyre&sasl_plain_password=s3cret&enable_idempotence=false"
        "&max_message_bytes=2000&client_id=tester"
    )
    assert isinstance(bus, KafkaBus)
    assert bus.max_message_bytes == 2000 and bus.client_id == "tester"
    cfg = bus.connection_config()
    assert cfg["bootstrap_servers"] == ["h1:9092", "h2:9092"]
    assert cfg["sasl_plain_password"] == "s3cret"
    assert "s3cret" not in repr(bus) and "s3cret" not in bus.url
    with pytest.raises(ValueError, match="sasl_plain_pasword"):
        open_bus("kafka://h:9092?sasl_plain_pasword=typo")
    with pytest.raises(ValueError):
        open_bus("kafka://h:9092?enable_idempotence=maybe")


def test_brokers_cli_starts_and_stops_by_pid(tmp_path):
    pidfile = tmp_path / "tansu.json"
    script = str(ROOT / "ops" / "brokers.py")
    started = subprocess.run(
        [sys.executable, script, "start", "tansu", "--data-dir", str(tmp_path), "--pidfile",
         str(pidfile)], capture_output=True, text=True, timeout=60,
    )
    assert started.returncode == 0, started.stderr
    bootstrap = started.stdout.strip()
    host, port = bootstrap.split(":")
    details = json.loads(pidfile.read_text())
    assert details["kind"] == "tansu" and probe_metadata(host, int(port))
    stopped = subprocess.run([sys.executable, script, "stop", "--pidfile", str(pidfile)],
                             capture_output=True, text=True, timeout=60)
    assert stopped.returncode == 0, stopped.stderr
    assert not probe_metadata(host, int(port), timeout=0.5)
    assert not pidfile.exists()
