"""The loop end to end on a small config: invariants read back from the event log and store."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from gyre_async.audit.invariants import check_run, read_run
from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_topics
from gyre_async.config import load_config
from gyre_async.runtime.loop import run_loop
from gyre_async.ui.run_outputs import write_run_outputs
from schemas import decode
from schemas.topics import POLICY_VERSION

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "ops" / "configs" / "tiny.toml"


def tiny_config(run_dir: Path, **run):
    cfg = load_config(TINY)
    return msgspec.structs.replace(
        cfg, run=msgspec.structs.replace(cfg.run, run_dir=str(run_dir), **run))


def policy_versions(run_dir: Path) -> list:
    """Every ``policy-version`` event of the run's embedded log, in order."""
    async def read():
        async with open_bus(f"sqlite:///{run_dir}/events.db") as bus:
            return [decode(POLICY_VERSION, r.value) for r in await read_topics(bus, [POLICY_VERSION])]

    return asyncio.run(read())


def run_invariants(url: str, run_dir: Path, max_staleness: int, run_id: str = "tiny",
                   exactly_once: bool = True) -> dict:
    """The shared checker (gyre_async.audit.invariants) over a run; asserts it is clean."""
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


@pytest.mark.slow  # an end-to-end run: the full tier (the fast tier stays under 3 minutes)
def test_gyre_run_small_config_invariants(tmp_path):
    cfg = tiny_config(tmp_path / "run")
    summary = write_run_outputs(cfg, asyncio.run(run_loop(cfg)))
    run_dir = tmp_path / "run"
    for name in ("summary.json", "metrics.jsonl", "learning_curve.png", "events.db"):
        assert (run_dir / name).exists(), name
    assert summary["policy_versions"] >= 5
    assert summary["initial_success"] is not None and summary["final_success"] is not None
    assert 0.0 <= summary["stale_dropped_fraction"] < 1.0  # stale drops / steps sampled
    counts = run_invariants(f"sqlite:///{run_dir}/events.db", run_dir, cfg.loop.max_staleness)
    assert counts["trained"] > 0


# One process per role: on the embedded bus tests/test_chaos.py runs the loop so, with every
# role SIGKILLed once and restarted; on Kafka (noida-db) tests/test_broker_restart.py runs
# it, with the broker restarted mid-run. Both check the invariants of gyre_async.audit.invariants.


@pytest.mark.slow  # an end-to-end run: the full tier (the fast tier stays under 3 minutes)
def test_sync_mode_trains_on_current_version_only(tmp_path):
    cfg = tiny_config(tmp_path / "run", mode="sync")
    cfg = msgspec.structs.replace(cfg, learner=msgspec.structs.replace(cfg.learner,
                                                                       max_versions=3))
    write_run_outputs(cfg, asyncio.run(run_loop(cfg)))
    run_invariants(f"sqlite:///{tmp_path}/run/events.db", tmp_path / "run", max_staleness=0)

    versions = policy_versions(tmp_path / "run")
    # sample-then-train: each update saw whole episodes of exactly one version
    for v in versions:
        if v.reason == "update":
            assert v.metrics["charts/max_staleness_seen"] == 0.0


@pytest.mark.slow  # an end-to-end run: the full tier (the fast tier stays under 3 minutes)
def test_sync_groups_give_every_trained_segment_its_groups_outcome(tmp_path):
    """Sync mode with ``group_size == num_envs``: each round's episodes are one GRPO group,
    and the update trains all of them at once, so every segment (milestone cuts included)
    gets the group-relative outcome. In async mode a segment trained before its game
    ended gets the local credit alone (docs/training.md, "Credit")."""
    cfg = tiny_config(tmp_path / "run", mode="sync")
    cfg = msgspec.structs.replace(
        cfg, learner=msgspec.structs.replace(cfg.learner, max_versions=3),
        sampler=msgspec.structs.replace(cfg.sampler, group_size=cfg.sampler.num_envs))
    write_run_outputs(cfg, asyncio.run(run_loop(cfg)))

    updates = [v for v in policy_versions(tmp_path / "run") if v.reason == "update"]
    assert len(updates) >= 3
    for v in updates:
        assert v.metrics["credit/segments_with_outcome"] == len(v.trained_segments) > 0
