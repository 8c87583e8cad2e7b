"""The hostile-input matrix, against a live run of every role.

One run of the tiny loop (``ops/configs/tiny.toml``, no version budget) with the sampler,
segmenter, arbiter, learner, evaluator and keeper, each on its own runner in this process
(as ``gyre run`` has them). Once the learner has published a version, every row of
:mod:`hostile_rows` is crafted and published onto the topic a role consumes: random bytes,
truncated msgpack, unknown tags, newer schema versions, NaN/inf, a 200,000-step range,
oversized payloads, addresses with a foreign protocol (``ftp://`` and ``http://`` to a
local socket this script listens on), paths outside the run's roots (relative, absolute,
``..``), forged checkpoints (another producer, another run, a valid checkpoint file outside
the run that must survive), duplicate ids and out-of-order steps. The run goes on until
every role that consumes a crafted record has committed past it and the learner has
published ``--versions-after`` more versions. Then the rows marked ``when="restart"`` go
out (a version forged in the learner's name, the newest a restart finds), every role is
restarted and must rebuild its state from the log the hostile records are now part of (the
keeper's restart is where a forged ``kept-checkpoint`` used to be folded, and its file
later deleted; a restarted learner and sampler look for the policy in force), commit past
those rows and train once more; then everything stops and the script checks
(:mod:`hostile_checks`):

- ``refused_as_required`` / per row ``outcome``: every crafted input was refused with a
  reason: dead-lettered by each role that must refuse it (read back from ``dead-letter``;
  ``dead_lettered`` counts them), skipped as a duplicate id or as another run's (the
  runners' ``duplicates`` / ``foreign_events`` counters moved by as many), or, for the
  keeper topic, not folded by the restarted keeper; the one legit row (64 steps of the
  longest action texts) must be announced in parts that cover every step;
- ``crashes``: runner tasks that ended with an error;
- ``wedged_roles``: roles whose committed offsets did not move past every crafted record
  they consume, and the learner if training did not go on (``versions_after``);
- ``files_touched_outside_roots``: paths created, changed or removed in a folder outside
  the run (the crafted paths point there; it holds the sentinel checkpoint) and in the
  working directory the relative paths start from;
- ``outbound_connections``: connections the local listening socket accepted;
- ``lost`` (and ``duplicated``, ``corrupt``): the log's invariants
  (:func:`gyre_async.audit.invariants.check_run`) over the run's events, the refused
  crafted records left out;
- ``collateral_dead_letters``: dead letters of records this script did not craft (a
  hostile input must not take legit ones down with it).

    python ops/hostile.py --bus embedded
    python ops/hostile.py --bus kafka                       # its own Tansu broker
    python ops/hostile.py --bus kafka://host:9092
    python ops/hostile.py --bus embedded --markdown docs/hostile-inputs.md

Last line: {"inputs", "dead_lettered", "refused_as_required", "crashes", "wedged_roles",
"files_touched_outside_roots", "outbound_connections", "lost", ..., "rows": [...]};
exit status 0 only if every row was refused as it must be and every count above is 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import tomllib
from collections import defaultdict
from pathlib import Path

import msgspec
import tomli_w

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "ops"))

from hostile_checks import (  # noqa: E402
    Listener,
    audit,
    committed_past,
    consumers,
    dead_letters,
    judge,
    locate,
    snapshot,
    touched,
    working_directory,
)
from hostile_rows import FAST_ROWS, ROWS, Row, Scene  # noqa: E402

from actors.keeper import Keeper  # noqa: E402
from actors.learner import Learner  # noqa: E402
from gyre_async.bus import open_bus  # noqa: E402
from gyre_async.bus.reading import read_events  # noqa: E402
from gyre_async.compose import build_policy, build_tokenizer, save_weights  # noqa: E402
from gyre_async.config import load_config  # noqa: E402
from gyre_async.runtime.actor import ActorRunner  # noqa: E402
from gyre_async.runtime.logs import configure_logging  # noqa: E402
from gyre_async.runtime.topology import RUN_ROLES, build_actor  # noqa: E402
from gyre_async.storage.checkpoints import CheckpointStore  # noqa: E402
from schemas.events import DeadLetter, PolicyVersion, SegmentClosed  # noqa: E402
from schemas.topics import ALL_TOPICS, POLICY_VERSION, SEGMENT_CLOSED, TRAJECTORY_STEP  # noqa: E402

PARTITIONS = 2
#: every role is restarted after the injection: each rebuilds its state from a log that now
#: holds the hostile records (the keeper folds its topic, where a forged slot used to be
#: taken in; the learner and the sampler look for the policy in force; the segmenter and
#: the arbiter fold what was segmented and scored; the sampler its own steps)
RESTARTED = RUN_ROLES
ATTACKER_LIMIT = 4_000_000  # the crafting side may publish what the run's bus refuses


def tiny_config(run_dir: Path, run_id: str):
    """The tiny loop, 2 partitions, no version budget (the run ends when we say), small
    batches so versions come every few seconds."""
    data = tomllib.loads((ROOT / "ops" / "configs" / "tiny.toml").read_text())
    data["run"].update(run_dir=str(run_dir), run_id=run_id)
    data.setdefault("bus", {})["partitions"] = PARTITIONS
    data.setdefault("learner", {}).update(max_versions=0, batch_steps=64, minibatch_steps=64)
    data.setdefault("evaluator", {}).update(episodes=2)
    # segments as long as the issue's: 64 steps of long action texts do not fit one event
    data.setdefault("segmenter", {})["max_segment_steps"] = 64
    path = run_dir.parent / "hostile.toml"
    path.write_text(tomli_w.dumps(data))
    return load_config(path)


# -- the run ---------------------------------------------------------------------------------------

class Run:
    """Every role on its own runner; restarts keep the earlier incarnations' counters."""

    def __init__(self, bus, cfg, deadline: float):
        self.bus, self.cfg, self.deadline = bus, cfg, deadline
        self.tasks: dict[ActorRunner, asyncio.Task] = {}
        self.incarnations: dict[str, list[ActorRunner]] = defaultdict(list)
        self.crashes: list[str] = []

    def start(self, role: str) -> ActorRunner:
        runner = ActorRunner(build_actor(role, self.cfg), self.bus, run_id=self.cfg.run.run_id,
                             name=role, partitions=PARTITIONS, heartbeat_s=1.0)
        self.tasks[runner] = asyncio.create_task(runner.run(), name=role)
        self.incarnations[role].append(runner)
        return runner

    def live(self, role: str) -> ActorRunner:
        return self.incarnations[role][-1]

    async def stop(self, runners) -> None:
        for r in runners:
            r.stop()
        for r in runners:
            try:
                await self.tasks.pop(r)
            except Exception as exc:  # noqa: BLE001 - a crash is a finding, reported
                self.crashes.append(f"{r.name}: {exc!r}")

    def counter(self, role: str, name: str) -> int:
        return sum(getattr(r, name) for r in self.incarnations[role])

    def learner(self) -> Learner:
        actor = self.live("learner").actor
        assert isinstance(actor, Learner)
        return actor

    def keeper(self) -> Keeper:
        actor = self.live("keeper").actor
        assert isinstance(actor, Keeper)
        return actor

    def version(self) -> int:
        """The newest policy version any learner incarnation has published or restored."""
        return max((r.actor.core.version for r in self.incarnations.get("learner", [])
                    if isinstance(r.actor, Learner)), default=-1)

    async def until(self, ready, what: str) -> None:
        while not await ready():
            for r, task in list(self.tasks.items()):
                if task.done():
                    del self.tasks[r]
                    exc = task.exception() if not task.cancelled() else None
                    self.crashes.append(f"{r.name}: {exc!r} (while waiting until {what})")
            if self.crashes:
                raise RuntimeError(f"a role crashed: {self.crashes}")
            if time.monotonic() > self.deadline:
                raise TimeoutError(f"timed out waiting until {what}")
            await asyncio.sleep(0.25)


async def first_record(bus, topic: str, run_id: str) -> bytes | None:
    async for _record, event in read_events(bus, [topic], run_id=run_id):
        if topic != POLICY_VERSION or isinstance(event, PolicyVersion):
            return _record.value
    return None


async def scene_of(bus, cfg, outside: Path, port: int, version: int) -> Scene:
    """The crafting context: one real record per attacked topic, the sentinel checkpoint."""
    run_id = cfg.run.run_id
    live = {t: v for t in {r.topic for r in ROWS}
            if (v := await first_record(bus, t, run_id)) is not None}
    step = msgspec.msgpack.decode(live[TRAJECTORY_STEP])
    ref = save_weights(CheckpointStore(str(outside)), build_policy(cfg, build_tokenizer(cfg)),
                       99, {"run_id": run_id})
    return Scene(run_id=run_id, run_dir=Path(cfg.run.run_dir), outside=outside,
                 sentinel=Path(ref.address), sentinel_sha=ref.sha256, port=port,
                 version=version, live=live, live_step=step)


# -- one measurement ------------------------------------------------------------------------------

async def measure(url: str, cfg, rows: tuple[Row, ...], tmp: Path, *, versions_after: int = 1,
                  restart: tuple[str, ...] = RESTARTED, timeout_s: float = 900,
                  progress=lambda what: None) -> dict:
    """Run the matrix on ``url``; the figures and the rows as a dict."""
    started = time.monotonic()
    outside, cwd = tmp / "outside", tmp / "cwd"
    cwd.mkdir(parents=True, exist_ok=True)
    listener = Listener()
    run_id = cfg.run.run_id
    try:
        with working_directory(cwd):
            async with open_bus(url) as bus, \
                    open_bus(url, max_message_bytes=ATTACKER_LIMIT) as attacker:
                await bus.create_topics(ALL_TOPICS, PARTITIONS)
                run = Run(bus, cfg, time.monotonic() + timeout_s)
                state = await _attack(run, bus, attacker, cfg, rows, outside, cwd, listener,
                                      versions_after, restart, progress)
                letters = await dead_letters(bus, run_id)
                result = await _judge_all(run, bus, cfg, rows, letters, state)
    finally:
        listener.close()
    result["outbound_connections"] = listener.accepted
    result["seconds"] = round(time.monotonic() - started, 1)
    return result


async def _attack(run: Run, bus, attacker, cfg, rows, outside: Path, cwd: Path,
                  listener: Listener, versions_after: int, restart: tuple[str, ...],
                  progress) -> dict:
    """Start every role, craft and publish the rows, let the run go on, restart the roles
    of ``restart``, stop. Returns what the judging needs."""
    run_id = cfg.run.run_id
    state: dict = {"timed_out": "", "published": {}, "located": {}, "port": listener.port}
    for role in RUN_ROLES:
        run.start(role)
    try:
        async def trained() -> bool:
            return run.version() >= 1
        await run.until(trained, "the learner published version 1")
        scene = await scene_of(bus, cfg, outside, listener.port, run.version())
        state["before"] = snapshot([outside, cwd])
        state["base"] = {r: {c: run.counter(r, c) for c in ("duplicates", "foreign")}
                         for r in RUN_ROLES}
        v0 = run.version()
        live = tuple(r for r in rows if r.when == "live")
        progress(f"version {v0}: publishing {len(live)} hostile inputs")
        located = await _publish(attacker, scene, live, state)

        async def settled() -> bool:
            return run.version() >= v0 + versions_after and \
                not await committed_past(bus, run_id, located)
        await run.until(settled, "every role committed past the inputs and trained on")
        state["counts"] = {r: {c: run.counter(r, c) - state["base"][r][c]
                               for c in ("duplicates", "foreign")} for r in RUN_ROLES}
        state["pre_restart_version"] = before_restart = run.version()
        at_restart = tuple(r for r in rows if r.when == "restart")
        progress(f"version {before_restart}: {len(at_restart)} more, then restarting "
                 f"{', '.join(restart)}")
        located.update(await _publish(attacker, scene, at_restart, state))
        await run.stop([run.live(role) for role in restart])
        for role in restart:
            run.start(role)

        async def restarted() -> bool:
            return run.version() > before_restart and run.live("keeper").processed > 0 \
                and not await committed_past(bus, run_id, located)
        await run.until(restarted, "the restarted roles committed past every input and the "
                                   "learner trained")
    except (TimeoutError, RuntimeError) as exc:
        state["timed_out"] = str(exc)
    finally:
        await run.stop(list(run.tasks))
    keeper = run.keeper()
    state["keeper_slots"] = [k.address for k in keeper.slots.slots.values()]
    state["keeper_untrusted"] = keeper.core.untrusted if keeper.core is not None else -1
    state["restarted_learner_version"] = run.learner().core.version
    state["versions_after"] = run.version() - v0 if "base" in state else 0
    state["after"] = snapshot([outside, cwd]) if "before" in state else {}
    return state


async def _publish(attacker, scene: Scene, rows: tuple[Row, ...], state: dict
                   ) -> dict[str, tuple[str, int, int]]:
    """Craft and publish ``rows``; where each hostile record landed."""
    published = {}
    for row in rows:
        crafted = row.craft(scene)
        await attacker.publish(row.topic, crafted.messages)
        published[row.name] = (row.topic, crafted.messages[crafted.hostile][1])
    state["published"].update(published)
    located = await locate(attacker, published)
    state["located"].update(located)
    return located


async def _judge_all(run: Run, bus, cfg, rows, letters: list[DeadLetter], state: dict) -> dict:
    run_id = cfg.run.run_id
    located = state["located"]
    at = {where: name for name, where in located.items()}
    by_name: dict[str, list[DeadLetter]] = defaultdict(list)
    collateral = []
    for dl in letters:
        name = at.get((dl.source_topic, dl.source_partition, dl.source_offset))
        if name is None:
            collateral.append(f"{dl.actor} {dl.source_topic}@{dl.source_offset}: {dl.reason[:160]}")
        else:
            by_name[name].append(dl)
    counts = state.get("counts") or {r: {"duplicates": 0, "foreign": 0} for r in RUN_ROLES}
    counts["keeper"]["untrusted"] = state["keeper_untrusted"]
    expected: dict[str, dict[str, int]] = {r: {"duplicates": 0, "foreign": 0} for r in RUN_ROLES}
    for row in rows:
        if row.expect in ("duplicate", "foreign"):
            for role in consumers(row.topic):
                expected[role]["duplicates" if row.expect == "duplicate" else "foreign"] += 1
    crafted_dead = {located[name] for name in by_name if name in located}
    report, undecodable, events = await audit(bus, cfg, crafted_dead)
    segments: dict[str, list[SegmentClosed]] = defaultdict(list)
    for segment in events.events(SEGMENT_CLOSED, SegmentClosed):
        segments[segment.trajectory_id].append(segment)
    judged = [judge(row, located.get(row.name), by_name[row.name], counts, expected,
                    state["keeper_slots"], state["published"].get(row.name, ("", b""))[1],
                    segments)
              for row in rows]
    behind = await committed_past(bus, run_id, located)
    wedged = dict(behind)
    if state["versions_after"] < 1:
        wedged.setdefault("learner", []).append("no policy version after the injection")
    resumed, before = state["restarted_learner_version"], state.get("pre_restart_version", 0)
    if resumed <= before:
        wedged.setdefault("learner", []).append(
            f"restarted learner at version {resumed}, no version after {before}")
    files = touched(state.get("before", {}), state["after"])
    return {
        "inputs": len(rows),
        "dead_lettered": sum(1 for j in judged if j["dead_letters"] > 0),
        "refused_as_required": sum(1 for j in judged if j["ok"]),
        "crashes": len(run.crashes),
        "wedged_roles": len(wedged),
        "files_touched_outside_roots": len(files),
        "lost": len(report.lost),
        "duplicated": len(report.duplicated),
        "corrupt": len(report.corrupt),
        "undecodable_not_refused": len(undecodable),
        "collateral_dead_letters": len(collateral),
        "versions_after": state["versions_after"],
        "timed_out": state["timed_out"],
        "listen_port": state["port"],
        "details": {"crashes": run.crashes, "wedged": wedged, "files": files[:10],
                    "lost": report.lost[:5], "duplicated": report.duplicated[:5],
                    "corrupt": report.corrupt[:5], "undecodable": undecodable[:5],
                    "collateral": collateral[:5], "counts": report.counts},
        "rows": [{k: j[k] for k in ("name", "topic", "role", "expect", "outcome",
                                    "dead_letters", "reason", "ok")} for j in judged],
    }


def passed(result: dict) -> bool:
    zero = ("crashes", "wedged_roles", "files_touched_outside_roots", "outbound_connections",
            "lost", "duplicated", "corrupt", "undecodable_not_refused",
            "collateral_dead_letters")
    return (result["refused_as_required"] == result["inputs"] and not result["timed_out"]
            and all(result[k] == 0 for k in zero))


# -- the docs' table ---------------------------------------------------------------------------

def markdown(result: dict, scrub: dict[str, str]) -> str:
    """The table of rows (input, topic, role, outcome, reason) for ``docs/``; ``scrub``
    replaces the run's temporary paths and port with placeholders."""
    def clean(text: str) -> str:
        for old, new in scrub.items():
            text = text.replace(old, new)
        text = text.replace("\n", " ")[:240]
        return text.replace("|", "\\|").replace("<", "\\<")  # a cell, not HTML

    what = {r.name: r.what for r in ROWS}
    lines = [
        "# Hostile inputs",
        "",
        "<!-- generated by `python ops/hostile.py --bus embedded --markdown "
        "docs/hostile-inputs.md`; do not edit by hand -->",
        "",
        "Each row is a record `ops/hostile.py` crafts and publishes onto a topic of a live "
        "run of every role; the reason is the one the run gave (dead-letter reason, or the "
        "runner's counter). `<outside>` is a folder outside the run that holds a valid "
        "checkpoint file (it must survive untouched), `<port>` a local socket that must "
        "accept no connection. The run's figures and the command are in "
        "[RELIABILITY.md](RELIABILITY.md#hostile-input-matrix-opshostilepy).",
        "",
        "| input | what | topic | refused by | outcome | reason |",
        "|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(f"| `{row['name']}` | {clean(what[row['name']])} | `{row['topic']}` | "
                     f"{row['role']} | {row['outcome']} | {clean(row['reason'])} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Publish every hostile input of the matrix onto a live run of every "
                    "role and check that each is refused with a reason, nothing crashes, "
                    "wedges, touches files outside the run or connects out, and nothing "
                    "is lost.")
    parser.add_argument("--bus", default="embedded",
                        help="embedded, kafka (starts its own Tansu broker) or kafka://host:port")
    parser.add_argument("--fast", action="store_true", help="only the test suite's rows")
    parser.add_argument("--versions-after", type=int, default=2,
                        help="policy versions the learner must publish after the injection")
    parser.add_argument("--timeout", type=float, default=900, help="seconds for the whole run")
    parser.add_argument("--markdown", type=Path,
                        help="also write the rows as the docs' table to this file")
    args = parser.parse_args(argv)
    configure_logging("ERROR")
    broker = None
    with tempfile.TemporaryDirectory(prefix="gyre-hostile-") as tmp_name:
        tmp = Path(tmp_name)
        if args.bus == "embedded":
            url = f"sqlite:///{tmp}/events.db"
        elif args.bus == "kafka":
            from brokers import start_broker

            broker = start_broker("tansu", data_dir=f"{tmp}/tansu")
            url = f"kafka://{broker.host}:{broker.port}"
        else:
            url = args.bus
        (tmp / "run").mkdir()
        cfg = tiny_config(tmp / "run", f"hostile-{int(time.time())}")
        try:
            result = asyncio.run(measure(
                url, cfg, FAST_ROWS if args.fast else ROWS, tmp,
                versions_after=args.versions_after, timeout_s=args.timeout,
                progress=lambda what: print(what, file=sys.stderr, flush=True)))
        finally:
            if broker is not None:
                broker.stop()
        scrub = {str(tmp / "outside"): "<outside>", str(tmp / "run"): "<run>",
                 str(tmp): "<tmp>", cfg.run.run_id: "<run-id>"}
    result["bus"] = "embedded" if args.bus == "embedded" else "kafka"
    result["ok"] = passed(result)
    if args.markdown is not None:
        scrub[f"127.0.0.1:{result['listen_port']}"] = "127.0.0.1:<port>"
        args.markdown.write_text(markdown(result, scrub))
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
