"""The loop end to end on a small config: invariants read back from the event log and store."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_topics
from gyre_async.config import load_config
from gyre_async.invariants import check_run, read_run
from gyre_async.loop import run_loop
from schemas import decode
from schemas.topics import POLICY_VERSION

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "ops" / "configs" / "tiny.toml"


def tiny_config(run_dir: Path, **run):
    cfg = load_config(TINY)
    return msgspec.structs.replace(
        cfg, run=msgspec.structs.replace(cfg.run, run_dir=str(run_dir), **run))


def run_invariants(url: str, run_dir: Path, max_staleness: int, run_id: str = "tiny",
                   exactly_once: bool = True) -> dict:
    """The shared checker (gyre_async.invariants) over a run; asserts it is clean."""
    async def read():
        async with open_bus(url) as bus:
            return await read_run(bus, run_id)

    report = check_run(asyncio.run(read()), segment_store=str(run_dir / "segments.zarr"),
                       checkpoint_dir=str(run_dir / "checkpoints"),
                       max_staleness=max_staleness)
    assert report.ok, report.describe()
    if exactly_once:  # the embedded bus commits outputs and offsets in one transaction
        assert report.counts["scored_twice_same_result"] == 0
    assert report.counts["versions"] >= 3
    return report.counts


def test_gyre_run_small_config_invariants(tmp_path):
    cfg = tiny_config(tmp_path / "run")
    summary = asyncio.run(run_loop(cfg, progress=False))
    run_dir = tmp_path / "run"
    for name in ("summary.json", "metrics.jsonl", "learning_curve.png", "events.db"):
        assert (run_dir / name).exists(), name
    assert summary["policy_versions"] >= 5
    assert summary["initial_success"] is not None and summary["final_success"] is not None
    counts = run_invariants(f"sqlite:///{run_dir}/events.db", run_dir, cfg.loop.max_staleness)
    assert counts["trained"] > 0


def _spawn(role: str, cfg: Path, url: str, log) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gyre_async.cli", "actor", role,
                             "--config", str(cfg), "--bus", url],
                            cwd=ROOT, stdout=log, stderr=log)


def run_separate_processes(tmp_path: Path, url: str, min_versions: int, timeout: float,
                           run_id: str = "tiny"):
    run_dir = tmp_path / "run"
    cfg_path = tmp_path / "tiny.toml"
    text = TINY.read_text().replace('run_dir = "runs/tiny"', f'run_dir = "{run_dir}"')
    text = text.replace('run_id = "tiny"', f'run_id = "{run_id}"')
    cfg_path.write_text(text.replace("max_versions = 4", "max_versions = 0"))
    log = open(tmp_path / "actors.log", "w")
    procs = [_spawn(role, cfg_path, url, log) for role in
             ("learner", "segmenter", "arbiter", "sampler")]
    versions = 0
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and versions < min_versions:
            time.sleep(2)
            for p in procs:
                assert p.poll() is None, (tmp_path / "actors.log").read_text()[-3000:]
            versions = asyncio.run(_count_versions(url))
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
    assert versions >= min_versions, (tmp_path / "actors.log").read_text()[-3000:]
    return run_dir


async def _count_versions(url: str) -> int:
    async with open_bus(url) as bus:
        infos = {t.name: t for t in await bus.topics()}
        info = infos.get(POLICY_VERSION)
        return sum(info.end_offsets.values()) if info else 0


# One process per role on the embedded bus: tests/test_chaos.py runs it, with every role
# SIGKILLed once and restarted, and checks the same invariants (gyre_async.invariants).


@pytest.mark.kafka
def test_separate_processes_kafka(tmp_path, noida, unique):
    url = f"kafka://{noida}"
    run_dir = run_separate_processes(tmp_path, url, min_versions=3, timeout=240,
                                     run_id=f"tiny-{unique}")
    counts = run_invariants(url, run_dir, max_staleness=2, run_id=f"tiny-{unique}",
                            exactly_once=False)
    assert counts["trained"] > 0


def test_sync_mode_trains_on_current_version_only(tmp_path):
    cfg = tiny_config(tmp_path / "run", mode="sync")
    cfg = msgspec.structs.replace(cfg, learner=msgspec.structs.replace(cfg.learner,
                                                                       max_versions=3))
    asyncio.run(run_loop(cfg, progress=False))
    run_invariants(f"sqlite:///{tmp_path}/run/events.db", tmp_path / "run", max_staleness=0)

    async def read():
        async with open_bus(f"sqlite:///{tmp_path}/run/events.db") as bus:
            return [decode(POLICY_VERSION, r.value) for r in await read_topics(bus, [POLICY_VERSION])]

    versions = asyncio.run(read())
    # sample-then-train: each update saw whole episodes of exactly one version
    for v in versions:
        if v.reason == "update":
            assert v.metrics["charts/max_staleness_seen"] == 0.0
