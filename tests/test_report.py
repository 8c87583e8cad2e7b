"""``gyre report`` on a real (tiny) run, rendered in headless Chromium.

The page must open offline: every <img> decodes (naturalWidth > 0) and the browser sends no
request other than file:// and data: URLs (seen through the DevTools protocol's Network
domain, on a pipe: no websocket client, no extra package). A control page with a loopback
http image proves the request check can fail. Chromium is required (``ops/install_chromium.sh``);
the test fails without it. The full-page screenshot lands in the run directory.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import queue
import socket
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest
from conftest import TinyConfig

from gyre_async.bus import open_bus
from gyre_async.cli.report import add_parser, run
from gyre_async.runtime.loop import run_loop
from gyre_async.ui.report import build_report
from gyre_async.ui.run_outputs import write_run_outputs
from schemas import encode
from schemas.events import (
    DeadLetter,
    EvalResult,
    PolicyVersion,
    Scored,
    SegmentClosed,
    SegmentDropped,
)
from schemas.topics import (
    ALL_TOPICS,
    DEAD_LETTER,
    EVAL,
    POLICY_VERSION,
    SCORED,
    SEGMENT_CLOSED,
    TELEMETRY,
)

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = os.environ.get("GYRE_CHROMIUM", "/usr/bin/chromium")
FIGURES = {"learning_curves", "reward_components", "staleness", "segments", "throughput",
           "learner"}
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
         "--disable-quic", "--no-first-run", "--no-default-browser-check",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-extensions", "--disable-default-apps", "--mute-audio", "--hide-scrollbars"]
PAGE_INFO = """(async () => {
  const imgs = [...document.images];
  await Promise.all(imgs.map(i => i.decode().catch(() => null)));
  return {images: imgs.map(i => ({alt: i.alt, w: i.naturalWidth, h: i.naturalHeight})),
          height: document.documentElement.scrollHeight, text: document.body.innerText};
})()"""


class Chromium:
    """Headless Chromium driven by the DevTools protocol over ``--remote-debugging-pipe``.

    Chromium reads NUL-terminated JSON commands on fd 3 and writes replies and events on fd 4.
    """

    def __init__(self, workdir: Path):
        if not os.access(CHROMIUM, os.X_OK):
            pytest.fail(f"{CHROMIUM} not found: install it with `bash ops/install_chromium.sh`")
        to_chrome, self._to_w = os.pipe()
        self._from_r, from_chrome = os.pipe()
        self.log_path = workdir / "chromium.log"
        script = 'exec 3<&"$CDP_IN" 4>&"$CDP_OUT"; exec "$@"'
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                ["bash", "-c", script, "bash", CHROMIUM, *FLAGS,
                 f"--user-data-dir={workdir / 'profile'}", "--remote-debugging-pipe",
                 "about:blank"],
                pass_fds=(to_chrome, from_chrome), stdin=subprocess.DEVNULL, stdout=log,
                stderr=log, env={**os.environ, "CDP_IN": str(to_chrome),
                                 "CDP_OUT": str(from_chrome)})
        os.close(to_chrome)
        os.close(from_chrome)
        self.inbox: queue.Queue = queue.Queue()
        self.events: list[dict] = []
        self._id = 0
        threading.Thread(target=self._reader, daemon=True).start()

    def _reader(self) -> None:
        pending = bytearray()
        while chunk := os.read(self._from_r, 1 << 20):
            while (i := chunk.find(b"\0")) >= 0:
                pending += chunk[:i]
                self.inbox.put(json.loads(pending))
                pending, chunk = bytearray(), chunk[i + 1:]
            pending += chunk
        self.inbox.put(None)

    def _next(self, deadline: float, what: str) -> dict:
        try:
            msg = self.inbox.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise TimeoutError(f"Chromium: no {what} in time; log:\n{self._log()}") from None
        if msg is None:
            raise RuntimeError(f"Chromium exited; log:\n{self._log()}")
        if "method" in msg:
            self.events.append(msg)
        return msg

    def _log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def send(self, method: str, params: dict | None = None, session: str | None = None,
             timeout: float = 30.0) -> dict:
        self._id += 1
        msg = {"id": self._id, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        data = json.dumps(msg).encode() + b"\0"
        while data:
            data = data[os.write(self._to_w, data):]
        deadline = time.monotonic() + timeout
        while True:
            reply = self._next(deadline, f"reply to {method}")
            if reply.get("id") == self._id:
                assert "error" not in reply, f"{method}: {reply['error']}"
                return reply.get("result", {})

    def wait_event(self, method: str, session: str, since: int, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        seen = since
        while True:
            for e in self.events[seen:]:
                if e["method"] == method and e.get("sessionId") == session:
                    return
            seen = len(self.events)
            self._next(deadline, method)

    def render(self, url: str, screenshot: Path | None = None) -> dict:
        """Open ``url`` in a fresh tab; its images, text and every URL it requested."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        sid = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"]
        self.send("Page.enable", session=sid)
        self.send("Network.enable", session=sid)
        self.send("Emulation.setDeviceMetricsOverride", {"width": 1280, "height": 2000,
                  "deviceScaleFactor": 1, "mobile": False}, sid)
        mark = len(self.events)
        self.send("Page.navigate", {"url": url}, sid)
        self.wait_event("Page.loadEventFired", sid, mark)
        info = self.send("Runtime.evaluate", {"expression": PAGE_INFO, "awaitPromise": True,
                                              "returnByValue": True}, sid)["result"]["value"]
        if screenshot is not None:
            clip = {"x": 0, "y": 0, "width": 1280, "height": info["height"], "scale": 1}
            shot = self.send("Page.captureScreenshot", {"format": "png", "clip": clip,
                             "captureBeyondViewport": True}, sid, timeout=60)
            screenshot.write_bytes(base64.b64decode(shot["data"]))
        time.sleep(0.3)  # let late requests (if any) show up before we count
        while not self.inbox.empty():
            self._next(time.monotonic() + 1, "event")
        info["requests"] = [
            e["params"].get("request", e["params"]).get("url", "")
            for e in self.events[mark:] if e.get("sessionId") == sid
            and e["method"] in ("Network.requestWillBeSent", "Network.webSocketCreated")]
        self.send("Target.closeTarget", {"targetId": target})
        return info

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout=10)
        except (TimeoutError, RuntimeError, OSError):
            pass
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_w)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    cfg = TinyConfig(tmp_path_factory.mktemp("report")).config()
    write_run_outputs(cfg, asyncio.run(run_loop(cfg)))
    return Path(cfg.run.run_dir)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # an end-to-end run: the full tier (the fast tier stays under 3 minutes)
def test_report_of_a_real_run_renders_offline(tiny_run, tmp_path):
    out = Path(asyncio.run(build_report(str(tiny_run))))
    assert out == tiny_run / "report.html"
    page = out.read_text()
    assert {p.stem for p in (tiny_run / "report").glob("*.png")} == FIGURES
    assert page.count("<img ") == len(FIGURES)
    assert 'src="http' not in page and "href='http" not in page
    control = tmp_path / "control.html"
    leak = f"http://127.0.0.1:{_free_port()}/leak.png"
    control.write_text(f"<!doctype html><html><body><img src='{leak}'></body></html>")

    browser = Chromium(tmp_path)
    try:
        shown = browser.render(out.as_uri(), screenshot=tiny_run / "report_screenshot.png")
        probe = browser.render(control.as_uri())
    finally:
        browser.close()

    assert len(shown["images"]) == len(FIGURES)
    for img in shown["images"]:
        assert img["w"] > 0 and img["h"] > 0, f"image not decoded: {img}"
    assert out.as_uri() in shown["requests"], shown["requests"]  # the check sees requests
    remote = [u for u in shown["requests"] if not u.startswith(("file:", "data:"))]
    assert remote == [], f"the report made network requests: {remote}"
    assert leak in probe["requests"], "control: a remote image must be seen as a request"
    text = shown["text"]
    for heading in ("Learning curves", "Reward components", "Staleness", "Segments",
                    "Throughput", "Summary", "Dead letters", "Config", "Training episodes"):
        assert heading in text
    assert "mean milestones" in text and "no finished training episodes" not in text
    assert "figure failed" not in text
    shot = (tiny_run / "report_screenshot.png").read_bytes()
    assert shot[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", shot[16:24])
    assert width == 1280 and height > 2000


async def _write_log(path: Path, events: list[tuple[str, object]]) -> None:
    async with open_bus(f"sqlite:///{path}") as bus:
        await bus.create_topics(ALL_TOPICS, 2)
        for topic, event in events:
            await bus.publish(topic, [(event.key.encode(), encode(event))])


def _synthetic_run(t0: float) -> list[tuple[str, object]]:
    """Four updates, a rollback to v2's weights as v5, evaluations, drops, a dead letter."""
    ids = {"run_id": "syn", "producer": "test"}
    out: list[tuple[str, object]] = []
    for i in range(12):
        seg = SegmentClosed(event_id=f"s{i}", key=f"t{i}", segment_id=f"s{i}",
                            trajectory_id=f"t{i}", task_id="task", step_start=0, step_end=4 + i,
                            boundary="trajectory-end", address="a", content_hash="h",
                            min_policy_version=i // 4, max_policy_version=i // 4,
                            trajectory_done=True, success=i % 3 == 0, ts=t0 + i, **ids)
        out.append((SEGMENT_CLOSED, seg))
        out.append((SCORED, Scored(
            event_id=f"sc{i}", key=f"t{i}", segment_id=f"s{i}", trajectory_id=f"t{i}",
            task_id="task", address="a", content_hash="h", step_start=0, step_end=4 + i,
            min_policy_version=i // 4, trajectory_done=True, success=i % 3 == 0,
            components={"outcome": float(i % 3 == 0), "milestone": 0.5, "guard:unproven": 0.0,
                        "feedback": -0.2}, step_rewards=[0.0] * (4 + i), total=0.5,
            decided_by="outcome", ts=t0 + i + 0.5, **ids)))
    for v in range(6):
        reason = "init" if v == 0 else "rollback" if v == 5 else "update"
        out.append((POLICY_VERSION, PolicyVersion(
            event_id=f"v{v}", key="policy", version=v, checkpoint="c", checkpoint_hash="h",
            parent=v - 1 if v else None, reason=reason, env_steps=100 * v,
            metrics={} if reason != "update" else {"losses/entropy": 2.0 - v / 10,
                                                   "charts/max_staleness_seen": float(v % 2)},
            trained_segments=[f"s{j}" for j in range(4 * (v - 1), 4 * v)] if v < 4 else [],
            ts=t0 + 3 * v, **ids)))
        out.append((EVAL, EvalResult(event_id=f"e{v}", key="eval", policy_version=v,
                                     episodes=8, success_rate=v / 8, mean_score=v / 6,
                                     mean_length=50.0, ts=t0 + 3 * v + 1, **ids)))
    out.append((TELEMETRY, SegmentDropped(event_id="d0", key="t9", segment_id="s9",
                                          reason="stale", staleness=3, ts=t0 + 9, **ids)))
    out.append((DEAD_LETTER, DeadLetter(
        event_id="dl0", key="x", actor="arbiter", source_topic=SEGMENT_CLOSED,
        source_partition=1, source_offset=7, reason="unknown schema version 9 <b>",
        original=b"\x00", ts=t0 + 5, **ids)))
    return out


def test_report_cli_without_data_and_with_a_rollback(tmp_path, capsys):
    parser = argparse.ArgumentParser(prog="gyre")
    add_parser(parser.add_subparsers(dest="command"))
    run_dir = tmp_path / "empty"
    run_dir.mkdir()

    assert run(parser.parse_args(["report", str(run_dir)])) == 0  # no log, no files at all
    page = (run_dir / "report.html").read_text()
    assert "no event log" in page and page.count("no data") >= len(FIGURES)
    assert "no finished training episodes" in page
    assert not (run_dir / "events.db").exists()  # reading never creates a log

    asyncio.run(_write_log(run_dir / "events.db", []))  # every topic, no events
    out = tmp_path / "elsewhere" / "r.html"
    assert run(parser.parse_args(["report", str(run_dir), "--out", str(out)])) == 0
    assert capsys.readouterr().out.strip().endswith(str(out))
    page = out.read_text()
    assert "<img " not in page and page.count("no data") >= len(FIGURES)
    assert "figure failed" not in page and "0 dead letters" in page

    synthetic = tmp_path / "synthetic"
    synthetic.mkdir()
    asyncio.run(_write_log(synthetic / "events.db", _synthetic_run(time.time() - 100)))
    assert run(parser.parse_args(["report", str(synthetic)])) == 0
    page = (synthetic / "report.html").read_text()
    assert "figure failed" not in page and page.count("<img ") == len(FIGURES)
    assert "computed from the event log" in page  # no summary.json
    assert "v5 at " in page  # the rollback, listed under health
    assert "unknown schema version 9 &lt;b&gt;" in page  # dead letter reason, escaped
    assert "stale: 1" in page

    assert run(parser.parse_args(["report", str(tmp_path / "missing")])) == 2


def test_report_counts_an_undecodable_record_and_a_duplicate(tmp_path):
    """Skipped records and ignored copies are shown under health, not silently lost."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    events = _synthetic_run(time.time() - 100)

    async def write():
        await _write_log(run_dir / "events.db", [*events, events[0]])
        async with open_bus(f"sqlite:///{run_dir / 'events.db'}") as bus:
            await bus.publish(EVAL, [(b"eval", b"\xff not an event")])

    asyncio.run(write())
    page = Path(asyncio.run(build_report(str(run_dir)))).read_text()
    assert "<td>undecodable records (skipped)</td><td>1</td>" in page
    assert "<td>duplicate deliveries (ignored)</td><td>1</td>" in page
    assert "<td>undecodable_records</td><td>1</td>" in page  # the computed summary says so
