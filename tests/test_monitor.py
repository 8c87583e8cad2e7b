"""``gyre monitor``: the pure fold on hand-made events, and the live screen in a real pty.

The end-to-end test runs a short ``gyre run`` in a subprocess, starts the monitor in a
pseudo-terminal on the run's event log while it trains, reads the screen a few times and
checks each number it shows against the log as read *after* the screen (the log only
grows, so a number on screen must already be in it). After the run, ``--once`` must agree
exactly with the finished log as ``runlog`` folds it.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import re
import signal
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest
from rich.console import Console

from gyre_async.bus import open_bus
from gyre_async.bus.reading import end_offsets, iter_topics
from gyre_async.folds.runlog import current_policy_version, load_runlog
from gyre_async.ui.monitor import MonitorState, render
from schemas import decode
from schemas.events import (
    CriticReset,
    DeadLetter,
    EnvError,
    EvalResult,
    Heartbeat,
    PolicyVersion,
    Scored,
    SegmentClosed,
    SegmentDropped,
    TrajectoryStep,
)
from schemas.topics import DEAD_LETTER, POLICY_VERSION, TRAJECTORY_STEP

ROOT = Path(__file__).resolve().parents[1]
T0 = 1_700_000_000.0


# -- hand-made events ---------------------------------------------------------------------------
def _env(name: str, ts: float, run: str = "r", **kw) -> dict:
    return {"event_id": f"{name}-{ts}-{kw.get('version', '')}", "run_id": run,
            "producer": name, "ts": T0 + ts, **kw}


def pv(version, ts, reason="update", trained=(), staleness=None, parent=None, run="r"):
    metrics = {} if staleness is None else {"charts/max_staleness_seen": float(staleness)}
    return PolicyVersion(**_env("learner", ts, run, version=version), checkpoint="c",
                         checkpoint_hash="h", reason=reason, parent=parent, metrics=metrics,
                         trained_segments=list(trained), env_steps=100 * version)


def seg(sid, ts, min_version, done=False, success=False, traj="t1", run="r"):
    return SegmentClosed(**_env("segmenter", ts, run), segment_id=sid, trajectory_id=traj,
                         task_id="task", step_start=0, step_end=4, boundary="max-length",
                         address="a", content_hash="h", min_policy_version=min_version,
                         max_policy_version=min_version, trajectory_done=done, success=success)


def scored(sid, ts, components, traj="t1", done=False):
    return Scored(**_env("arbiter", ts), segment_id=sid, trajectory_id=traj, task_id="task",
                  address="a", content_hash="h", step_start=0, step_end=2, min_policy_version=0,
                  trajectory_done=done, success=False, components=components,
                  step_rewards=[0.0, 0.0], total=sum(components.values()), decided_by="outcome")


def hb(actor, role, ts, processed, lag=0):
    return Heartbeat(**_env(actor, ts), actor=actor, role=role, processed=processed, lag=lag,
                     in_flight=0, uptime_s=ts)


def step(ts, i=0):
    return TrajectoryStep(**_env("sampler", ts), trajectory_id="t1", task_id="task",
                          step_index=i, policy_version=0, context_tokens=[1], action_tokens=[2],
                          action_logprobs=[-0.5])


def dead(ts, reason):
    return DeadLetter(**_env("arbiter", ts), actor="arbiter", source_topic="segment-closed",
                      source_partition=0, source_offset=int(ts), reason=reason, original=b"x")


def frame_text(state: MonitorState) -> str:
    with open(os.devnull, "w") as sink:
        console = Console(width=160, record=True, file=sink)
        console.print(render(state))
    return console.export_text()


# -- (a) the fold --------------------------------------------------------------------------------
def test_policy_evals_rollbacks_and_staleness():
    s = MonitorState()
    s.apply(pv(0, 0, reason="init"))
    s.apply(pv(1, 10, trained=["s1", "s2"], staleness=1))  # s1, s2 not read yet: pending
    s.apply(seg("s1", 5, min_version=0))                       # learner v0 - 0 = 0
    s.apply(seg("s2", 6, min_version=0, done=True, success=True))
    s.apply(seg("s3", 11, min_version=0, done=True))
    s.apply(pv(2, 20, trained=["s3"], staleness=2))            # learner v1 - 0 = 1
    s.apply(pv(1, 30, reason="rollback", parent=2))
    s.apply(EvalResult(**_env("evaluator", 12), policy_version=1, episodes=4, success_rate=0.25,
                      mean_score=0.5, mean_length=60))
    s.apply(EvalResult(**_env("evaluator", 25), policy_version=2, episodes=4, success_rate=0.5,
                      mean_score=0.7, mean_length=60))
    s.apply(SegmentDropped(**_env("learner", 31), segment_id="s9", reason="stale", staleness=3))
    assert s.current.version == 1 and s.current.reason == "rollback"  # the policy in force
    assert s.max_version == 2 and len(s.versions) == 4 and s.counts.updates == 2
    assert [(v.ts, v.version, v.parent) for v in s.rollbacks] == [(T0 + 30, 1, 2)]
    assert dict(s.staleness_hist) == {0: 2, 1: 1}
    assert s.max_staleness_seen == 2 and s.counts.dropped == 1 and dict(s.dropped_hist) == {3: 1}
    assert s.latest_eval.policy_version == 2 and s.latest_eval.success_rate == 0.5
    assert s.counts.episodes == 2 and s.counts.successes == 1 and s.train_success == 0.5
    text = frame_text(s)
    assert "policy v1 (rollback)" in text and "max v2" in text
    assert "rollbacks 1" in text and "latest rollback -> v1 (from v2)" in text
    assert "val success 50.0% (v2)" in text
    assert "n/a (no drift-report events)" in text
    assert "critic resets" not in text
    s.apply(CriticReset(**_env("learner", 32), version=2, reason="advantage",
                       max_abs_advantage=412.0, value_loss=3.5, learning_rate=1.5e-4))
    assert len(s.critic_resets) == 1
    text = frame_text(s)
    assert "critic resets 1: latest at v2 (advantage)" in text
    assert "max |adv| 412  value loss 3.5  lr -> 0.00015" in text


def test_rewards_returns_steps_and_dead_letters():
    s = MonitorState()
    s.apply(scored("a", 1, {"outcome": 0.0, "milestones": 0.5}, traj="t1"))
    s.apply(scored("b", 2, {"outcome": 1.0, "milestones": 0.25}, traj="t1", done=True))
    s.apply(scored("c", 3, {"outcome": 0.0}, traj="t2", done=True))
    assert s.components == {"outcome": [3, 1.0], "milestones": [2, 0.75]}
    assert s.counts.scored == 3 and s.total_reward == 1.75
    assert list(s.returns) == [1.75, 0.0]  # per episode: sum of its segments' totals
    for i in range(50):
        s.apply(step(100 + i * 0.2, i))  # 50 steps over 10 s
    assert s.steps == 50 and abs(s.env_steps_avg() - 50 / 9.8) < 1e-6
    assert 4.0 <= s.env_steps_per_s() <= 5.0
    s.apply(EnvError(**_env("sampler", 110), trajectory_id="t1", task_id="task", step_index=3,
                    kind="timeout", message="slow tool"))
    for i, reason in enumerate(["r1", "r2", "r3", "r4"]):
        s.apply(dead(111 + i, reason))
    assert s.counts.dead_letters == 4 and [d.reason for d in s.latest_dead] == ["r2", "r3", "r4"]
    text = frame_text(s)
    assert "env steps 50" in text and "dead letters 4" in text and "timeout 1" in text
    assert "segment-closed: r4" in text and "segment-closed: r1" not in text
    assert "milestones" in text and "0.375" in text  # mean of the milestones component


def test_heartbeats_rates_lag_and_a_silent_actor_is_named():
    s = MonitorState()  # heartbeat period 5 s: silent after 15 s without one
    for t in range(0, 41, 5):
        s.apply(hb("learner", "learner", t, processed=10 * t, lag=7))
    for t in (0, 5, 10, 15):
        s.apply(hb("sampler", "sampler", t, processed=t))
    for t in (30, 35, 40):  # a second sampler process, named apart
        s.apply(hb("sampler-2", "sampler", t, processed=2 * t, lag=4))
    s.apply(hb("arbiter", "arbiter", 30, processed=3))
    assert s.silent_actors() == ["sampler"]  # 40 - 15 = 25 s > 15 s; arbiter 10 s: fine
    assert s.actors["learner"].rate() == 10.0 and s.actors["learner"].lag == 7
    assert s.role_rates()["sampler"] == 3.0 and s.role_rates()["arbiter"] is None
    s.apply(hb("learner", "learner", 45, processed=2))  # restarted: counter began again
    assert s.actors["learner"].rate() is None and s.actors["learner"].processed == 2
    text = frame_text(s)
    assert "SILENT: sampler" in text
    assert re.search(r"sampler\s+15\s+1\.0/s\s+0\s+30s\s+SILENT", text)
    assert re.search(r"arbiter\s+3\s+-\s+0\s+15s\s+ok", text)
    assert re.search(r"sampler-2 \(sampler\)\s+80\s+2\.0/s\s+4\s+5s\s+ok", text)


def test_run_filter_skips_other_runs():
    s = MonitorState(run_id="mine")
    assert s.apply(pv(3, 1, run="mine"))
    assert not s.apply(pv(9, 2, run="other"))
    assert not s.apply(seg("x", 3, 0, done=True, run="other"))
    assert s.current.version == 3 and s.counts.episodes == 0 and s.counts.other_runs == 2
    assert "run mine" in frame_text(s)


# -- (b) the live screen in a pseudo-terminal against a running loop ---------------------------
ANSI = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)|\x1b[()][0-9A-B]")


class PtyScreen:
    """A command in a real pseudo-terminal; a thread drains everything it draws."""

    def __init__(self, argv, env, rows=80, cols=160):
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=slave, stdout=slave,
                                     stderr=slave, start_new_session=True)
        os.close(slave)
        self.master, self.buf, self.lock = master, bytearray(), threading.Lock()
        self.thread = threading.Thread(target=self._drain, daemon=True)
        self.thread.start()

    def _drain(self):
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            with self.lock:
                self.buf += data

    def frame(self) -> str | None:
        """The last complete frame drawn (header line through footer), escapes removed."""
        with self.lock:  # a frame is ~30 kB with escapes: the tail holds several
            text = ANSI.sub("", bytes(self.buf[-300_000:]).decode("utf-8", "replace"))
        frames = [f for f in text.split("Gyre monitor")[1:] if "events read" in f]
        return "Gyre monitor" + frames[-1] if frames else None

    def close(self) -> str:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.thread.join(timeout=5)
        os.close(self.master)
        return self.frame() or ""


async def _log_now(url: str) -> dict:
    async with open_bus(url) as bus:
        versions = [decode(r.topic, r.value).version
                    async for r in iter_topics(bus, [POLICY_VERSION])]
        ends = await end_offsets(bus, [TRAJECTORY_STEP])
        return {"versions": set(versions), "step_records": sum(ends.values())}


async def _final_log(url: str) -> dict:
    async with open_bus(url) as bus:
        log = await load_runlog(bus)
        current = await current_policy_version(bus, "tiny")  # the tiny config's run id
        dead = [r async for r in iter_topics(bus, [DEAD_LETTER])]
    return {"log": log, "current": current, "dead": len(dead)}


def _num(pattern: str, text: str) -> int:
    m = re.search(pattern, text)
    assert m, f"{pattern!r} not on screen:\n{text}"
    return int(m.group(1))


@pytest.mark.slow
def test_monitor_in_a_pty_follows_a_running_loop(tmp_path, tiny):
    run_dir = tmp_path / "run"
    cfg = tiny.write(learner={"max_versions": 16})
    url = f"sqlite:///{run_dir}/events.db"
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "TERM": "xterm-256color",
           "COLUMNS": "160", "LINES": "80"}
    with open(tmp_path / "run.log", "w") as log:
        run = subprocess.Popen([sys.executable, "-m", "gyre_async.cli", "run", str(cfg),
                                "--run-dir", str(run_dir), "--no-progress"],
                               cwd=ROOT, stdout=log, stderr=log, env=env)
    screen = None
    try:
        deadline = time.monotonic() + 150  # the run stops itself at max_wall_s = 110
        while not (run_dir / "events.db").exists() and time.monotonic() < deadline:
            assert run.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            time.sleep(0.2)
        screen = PtyScreen([sys.executable, "-m", "gyre_async.cli", "monitor", "--bus", url,
                            "--refresh", "0.3"], env)
        checked, versions_seen = 0, []
        while run.poll() is None and time.monotonic() < deadline:
            time.sleep(2.0)
            text = screen.frame()
            if text is None or "policy v" not in text or run.poll() is not None:
                continue
            now = asyncio.run(_log_now(url))  # read after the screen: the log only grows
            version = _num(r"policy v(\d+) \(", text)
            steps = _num(r"env steps (\d+) ", text)
            assert version in now["versions"], (version, now["versions"], text)
            assert steps <= now["step_records"], (steps, now, text)
            if steps == 0:  # v0 is announced before the sampler's first flush: not live yet
                continue
            versions_seen.append(version)
            checked += 1
        status = run.wait(timeout=max(1.0, deadline - time.monotonic()))
        assert status == 0, (tmp_path / "run.log").read_text()[-3000:]
        assert checked >= 2, f"only {checked} live screens checked"
        assert versions_seen == sorted(versions_seen) and versions_seen[-1] > versions_seen[0]
        final = asyncio.run(_final_log(url))
        want = f"policy v{final['current'].version} ("
        deadline = time.monotonic() + 15  # the live view converges on the finished log
        while want not in (screen.frame() or "") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert want in screen.frame(), screen.frame()
        assert "sampler" in screen.frame() and "heartbeats" in screen.frame()
    finally:
        if run.poll() is None:
            run.kill()
        last = screen.close() if screen else ""
    assert "stopped" in last  # SIGTERM ends the live view gracefully

    once = subprocess.run([sys.executable, "-m", "gyre_async.cli", "monitor", "--bus", url, "--once"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
                          check=False)
    assert once.returncode == 0, once.stderr
    out, log = once.stdout, final["log"]
    summary = json.loads((run_dir / "summary.json").read_text())
    last_eval = log.evals[-1]
    assert f"policy v{final['current'].version} ({final['current'].reason})" in out, out
    assert f"max v{max(v.version for v in log.versions)}" in out
    assert f"versions {len(log.versions)} " in out
    assert f"val success {last_eval.success_rate:.1%} (v{last_eval.policy_version})" in out
    assert last_eval.success_rate == summary["final_success"]
    assert f"{len(log.evals)} evals" in out
    assert f"dead letters {final['dead']}" in out
    assert f"env steps {log.steps} " in out and log.steps == summary["env_steps"]
    assert f"episodes {log.counts.episodes} " in out
    assert (f"segments {len(log.segments)} closed  {len(log.scored)} scored  "
            f"{len(log.dropped)} dropped") in out
    assert "caught up" in out and "n/a (no drift-report events)" in out


def test_a_redelivered_copy_is_folded_once():
    """At-least-once delivery may publish an event twice (same id): counted once, and the
    copy is shown as a duplicate."""
    s = MonitorState()
    first = seg("s1", 1, 0, done=True, success=True)
    assert s.apply(first) and not s.apply(first)
    assert s.counts.segments == 1 and s.counts.episodes == 1 and s.counts.duplicates == 1
    assert "duplicates 1" in frame_text(s)


def test_once_skips_and_shows_an_undecodable_record(tmp_path, capsys):
    from gyre_async.ui.monitor import monitor
    from schemas import encode

    url = f"sqlite:///{tmp_path}/events.db"

    async def write():
        async with open_bus(url) as bus:
            await bus.create_topics([POLICY_VERSION], 1)
            await bus.publish(POLICY_VERSION, [(b"policy", encode(pv(0, 0, reason="init"))),
                                               (b"policy", b"\xff not an event")])

    asyncio.run(write())
    assert asyncio.run(monitor(url, once=True)) == 0
    out = capsys.readouterr().out
    assert "policy v0 (init)" in out and "undecodable 1 (skipped)" in out
