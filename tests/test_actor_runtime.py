"""Actor runtime through real backends: dead letters, crash recovery, tail and replay."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from actors.echo import EchoActor
from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_topics
from gyre_async.runtime.actor import ActorRunner
from schemas import decode, encode, event_id
from schemas.config import EchoConfig
from schemas.events import Probe
from schemas.topics import DEAD_LETTER, PROBE_IN, PROBE_OUT

ROOT = Path(__file__).resolve().parents[1]


def make_probe(seq: int, payload: str = "p", run_id: str = "t") -> Probe:
    return Probe(event_id=event_id("probe", run_id, seq), run_id=run_id, producer="test",
                 key=f"k{seq % 5}", seq=seq, payload=payload)


async def publish_probes(bus, probes) -> None:
    await bus.publish(PROBE_IN, [(p.key.encode(), encode(p)) for p in probes])


async def run_until(runner: ActorRunner, bus, topic: str, n: int, timeout: float = 60) -> None:
    task = asyncio.create_task(runner.run())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        await asyncio.sleep(0.2)
        count = sum(sum(t.end_offsets.values()) for t in await bus.topics() if t.name == topic)
        if count >= n or task.done():
            break
    runner.stop()
    await task


async def test_bad_input_goes_to_dead_letter_and_actor_keeps_running(bus_url, unique):
    # A producer with a generous limit writes; the actor's bus allows only 4 KiB per event.
    async with open_bus(bus_url) as producer, open_bus(bus_url, max_message_bytes=4096) as bus:
        await producer.create_topics([PROBE_IN, PROBE_OUT, DEAD_LETTER], 2)
        # a shared broker holds other tests' records too: this test's start here
        start = {p: end for t in await producer.topics() if t.name == PROBE_IN
                 for p, end in t.end_offsets.items()}
        good = [make_probe(i, run_id=unique) for i in range(3)]
        newer = msgspec.to_builtins(make_probe(10, run_id=unique))
        newer["schema_version"] = 99
        bad_constraint = msgspec.to_builtins(make_probe(11, run_id=unique))
        bad_constraint["seq"] = -4
        bad = [b"\xc1not msgpack at all " + unique.encode(),
               msgspec.msgpack.encode(newer),
               encode(make_probe(12, payload="x" * 3000, run_id=unique)) + b"y" * 2000,
               msgspec.msgpack.encode(bad_constraint),
               encode(make_probe(13, payload="boom", run_id=unique))]
        await producer.publish(PROBE_IN, [(b"k", value) for value in bad])
        await publish_probes(producer, good)
        runner = ActorRunner(EchoActor(EchoConfig(fail_on_payload="boom")), bus,
                             run_id=unique, group=f"echo-{unique}")
        task = asyncio.create_task(runner.run())
        deadline = time.monotonic() + 60  # every record read (the topic may hold others')
        while time.monotonic() < deadline and not task.done() and (
                runner.processed < 3 or await bus.lag(runner.group, [PROBE_IN]) > 0):
            await asyncio.sleep(0.2)
        runner.stop()
        await task
        outs = [o for r in await read_topics(bus, [PROBE_OUT])
                if (o := decode(PROBE_OUT, r.value)).run_id == unique]
        dead = [d for r in await read_topics(bus, [DEAD_LETTER])
                if (d := decode(DEAD_LETTER, r.value)).run_id == unique
                and d.source_topic == PROBE_IN
                and d.source_offset >= start.get(d.source_partition, 0)]
    assert sorted(o.seq for o in outs) == [0, 1, 2]
    # a shared broker: other tests publish to the same topic meanwhile, and this actor
    # dead-letters their bad records under its own run id too; this test's are the ones whose
    # kept bytes start one of its records. At-least-once: a record read again before its
    # offset was committed is dead-lettered again under the same event id (readers dedupe).
    dead = [d for d in dead if any(value.startswith(d.original) for value in bad)]
    dead = list({d.event_id: d for d in dead}.values())
    reasons = sorted(d.reason for d in dead)
    assert len(dead) == 5, reasons
    assert any(r.startswith("malformed bytes") for r in reasons)
    assert any("unknown schema version 99" in r for r in reasons)
    assert any(r.startswith("oversized event") for r in reasons)
    assert any("seq must be >= 0" in r for r in reasons)
    assert any("handler error" in r and "boom" in r for r in reasons)
    assert all(d.original for d in dead)  # the original bytes are kept


def _write_config(path: Path, run_id: str, delay: float) -> Path:
    path.write_text(f'[run]\nrun_id = "{run_id}"\n[echo]\ndelay_s = {delay}\n')
    return path


def _start_echo(cfg: Path, url: str, log) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "gyre_async.cli", "actor", "echo", "--config", str(cfg),
         "--bus", url], cwd=ROOT, stdout=log, stderr=log,
    )


async def _count(bus, topic) -> int:
    return sum(sum(t.end_offsets.values()) for t in await bus.topics() if t.name == topic)


@pytest.mark.slow
async def test_kill_9_mid_batch_restarts_from_commit_exactly_once(group_bus_url, unique,
                                                                    tmp_path):
    # Kafka side on Tansu: noida-db never expires a member that died without leaving,
    # so a SIGKILLed consumer would hold its group forever there.
    bus_url = group_bus_url
    n = 1500
    cfg = _write_config(tmp_path / "echo.toml", unique, delay=0.002)
    log = open(tmp_path / "echo.log", "w")
    async with open_bus(bus_url) as bus:
        await bus.create_topics([PROBE_IN, PROBE_OUT, DEAD_LETTER, "telemetry"], 4)
        await publish_probes(bus, [make_probe(i, run_id=unique) for i in range(n)])
        proc = _start_echo(cfg, bus_url, log)
        deadline = time.monotonic() + 120
        while await _count(bus, PROBE_OUT) < n // 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)  # mid-batch: it is still working through inputs
        proc.wait()
        killed_at = await _count(bus, PROBE_OUT)
        assert 0 < killed_at < n
        proc = _start_echo(cfg, bus_url, log)
        try:
            ids: set[str] = set()
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                records = await read_topics(bus, [PROBE_OUT])
                outs = [decode(PROBE_OUT, r.value) for r in records]
                ids = {o.event_id for o in outs}
                if len(ids) >= n:
                    break
                await asyncio.sleep(0.5)
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=60) == 0
    # Every input appears exactly once among the outputs, by event id.
    assert len(ids) == n
    assert sorted(o.seq for o in {o.event_id: o for o in outs}.values()) == list(range(n))
    if bus_url.startswith("sqlite"):
        # outputs and offsets commit in one transaction: not even a raw duplicate
        assert len(outs) == n


async def _record_echo_run(url: str, run_id: str, n: int) -> None:
    async with open_bus(url) as bus:
        await bus.create_topics([PROBE_IN, PROBE_OUT], 2)
        await publish_probes(bus, [make_probe(i, run_id=run_id) for i in range(n)])
        runner = ActorRunner(EchoActor(EchoConfig()), bus, run_id=run_id, name="echo")
        await run_until(runner, bus, PROBE_OUT, n)


@pytest.mark.slow  # an end-to-end run: the full tier (the fast tier stays under 3 minutes)
def test_tail_and_replay_on_recorded_log(tmp_path):
    db = tmp_path / "events.db"
    url = f"sqlite:///{db}"
    cfg = _write_config(tmp_path / "echo.toml", "rec", delay=0.0)
    asyncio.run(_record_echo_run(url, "rec", 40))
    gyre = [sys.executable, "-m", "gyre_async.cli"]

    tail = subprocess.run(gyre + ["tail", PROBE_OUT, "--bus", url], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert tail.returncode == 0, tail.stderr
    lines = [json.loads(line) for line in tail.stdout.splitlines()]
    assert len(lines) == 40 and {x["event"]["type"] for x in lines} == {"probe"}
    some = subprocess.run(gyre + ["tail", PROBE_IN, "--bus", url, "--max", "5"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert len(some.stdout.splitlines()) == 5

    clean = subprocess.run(gyre + ["replay", "echo", "--bus", url, "--config", str(cfg)],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert clean.returncode == 0, clean.stdout + clean.stderr
    assert "0 differences" in clean.stdout

    # Tamper with one recorded output: replay names exactly that event.
    conn = sqlite3.connect(db)
    off, part, value = conn.execute(
        "SELECT off, part, value FROM log WHERE topic=? ORDER BY part, off LIMIT 1", (PROBE_OUT,)
    ).fetchone()
    event = msgspec.msgpack.decode(value)
    event["payload"] = "tampered"
    conn.execute("UPDATE log SET value=? WHERE topic=? AND part=? AND off=?",
                 (msgspec.msgpack.encode(event), PROBE_OUT, part, off))
    conn.commit()
    conn.close()
    dirty = subprocess.run(gyre + ["replay", "echo", "--bus", url, "--config", str(cfg),
                                   "--json"], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)
    assert dirty.returncode == 1
    report = json.loads(dirty.stdout)
    assert report["differences"] == 1
    assert report["changed"][0]["event_id"] == event["event_id"]
    assert set(report["changed"][0]["fields"]) == {"payload"}


@pytest.mark.parametrize("bad", ["[run]\nrun_idd = 'x'\n", "[bus]\npartitions = 0\n"])
def test_invalid_config_names_the_field(tmp_path, bad):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(bad)
    out = subprocess.run([sys.executable, "-m", "gyre_async.cli", "topics", "--config", str(cfg)],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert ("run_idd" in out.stderr) or ("bus.partitions" in out.stderr)
