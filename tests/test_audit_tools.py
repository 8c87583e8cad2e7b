"""Debugging a finished run: replay audits of real roles, inspect, archive (embedded + Kafka)."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
from conftest import TinyConfig

from gyre_async.audit.archive import archive
from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_topics
from gyre_async.runtime.loop import run_loop
from schemas import decode, encode
from schemas.topics import POLICY_VERSION, SCORED, SEGMENT_CLOSED, TRAJECTORY_STEP

ROOT = Path(__file__).resolve().parents[1]
GYRE = [sys.executable, "-m", "gyre_async.cli"]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    tiny = TinyConfig(tmp_path_factory.mktemp("finished"))
    cfg = tiny.config()
    run_dir = Path(cfg.run.run_dir)
    asyncio.run(run_loop(cfg))
    return run_dir, tiny.write(run_dir / "run.toml")


def gyre(*args, timeout=180):
    return subprocess.run(GYRE + list(args), cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow  # an end-to-end run: the full tier (the fast tier stays under 3 minutes)
def test_replay_arbiter_zero_differences_then_exactly_the_tampered_event(finished_run):
    run_dir, cfg = finished_run
    url = f"sqlite:///{run_dir}/events.db"
    clean = gyre("replay", "arbiter", "--bus", url, "--config", str(cfg), "--json")
    assert clean.returncode == 0, clean.stdout + clean.stderr
    report = json.loads(clean.stdout)
    assert report["differences"] == 0 and report["recorded_outputs"] > 10

    # Tamper with one recorded `scored` event: the audit names exactly that event.
    conn = sqlite3.connect(run_dir / "events.db")
    part, off, value = conn.execute(
        "SELECT part, off, value FROM log WHERE topic=? ORDER BY part, off LIMIT 1 OFFSET 3",
        (SCORED,)).fetchone()
    event = decode(SCORED, value)
    forged = msgspec.structs.replace(event, total=event.total + 1.0)
    conn.execute("UPDATE log SET value=? WHERE topic=? AND part=? AND off=?",
                 (encode(forged), SCORED, part, off))
    conn.commit()
    conn.close()
    dirty = gyre("replay", "arbiter", "--bus", url, "--config", str(cfg), "--json")
    assert dirty.returncode == 1
    report = json.loads(dirty.stdout)
    assert report["differences"] == 1
    assert report["changed"][0]["event_id"] == event.event_id
    assert set(report["changed"][0]["fields"]) == {"total"}
    # put it back for the other tests
    conn = sqlite3.connect(run_dir / "events.db")
    conn.execute("UPDATE log SET value=? WHERE topic=? AND part=? AND off=?",
                 (value, SCORED, part, off))
    conn.commit()
    conn.close()


@pytest.mark.slow  # an end-to-end run: the full tier (the fast tier stays under 3 minutes)
def test_replay_segmenter_reproduces_segments(finished_run):
    run_dir, cfg = finished_run
    out = gyre("replay", "segmenter", "--bus", f"sqlite:///{run_dir}/events.db",
               "--config", str(cfg), "--json")
    report = json.loads(out.stdout)
    # the run drained (its open segments were cut when its input ended, and the replay
    # is told the same): every segment reproduced, none different, none extra
    assert not report["missing"] and not report["changed"], report
    assert not report["extra"] and not report["not_reached"], report


def test_inspect_one_trajectory(finished_run):
    run_dir, cfg = finished_run

    async def first_trajectory():
        async with open_bus(f"sqlite:///{run_dir}/events.db") as bus:
            for r in await read_topics(bus, [SEGMENT_CLOSED]):
                return decode(SEGMENT_CLOSED, r.value).trajectory_id

    tid = asyncio.run(first_trajectory())
    out = gyre("inspect", tid, "--bus", f"sqlite:///{run_dir}/events.db", "--steps", "0")
    assert out.returncode == 0, out.stderr
    assert f"trajectory {tid}" in out.stdout
    assert "segments:" in out.stdout and "total" in out.stdout
    missing = gyre("inspect", "no-such-trajectory", "--bus", f"sqlite:///{run_dir}/events.db")
    assert missing.returncode == 1 and "no events" in missing.stdout


async def _counts(url: str) -> dict[str, int]:
    async with open_bus(url) as bus:
        return {t.name: sum(t.end_offsets.values()) for t in await bus.topics()
                if sum(t.end_offsets.values())}


def test_archive_embedded_run(finished_run, tmp_path):
    run_dir, _ = finished_run
    src = f"sqlite:///{run_dir}/events.db"

    async def go():
        async with open_bus(src) as bus:
            return await archive(bus, str(tmp_path / "events.db"))

    counts = asyncio.run(go())
    assert counts[TRAJECTORY_STEP] > 100
    assert asyncio.run(_counts(f"sqlite:///{tmp_path}/events.db")) == asyncio.run(_counts(src))


@pytest.mark.kafka
def test_archive_from_kafka_then_inspect(finished_run, tmp_path, noida, unique):
    """Copy a run into Kafka, archive it back with `gyre archive`, inspect the archive."""
    run_dir, _ = finished_run
    topics = {TRAJECTORY_STEP: f"{TRAJECTORY_STEP}", SEGMENT_CLOSED: f"{SEGMENT_CLOSED}"}

    async def load_into_kafka():
        async with open_bus(f"sqlite:///{run_dir}/events.db") as src, \
                open_bus(f"kafka://{noida}") as dst:
            records = await read_topics(src, list(topics))
            n = 0
            for topic in topics:
                mine = [(r.key, r.value) for r in records if r.topic == topic][:300]
                await dst.create_topics([f"{topic}-{unique}"], 4)
                await dst.publish(f"{topic}-{unique}", mine)
                n += len(mine)
            return n

    n = asyncio.run(load_into_kafka())
    names = ",".join(f"{t}-{unique}" for t in topics)
    out = gyre("archive", "--bus", f"kafka://{noida}", "--out", str(tmp_path), "--topics", names)
    assert out.returncode == 0, out.stderr
    assert f"archived {n} events" in out.stdout
    archived = asyncio.run(_counts(f"sqlite:///{tmp_path}/events.db"))
    assert sum(archived.values()) == n


@pytest.mark.slow  # an end-to-end run: the full tier (the fast tier stays under 3 minutes)
def test_replay_learner_rederives_every_updates_advantages(finished_run):
    run_dir, cfg = finished_run
    url = f"sqlite:///{run_dir}/events.db"
    out = gyre("replay", "learner", "--bus", url, "--config", str(cfg), "--json")
    report = json.loads(out.stdout)
    assert out.returncode == 0, out.stdout + out.stderr
    assert report["differences"] == 0 and report["replayed_outputs"] >= 3

    # Tamper with the rewards of one trained segment: that update's advantages no longer match.
    async def tamper():
        async with open_bus(url) as bus:
            trained = {sid for r in await read_topics(bus, [POLICY_VERSION])
                       for sid in decode(POLICY_VERSION, r.value).trained_segments}
            for r in await read_topics(bus, [SCORED]):
                event = decode(SCORED, r.value)
                if event.segment_id in trained:
                    return r, event
    record, event = asyncio.run(tamper())
    forged = msgspec.structs.replace(
        event, step_rewards=[x + 0.5 for x in event.step_rewards])
    conn = sqlite3.connect(run_dir / "events.db")
    conn.execute("UPDATE log SET value=? WHERE topic=? AND part=? AND off=?",
                 (encode(forged), SCORED, record.partition, record.offset))
    conn.commit()
    dirty = json.loads(gyre("replay", "learner", "--bus", url, "--config", str(cfg),
                            "--json").stdout)
    conn.execute("UPDATE log SET value=? WHERE topic=? AND part=? AND off=?",
                 (record.value, SCORED, record.partition, record.offset))
    conn.commit()
    conn.close()
    assert dirty["differences"] == 1, dirty


def test_invariants_refuse_a_log_they_cannot_read_and_inspect_counts_it(tmp_path):
    """An audit does not vouch for a partial log (it raises); an inspection shows what it
    can and says how many records it skipped."""
    from gyre_async.audit.inspect_trajectory import collect, render
    from gyre_async.audit.invariants import read_run
    from gyre_async.bus.reading import UndecodableRecord

    async def check():
        async with open_bus(f"sqlite:///{tmp_path}/events.db") as bus:
            await bus.create_topics([TRAJECTORY_STEP], 1)
            await bus.publish(TRAJECTORY_STEP, [(b"t1", b"\xff not an event")])
            with pytest.raises(UndecodableRecord, match="trajectory-step"):
                await read_run(bus, "r")
            return await collect(bus, "t1")

    info = asyncio.run(check())
    assert info["undecodable"] == 1 and info["steps"] == []
    assert "1 undecodable records of the log skipped" in render("t1", info)
