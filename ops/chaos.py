"""Chaos run: the loop, one process per role, with roles SIGKILLed at random; then audit.

    python ops/chaos.py --bus embedded --kills 24
    python ops/chaos.py --bus kafka --kills 24            # starts its own Tansu broker
    python ops/chaos.py --bus kafka://127.0.0.1:9092 ...  # or uses a running one

What it does:

1. writes a config from ``ops/configs/tiny.toml`` (no version budget, fresh run id) and
   starts ``gyre launch`` on it (sampler, segmenter, arbiter, learner; ``--max-restarts``
   unlimited), so every killed role is restarted by the launcher, as in production;
2. kills ``--kills`` times (>= 1 per role, order shuffled, a random pause of
   ``--min-gap``..``--max-gap`` s before each). Most kills are timed at random; a share of
   the segmenter's and learner's kills are aimed *inside a write*: the roles run with the
   fault points of ``gyre_async.faultpoints`` on (``segment-write``: Zarr rows written, index
   page not yet; ``checkpoint-save``: checkpoint temp file written, not yet renamed), where
   they pause with a marker file up, and the kill is sent while the marker of that PID
   exists. A kill counts as mid-write only when the marker was seen;
3. waits until training has gone on after the last kill (``--settle-versions`` new policy
   versions), stops the launcher with SIGTERM, and checks the invariants of
   ``gyre_async.audit.invariants`` on the event log, the Zarr store and the checkpoints.

Kafka runs use Tansu: noida-db never expires a consumer-group member that died without
leaving, so a SIGKILLed consumer would hold its group there forever.

Last line, JSON: ``{"bench": "chaos", "kills": .., "lost": 0, "duplicated": 0, "corrupt": 0,
"progress": .., "stale_dropped_fraction": ..}`` (progress: policy versions published after
the last kill; stale_dropped_fraction: env steps of segments the learner dropped as too
stale over env steps sampled, see ``gyre_async.folds.pacing``).
Whole checkpoint files that a killed or stopped learner saved but never announced are
counted (``unannounced_checkpoints``), not failed: readers follow ``policy-version``
events, and the restarted learner re-trains that version from the same inputs. Exit status 0
only when lost, duplicated, corrupt and order violations are all 0, every role was killed,
at least one kill landed inside a Zarr write and one inside a checkpoint save, and
progress > 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "ops"))

from gyre_async.runtime.launcher import read_status, wait_until  # noqa: E402 - after sys.path

ROLES = ("sampler", "segmenter", "arbiter", "learner")
AIMED = {"segmenter": "segment-write", "learner": "checkpoint-save"}


def write_config(run_dir: Path, run_id: str, batch_steps: int) -> Path:
    text = (ROOT / "ops" / "configs" / "tiny.toml").read_text()
    text = text.replace('run_dir = "runs/tiny"', f'run_dir = "{run_dir}"')
    text = text.replace('run_id = "tiny"', f'run_id = "{run_id}"')
    text = text.replace("max_versions = 4", "max_versions = 0")
    text = text.replace("max_wall_s = 110", "max_wall_s = 0")
    text = text.replace("batch_steps = 256", f"batch_steps = {batch_steps}")
    cfg = run_dir.parent / "chaos.toml"
    cfg.write_text(text)
    return cfg


def published_versions(url: str, run_id: str) -> int:
    """How many policy versions of the run were announced on the bus (0 = none yet)."""
    from gyre_async.bus import open_bus
    from gyre_async.bus.reading import read_events
    from schemas.events import PolicyVersion
    from schemas.topics import POLICY_VERSION

    async def count() -> int:
        async with open_bus(url) as bus:
            # a progress probe while actors are killed: skip (and log) what does not decode;
            # the invariants check at the end reads the log strictly
            versions = {e.version async for _, e in read_events(bus, [POLICY_VERSION],
                                                                on_bad="skip")
                        if isinstance(e, PolicyVersion) and e.run_id == run_id}
        return len(versions)

    return asyncio.run(count())


def plan_kills(n: int, aimed_share: float, rng: random.Random) -> list[tuple[str, bool]]:
    """(role, aimed) per kill: every role at least once, at least one aimed kill per aimed
    role when n allows, the rest random."""
    roles = list(ROLES) + [rng.choice(ROLES) for _ in range(max(0, n - len(ROLES)))]
    rng.shuffle(roles)
    plan = [(r, r in AIMED and rng.random() < aimed_share) for r in roles]
    for role in AIMED:  # make sure each write point is hit at least once
        if not any(r == role and a for r, a in plan):
            i = next(i for i, (r, _) in enumerate(plan) if r == role)
            plan[i] = (role, True)
    return plan


class Chaos:
    def __init__(self, args, run_dir: Path, url: str, run_id: str):
        self.args = args
        self.run_id = run_id
        self.run_dir = run_dir
        self.url = url
        self.status = run_dir.parent / "status.json"
        self.fault_dir = run_dir.parent / "faults"
        self.fault_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = run_dir.parent / "launcher.log"
        self.rng = random.Random(args.seed)
        self.kills: list[dict] = []

    def start(self, cfg: Path) -> subprocess.Popen:
        env = dict(os.environ, GYRE_FAULT_POINTS=",".join(AIMED.values()),
                   GYRE_FAULT_DIR=str(self.fault_dir), GYRE_FAULT_PAUSE_S=str(self.args.pause),
                   GYRE_FAULT_PROB=str(self.args.pause_prob),
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT),
                                                            os.environ.get("PYTHONPATH")])))
        with open(self.log_path, "w") as log:
            return subprocess.Popen(
                [sys.executable, "-m", "gyre_async.cli", "launch", str(cfg), "--bus", self.url,
                 "--status-file", str(self.status), "--max-restarts", "-1",
                 "--stop-timeout", "30", "--roles", ",".join(ROLES)],
                cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)

    def versions(self) -> int:
        return published_versions(self.url, self.run_id)

    def alive_pid(self, role: str) -> int | None:
        s = read_status(self.status).get("roles", {}).get(role)
        return s["pid"] if s and s["alive"] and not s["restarting"] else None

    def kill(self, role: str, aimed: bool) -> None:
        pid = wait_until(f"{role} alive", lambda: self.alive_pid(role), 120)
        how = "timed"
        if aimed:
            marker = self.fault_dir / f"{AIMED[role]}.{pid}"
            try:
                wait_until(f"{role} inside {AIMED[role]}", marker.exists,
                           self.args.aim_timeout, every=0.02)
                how = AIMED[role]
            except TimeoutError:
                how = "timed (write point not reached)"
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return  # it died by itself meanwhile; the launcher restarts it anyway
        self.kills.append({"role": role, "pid": pid, "how": how, "t": time.time()})
        print(f"chaos: kill {len(self.kills)}: {role} pid {pid} ({how})", file=sys.stderr)

    def run(self, cfg: Path) -> dict:
        proc = self.start(cfg)
        started = time.monotonic()
        try:
            wait_until("every role up", lambda: all(self.alive_pid(r) for r in ROLES), 120)
            wait_until("the initial policy version", lambda: self.versions() >= 1,
                       self.args.timeout, 1.0)
            for role, aimed in plan_kills(self.args.kills, self.args.aimed_share, self.rng):
                time.sleep(self.rng.uniform(self.args.min_gap, self.args.max_gap))
                if proc.poll() is not None:
                    raise RuntimeError(f"the launcher exited ({proc.returncode})")
                # until a kill has landed inside this role's write, aim every one of its kills
                aimed = aimed or (role in AIMED and not any(
                    k["how"] == AIMED[role] for k in self.kills))
                self.kill(role, aimed)
            at_last_kill = self.versions()
            wait_until(f"{self.args.settle_versions} versions after the last kill",
                       lambda: self.versions() >= at_last_kill + self.args.settle_versions,
                       self.args.timeout, 1.0)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
        final = read_status(self.status)
        restarts = {r: s["restarts"] for r, s in final.get("roles", {}).items()}
        return {"launcher_exit": code, "restarts": restarts, "at_last_kill": at_last_kill,
                "seconds": round(time.monotonic() - started, 1)}


async def audit(url: str, run_id: str, run_dir: Path, max_staleness: int):
    """The invariants report, and the share of sampled env steps dropped as stale."""
    from gyre_async.audit.invariants import check_run, read_run
    from gyre_async.bus import open_bus
    from gyre_async.envs.macros import env_steps_of
    from gyre_async.folds.pacing import stale_dropped_fraction
    from schemas.events import SegmentClosed, SegmentDropped, TrajectoryStep
    from schemas.topics import SEGMENT_CLOSED, TELEMETRY, TRAJECTORY_STEP

    async with open_bus(url) as bus:
        run = await read_run(bus, run_id)
    report = check_run(run, segment_store=str(run_dir / "segments.zarr"),
                       checkpoint_dir=str(run_dir / "checkpoints"), max_staleness=max_staleness)
    sampled = sum(map(env_steps_of, run.events(TRAJECTORY_STEP, TrajectoryStep)))
    stale = stale_dropped_fraction(run.events(TELEMETRY, SegmentDropped),
                                   run.events(SEGMENT_CLOSED, SegmentClosed), sampled)
    return report, stale


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bus", default="embedded",
                   help="embedded, kafka (start a Tansu broker) or a kafka:// URL")
    p.add_argument("--kills", type=int, default=24, help="SIGKILLs to send (default 24)")
    p.add_argument("--min-gap", type=float, default=1.0, help="min seconds before a kill")
    p.add_argument("--max-gap", type=float, default=6.0, help="max seconds before a kill")
    p.add_argument("--aimed-share", type=float, default=0.5,
                   help="share of segmenter/learner kills aimed inside a write (default 0.5)")
    p.add_argument("--aim-timeout", type=float, default=30.0,
                   help="seconds to wait for a write point before killing anyway")
    p.add_argument("--pause", type=float, default=0.4, help="seconds a write point pauses")
    p.add_argument("--pause-prob", type=float, default=0.3,
                   help="probability that a write pauses at its point (default 0.3)")
    p.add_argument("--settle-versions", type=int, default=2,
                   help="policy versions required after the last kill (default 2)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds to wait for the first update and for the settle versions")
    p.add_argument("--batch-steps", type=int, default=256,
                   help="learner.batch_steps (default 256, as tiny.toml; smaller: faster versions)")
    p.add_argument("--seed", type=int, default=None, help="random seed (default: random)")
    p.add_argument("--work-dir", help="keep the run here (default: a temporary directory)")
    args = p.parse_args(argv)
    if args.kills < len(ROLES):
        p.error(f"--kills must be >= {len(ROLES)} so that every role is hit")
    args.seed = args.seed if args.seed is not None else random.randrange(1 << 30)

    work = Path(args.work_dir or tempfile.mkdtemp(prefix="gyre-chaos-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    run_id = f"chaos-{uuid.uuid4().hex[:8]}"
    run_dir = work / "run"
    broker = None
    if args.bus == "embedded":
        url = f"sqlite:///{run_dir}/events.db"
    elif args.bus == "kafka":
        from brokers import start_broker

        broker = start_broker("tansu", data_dir=str(work / "tansu"))
        url = broker.url
    else:
        url = args.bus
    cfg = write_config(run_dir, run_id, args.batch_steps)
    from gyre_async.config import load_config

    max_staleness = load_config(cfg).loop.max_staleness
    chaos = Chaos(args, run_dir, url, run_id)
    error = None
    try:
        try:
            info = chaos.run(cfg)
        except (TimeoutError, RuntimeError) as exc:
            error = str(exc)
            info = {"launcher_exit": None, "restarts": {}, "at_last_kill": -1, "seconds": None}
        report, stale_dropped = asyncio.run(audit(url, run_id, run_dir, max_staleness))
    finally:
        if broker is not None:
            broker.stop()
    print(report.describe(), file=sys.stderr)
    by_role = {r: sum(k["role"] == r for k in chaos.kills) for r in ROLES}
    versions = report.counts.get("versions", 0)
    result = {
        "bench": "chaos", "bus": "kafka" if url.startswith("kafka") else "embedded",
        "kills": len(chaos.kills), "kills_by_role": by_role,
        "kills_mid_segment_write": sum(k["how"] == "segment-write" for k in chaos.kills),
        "kills_mid_checkpoint": sum(k["how"] == "checkpoint-save" for k in chaos.kills),
        "lost": len(report.lost), "duplicated": len(report.duplicated),
        "corrupt": len(report.corrupt), "order": len(report.order),
        "progress": max(0, versions - info["at_last_kill"]) if error is None else 0,
        "versions": versions, "steps": report.counts.get("steps", 0),
        "segments": report.counts.get("segments", 0),
        "trained_segments": report.counts.get("trained", 0),
        "stale_dropped_fraction": stale_dropped,  # stale-dropped env steps / sampled env steps
        "unannounced_segments": report.counts.get("unannounced_segments", 0),
        "unannounced_checkpoints": report.counts.get("unannounced_checkpoints", 0),
        "invisible_leftovers": report.counts.get("invisible_leftovers", 0),
        "restarts": info["restarts"], "launcher_exit": info["launcher_exit"],
        "seconds": info["seconds"], "seed": args.seed, "work_dir": str(work), "error": error,
    }
    ok = (error is None and report.ok and result["progress"] > 0
          and all(by_role.values()) and len(chaos.kills) >= args.kills
          and result["kills_mid_segment_write"] > 0 and result["kills_mid_checkpoint"] > 0)
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
