"""The Kafka broker restarts mid-run: the actors reconnect and the run keeps its invariants.

noida-db keeps its log and committed offsets on disk across a SIGTERM restart (Tansu is
memory-only), so it is the broker restarted here: a broker of this test's own (the session
brokers are shared with other tests), stopped and started again on the same port and data
directory while the four core roles run as separate processes (once the initial policy
version is out and trajectory steps are flowing). Each role must ride out the outage
in-process (no role may exit), training must go on after the restart (a policy update is
published), and the event log and stores must pass the same invariants as an undisturbed
run. This is also the test of one process per role on Kafka.

The roles are frozen (SIGSTOP) for two seconds before the broker's SIGTERM and thawed at
once after it, so they meet the outage running. Why: noida drops the writes it acknowledged
in the last moments before a SIGTERM (checked with raw aiokafka: 8 idempotent producers,
acks=all, writing while the broker is stopped: 14 of 5,589 acknowledged records were gone
after the restart, the last one or two of each producer; with the producers idle for one
second before the stop, 0 of ~14,000 in four tries). A broker that loses acknowledged
records breaks any client's invariants; a Kafka cluster does not (acks=all, replicas).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gyre_async.audit.invariants import check_run, read_run
from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_topics
from schemas import decode
from schemas.events import PolicyVersion
from schemas.topics import POLICY_VERSION, TRAJECTORY_STEP

pytestmark = pytest.mark.slow  # minutes, not seconds: the full tier only

ROOT = Path(__file__).resolve().parents[1]
ROLES = ("learner", "segmenter", "arbiter", "sampler")


async def _progress(url: str, run_id: str) -> tuple[int, int]:
    """(policy versions of the run, trajectory steps on the bus)."""
    async with open_bus(url) as bus:
        infos = {t.name: t for t in await bus.topics()}
        steps = sum(infos[TRAJECTORY_STEP].end_offsets.values()) if TRAJECTORY_STEP in infos else 0
        if POLICY_VERSION not in infos:
            return 0, steps
        events = [decode(POLICY_VERSION, r.value) for r in await read_topics(bus, [POLICY_VERSION])]
    versions = {e.version for e in events if isinstance(e, PolicyVersion) and e.run_id == run_id}
    return len(versions), steps


def _wait(url: str, run_id: str, versions: int, steps: int, timeout: float, procs,
          log: Path) -> int:
    """Wait for >= ``versions`` policy versions and >= ``steps`` trajectory steps."""
    deadline = time.monotonic() + timeout
    seen = (0, 0)
    while time.monotonic() < deadline:
        for role, p in zip(ROLES, procs):
            assert p.poll() is None, f"{role} exited:\n{log.read_text()[-4000:]}"
        seen = asyncio.run(_progress(url, run_id))
        if seen[0] >= versions and seen[1] >= steps:
            return seen[0]
        time.sleep(1)
    raise AssertionError(f"(versions, steps) {seen}, wanted ({versions}, {steps}):\n"
                         f"{log.read_text()[-4000:]}")


@pytest.mark.kafka
def test_noida_restart_mid_run_actors_reconnect_and_invariants_hold(tmp_path, tiny, unique):
    from brokers import free_port, start_broker

    port = free_port()
    data = tmp_path / "noida"
    broker = start_broker("noida", port=port, data_dir=str(data))
    url = broker.url
    run_id = f"restart-{unique}"
    run_dir = tmp_path / "run"
    cfg = tiny.write(run={"run_id": run_id},
                     learner={"max_versions": 0, "batch_steps": 96})
    log_path = tmp_path / "actors.log"
    try:
        before, after, codes, report = _run_with_restart(broker, port, data, cfg, url,
                                                         run_id, run_dir, log_path)
    finally:
        broker.stop()
    # Every role stayed up through the restart (checked while waiting) and exits 0 on
    # SIGTERM within 60 s (one that does not is killed, its tasks dumped into the log).
    assert codes == [0, 0, 0, 0], (codes, log_path.read_text()[-6000:])
    # ...and cleanly: no client gave up on closing (the bounded close is a safety net)
    assert "close_timeout" not in log_path.read_text(), log_path.read_text()[-6000:]
    assert after >= before + 1
    assert report.ok, report.describe()
    assert report.counts["trained"] > 0


def _run_with_restart(broker, port, data, cfg, url, run_id, run_dir, log_path):
    """Four roles as processes; noida restarted once >= 2 versions exist. Stops ``broker``
    (and the restarted one) only through the caller's ``finally``: it is swapped in place."""
    from brokers import start_broker

    with open(log_path, "w") as log:  # the children keep their own descriptors
        procs = [subprocess.Popen([sys.executable, "-m", "gyre_async.cli", "actor", role,
                                   "--config", str(cfg), "--bus", url],
                                  cwd=ROOT, stdout=log, stderr=log) for role in ROLES]
    try:
        # mid-run: the initial version is out and steps are flowing through the loop
        before = _wait(url, run_id, 1, 32, 300, procs, log_path)
        for p in procs:  # quiet writers, so noida's SIGTERM loses nothing it acknowledged
            p.send_signal(signal.SIGSTOP)
        time.sleep(2)
        try:
            broker.stop()  # SIGTERM: noida flushes its log and offsets to the data directory
        finally:  # thawed even if the stop fails: a frozen role would not heed SIGTERM
            for p in procs:
                p.send_signal(signal.SIGCONT)
        time.sleep(3)  # the actors, running again, see connection errors meanwhile
        restarted = start_broker("noida", port=port, data_dir=str(data))
        broker.pid, broker._popen = restarted.pid, restarted._popen
        after = _wait(url, run_id, max(before + 1, 2), 0, 300, procs, log_path)
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.send_signal(signal.SIGUSR1)  # its tasks' await chains, into the log
                time.sleep(3)
                p.kill()
                p.wait()

    async def read():
        async with open_bus(url) as bus:
            return await read_run(bus, run_id)

    report = check_run(asyncio.run(read()), segment_store=str(run_dir / "segments.zarr"),
                       checkpoint_dir=str(run_dir / "checkpoints"), max_staleness=2)
    return before, after, [p.returncode for p in procs], report
