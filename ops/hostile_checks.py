"""What ``ops/hostile.py`` looks at to judge a run: files outside the roots, connections to
its socket, where each crafted record landed and who committed past it, the dead letters,
the log's invariants, and each row's outcome. Nothing here publishes or starts a role."""

from __future__ import annotations

import hashlib
import os
import socket
import threading
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import msgspec
from hostile_rows import Row

from gyre_async.audit.invariants import CONSUMED, TOPICS, RunEvents, check_run
from gyre_async.bus.reading import iter_topics, read_events
from gyre_async.runtime.topology import RUN_ROLES, actor_class
from schemas import DecodeError, decode
from schemas.events import DeadLetter, SegmentClosed
from schemas.topics import DEAD_LETTER


def consumers(topic: str) -> tuple[str, ...]:
    """The roles of ``gyre run`` that consume ``topic``."""
    return tuple(r for r in RUN_ROLES if topic in actor_class(r).consumes)


# -- what must not change: files outside the roots, connections ----------------------------------

def snapshot(folders: list[Path]) -> dict[str, tuple]:
    """Every path under ``folders`` with its kind, size, mtime and content hash."""
    seen: dict[str, tuple] = {}
    for folder in folders:
        for path in [folder, *folder.rglob("*")]:
            st = path.lstat()
            digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else ""
            seen[str(path)] = (path.is_dir(), st.st_size, st.st_mtime_ns, digest)
    return seen


def touched(before: dict[str, tuple], after: dict[str, tuple]) -> list[str]:
    return sorted(p for p in before.keys() | after.keys() if before.get(p) != after.get(p))


class Listener:
    """A local listening socket that counts the connections it accepts (a role that
    follows a ``ftp://127.0.0.1:<port>`` address would connect here)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sock.close()


@contextmanager
def working_directory(path: Path):
    """Relative addresses resolve against the working directory: the crafted ``../outside``
    paths then point at the watched folder."""
    old = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


# -- the log ---------------------------------------------------------------------------------

async def locate(bus, published: dict[str, tuple[str, bytes]]
                 ) -> dict[str, tuple[str, int, int]]:
    """(topic, partition, offset) of each row's hostile record (the last with its bytes: a
    duplicate repeats a real record's bytes)."""
    topics = sorted({topic for topic, _ in published.values()})
    wanted = {(topic, value): name for name, (topic, value) in published.items()}
    found: dict[str, tuple[str, int, int]] = {}
    async for record in iter_topics(bus, topics):
        name = wanted.get((record.topic, record.value))
        if name is not None:
            found[name] = (record.topic, record.partition, record.offset)
    return found


async def committed_past(bus, run_id: str, located) -> dict[str, list[str]]:
    """Per role, the crafted records it has not committed past yet."""
    behind: dict[str, list[str]] = defaultdict(list)
    for name, (topic, partition, offset) in located.items():
        for role in consumers(topic):
            if (await bus.committed(f"{run_id}.{role}", topic)).get(partition, 0) <= offset:
                behind[role].append(name)
    return behind


async def dead_letters(bus, run_id: str) -> list[DeadLetter]:
    return [e async for _, e in read_events(bus, [DEAD_LETTER], run_id=run_id)
            if isinstance(e, DeadLetter)]


async def audit(bus, cfg, refused: set[tuple[str, int, int]]):
    """The invariant checker over the run's events, the refused crafted records left out
    (a crafted record that was refused is not part of the run; one that was not refused
    is checked like any)."""
    run_id = cfg.run.run_id
    known = {t.name for t in await bus.topics()}
    by_topic: dict[str, list] = defaultdict(list)
    undecodable: list[str] = []
    async for record in iter_topics(bus, [t for t in TOPICS if t in known]):
        where = (record.topic, record.partition, record.offset)
        if where in refused:
            continue
        try:
            event = decode(record.topic, record.value, bus.max_message_bytes)
        except DecodeError as exc:
            undecodable.append(f"{where}: {exc.reason[:120]}")
            continue
        if event.run_id == run_id:
            by_topic[record.topic].append((record.partition, record.offset, event))
    committed = {role: await bus.committed(f"{run_id}.{role}", topic)
                 for role, topic in CONSUMED.items()}
    events = RunEvents(dict(by_topic), committed)
    report = check_run(events, segment_store=f"{cfg.run.run_dir}/segments.zarr",
                       checkpoint_dir=f"{cfg.run.run_dir}/checkpoints",
                       max_staleness=cfg.loop.max_staleness)
    return report, undecodable, events


# -- judging each row ---------------------------------------------------------------------------

def judge(row: Row, where, letters: list[DeadLetter], counts: dict[str, dict[str, int]],
          expected: dict[str, dict[str, int]], keeper_slots: list[str], crafted: bytes,
          segments: dict[str, list[SegmentClosed]]) -> dict:
    """One row's outcome: how the run refused (or, ``split``, handled) its record, and
    whether that is what the row demands (``ok``)."""
    roles = sorted({dl.actor for dl in letters})
    out = {"name": row.name, "topic": row.topic, "expect": row.expect,
           "role": ", ".join(row.refusers or consumers(row.topic)), "dead_letters": len(letters)}
    if where is None:
        return {**out, "outcome": "not published", "reason": "", "ok": False}
    if row.expect == "dead-letter":
        missing = sorted(set(row.refusers) - set(roles))
        outcome = "dead-lettered" if not missing else (
            f"dead-lettered by {', '.join(roles)} only" if roles else "accepted")
        reason = letters[0].reason if letters else f"no dead letter from {', '.join(missing)}"
        return {**out, "outcome": outcome, "reason": reason, "ok": not missing}
    if row.expect == "split":
        tid = msgspec.msgpack.decode(crafted)["trajectory_id"]
        parts = sorted(segments.get(tid, []), key=lambda e: e.step_start)
        steps = [i for p in parts for i in range(p.step_start, p.step_end)]
        whole = steps == list(range(msgspec.msgpack.decode(crafted)["step_index"] + 1))
        return {**out, "role": "segmenter", "outcome": f"split in {len(parts)}"
                if len(parts) > 1 else f"{len(parts)} segment(s)",
                "reason": f"announced as {len(parts)} segment-closed events of "
                          f"{', '.join(str(p.step_end - p.step_start) for p in parts)} "
                          f"steps, each under the bus limit",
                "ok": len(parts) > 1 and whole and not letters}
    if row.expect == "not-folded":
        address = msgspec.msgpack.decode(crafted).get("address", "")
        folded = address in keeper_slots
        return {**out, "role": "keeper (restart)", "outcome": "folded" if folded else
                "not folded", "ok": not folded and not letters,
                "reason": f"the restarted keeper skipped it as untrusted "
                          f"(untrusted events at its restart: {counts['keeper']['untrusted']})"}
    counter = "duplicates" if row.expect == "duplicate" else "foreign"
    short = [r for r in consumers(row.topic) if counts[r][counter] < expected[r][counter]]
    moved = ", ".join(f"{r} +{counts[r][counter]}" for r in consumers(row.topic))
    what = "its event id was handled already" if counter == "duplicates" \
        else "another run's event"
    return {**out, "outcome": "skipped" if not short else "not skipped by " + ", ".join(short),
            "reason": f"{what}: skipped by every consumer ({counter}: {moved})",
            "ok": not short and not letters}
