"""Two runs on one bus: topic names are shared by every run on a cluster, so each role must
handle its own run's events only (the runtime skips other runs' inputs; every rebuild from
the log reads one run). The second run starts on a bus that already holds a whole first
run: it must start from version 0, train, and pass the invariant checker on its own."""

from __future__ import annotations

import asyncio

import pytest

from gyre_async.audit.invariants import check_run, read_run
from gyre_async.bus import open_bus
from gyre_async.runtime.loop import run_loop
from schemas.events import TrajectoryStep
from schemas.topics import TRAJECTORY_STEP


def _second_run_on_a_used_bus(url: str, tiny, tmp_path) -> None:
    first = tiny.config(run={"run_id": f"first-{tmp_path.name[-8:]}",
                             "run_dir": str(tmp_path / "first")}, learner={"max_versions": 3})
    second = tiny.config(run={"run_id": f"second-{tmp_path.name[-8:]}",
                              "run_dir": str(tmp_path / "second")}, learner={"max_versions": 3})
    asyncio.run(run_loop(first, bus_override=url))
    summary = asyncio.run(run_loop(second, bus_override=url)).summary

    async def read(run_id):
        async with open_bus(url) as bus:
            return await read_run(bus, run_id)

    for cfg in (first, second):
        run = asyncio.run(read(cfg.run.run_id))
        report = check_run(run, segment_store=f"{cfg.run.run_dir}/segments.zarr",
                           checkpoint_dir=f"{cfg.run.run_dir}/checkpoints",
                           max_staleness=cfg.loop.max_staleness)
        assert report.ok, report.describe()
        assert report.counts["trained"] > 0 and report.counts["versions"] >= 3
    # the second run trained from its own version 0, not from the first run's last one
    assert summary["policy_versions"] >= 3, summary
    steps = asyncio.run(read(second.run.run_id)).events(TRAJECTORY_STEP, TrajectoryStep)
    stamps = {s.policy_version for s in steps}
    assert min(stamps) == 0, sorted(stamps)[:5]


@pytest.mark.slow  # an end-to-end run: the full tier (the fast tier stays under 3 minutes)
def test_a_second_run_on_an_embedded_bus_with_a_finished_run(tiny, tmp_path):
    _second_run_on_a_used_bus(f"sqlite:///{tmp_path}/shared.db", tiny, tmp_path)


@pytest.mark.kafka
@pytest.mark.slow
def test_a_second_run_on_a_shared_kafka_broker(tiny, tmp_path, tansu):
    _second_run_on_a_used_bus(f"kafka://{tansu}", tiny, tmp_path)
