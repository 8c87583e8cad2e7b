"""The loop end to end on a small config: invariants read back from the event log and store."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import msgspec
import pytest

from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_topics
from gyre_async.config import load_config
from gyre_async.loop import run_loop
from gyre_async.storage.segments import SegmentStore
from schemas import decode
from schemas.events import PolicyVersion, Scored, SegmentClosed, SegmentDropped, TrajectoryStep
from schemas.topics import POLICY_VERSION, SCORED, SEGMENT_CLOSED, TELEMETRY, TRAJECTORY_STEP

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "ops" / "configs" / "tiny.toml"


def tiny_config(run_dir: Path, **run):
    cfg = load_config(TINY)
    return msgspec.structs.replace(
        cfg, run=msgspec.structs.replace(cfg.run, run_dir=str(run_dir), **run))


async def read_events(url: str, topics):
    async with open_bus(url) as bus:
        out = defaultdict(list)
        for record in await read_topics(bus, topics):
            out[record.topic].append((record, decode(record.topic, record.value, 1 << 40)))
        committed = {"learner": await bus.committed("tiny.learner", SCORED),
                     "arbiter": await bus.committed("tiny.arbiter", SEGMENT_CLOSED),
                     "segmenter": await bus.committed("tiny.segmenter", TRAJECTORY_STEP)}
        return out, committed


def check_invariants(events, committed, run_dir: Path, max_staleness: int) -> dict:
    steps = [e for _, e in events[TRAJECTORY_STEP] if isinstance(e, TrajectoryStep)]
    # steps the segmenter consumed (it commits nothing an open segment still needs)
    segmented = [e for r, e in events[TRAJECTORY_STEP] if isinstance(e, TrajectoryStep)
                 and r.offset < committed["segmenter"].get(r.partition, 0)]
    segments = [e for _, e in events[SEGMENT_CLOSED] if isinstance(e, SegmentClosed)]
    scored = [(r, e) for r, e in events[SCORED] if isinstance(e, Scored)]
    versions = sorted((e for _, e in events[POLICY_VERSION] if isinstance(e, PolicyVersion)),
                      key=lambda v: v.version)
    dropped = [e for _, e in events[TELEMETRY] if isinstance(e, SegmentDropped)]

    # Policy versions advance, one by one.
    assert [v.version for v in versions] == list(range(len(versions)))
    assert len(versions) >= 3

    # Every step lands in exactly one segment (steps of open segments at shutdown: none).
    covered: dict[str, list[int]] = defaultdict(list)
    for seg in segments:
        covered[seg.trajectory_id] += list(range(seg.step_start, seg.step_end))
    by_traj: dict[str, list[int]] = defaultdict(list)
    for s in steps:
        by_traj[s.trajectory_id].append(s.step_index)
    for tid, idx in covered.items():
        assert sorted(idx) == sorted(set(idx)), f"step in two segments of {tid}"
        assert set(idx) <= set(by_traj[tid])
    for tid, idx in by_traj.items():
        assert len(idx) == len(set(idx)), f"step published twice in {tid}"
    for s in segmented:
        assert s.step_index in covered[s.trajectory_id], f"consumed step not segmented: {s}"

    # Every segment is in the store with its hash, and scored exactly once.
    store = SegmentStore(str(run_dir / "segments.zarr"), read_only=True)
    for seg in segments:
        arrays = store.read(seg.address)  # verifies the content hash
        assert len(arrays["step_index"]) == seg.step_end - seg.step_start
    scored_ids = [e.segment_id for _, e in scored]
    assert len(scored_ids) == len(set(scored_ids)), "a segment was scored twice"
    assert set(scored_ids) <= {s.segment_id for s in segments}
    arbitrated = {e.segment_id for r, e in events[SEGMENT_CLOSED]
                  if r.offset < committed["arbiter"].get(r.partition, 0)}
    assert arbitrated <= set(scored_ids), "a segment the arbiter consumed was never scored"

    # Every scored segment the learner committed entered exactly one batch or was dropped.
    trained = [sid for v in versions for sid in v.trained_segments]
    assert len(trained) == len(set(trained)), "a segment entered two batches"
    dropped_ids = {d.segment_id for d in dropped}
    assert not dropped_ids & set(trained)
    consumed = {e.segment_id for r, e in scored
                if r.offset < committed["learner"].get(r.partition, 0)}
    assert consumed <= set(trained) | dropped_ids
    assert set(trained) <= set(scored_ids)

    # No step was trained on beyond the staleness bound.
    seg_by_id = {s.segment_id: s for s in segments}
    for v in versions:
        learner_version = v.version - 1  # the version that was trained to produce v
        for sid in v.trained_segments:
            assert learner_version - seg_by_id[sid].min_policy_version <= max_staleness
    return {"steps": len(steps), "segments": len(segments), "versions": len(versions),
            "trained": len(trained), "dropped": len(dropped_ids)}


def test_gyre_run_small_config_invariants(tmp_path):
    cfg = tiny_config(tmp_path / "run")
    summary = asyncio.run(run_loop(cfg, progress=False))
    run_dir = tmp_path / "run"
    for name in ("summary.json", "metrics.jsonl", "learning_curve.png", "events.db"):
        assert (run_dir / name).exists(), name
    assert summary["policy_versions"] >= 5
    assert summary["initial_success"] is not None and summary["final_success"] is not None
    events, committed = asyncio.run(read_events(
        f"sqlite:///{run_dir}/events.db",
        [TRAJECTORY_STEP, SEGMENT_CLOSED, SCORED, POLICY_VERSION, TELEMETRY]))
    counts = check_invariants(events, committed, run_dir, cfg.loop.max_staleness)
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


def test_separate_processes_embedded(tmp_path):
    url = f"sqlite:///{tmp_path}/events.db"
    run_separate_processes(tmp_path, url, min_versions=3, timeout=150)


@pytest.mark.kafka
def test_separate_processes_kafka(tmp_path, noida, unique):
    run_separate_processes(tmp_path, f"kafka://{noida}", min_versions=3, timeout=240,
                           run_id=f"tiny-{unique}")


def test_sync_mode_trains_on_current_version_only(tmp_path):
    cfg = tiny_config(tmp_path / "run", mode="sync")
    cfg = msgspec.structs.replace(cfg, learner=msgspec.structs.replace(cfg.learner,
                                                                       max_versions=3))
    asyncio.run(run_loop(cfg, progress=False))
    events, committed = asyncio.run(read_events(
        f"sqlite:///{tmp_path}/run/events.db",
        [TRAJECTORY_STEP, SEGMENT_CLOSED, SCORED, POLICY_VERSION, TELEMETRY]))
    check_invariants(events, committed, tmp_path / "run", max_staleness=0)
    versions = [e for _, e in events[POLICY_VERSION]]
    # sample-then-train: each update saw whole episodes of exactly one version
    for v in versions:
        if v.reason == "update":
            assert v.metrics["charts/max_staleness_seen"] == 0.0
