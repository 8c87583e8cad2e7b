"""Replay audit: re-feed an actor its recorded inputs on a scratch bus, diff its outputs.

Because outputs carry deterministic ids derived from their inputs, a deterministic actor
must reproduce every recorded output under the same id with the same content. The report
lists outputs that are missing, extra, or changed (field by field); timestamps are ignored.
"""

from __future__ import annotations

import asyncio
import tempfile
from dataclasses import dataclass, field
from typing import Any

import msgspec

from schemas import DecodeError, decode, to_builtins
from schemas.config import Config
from schemas.topics import TELEMETRY

from .actor import ActorRunner
from .bus import Bus
from .bus.embedded import EmbeddedBus
from .bus.reading import read_topics
from .topology import build_actor

IGNORED_FIELDS = {"ts"}


@dataclass
class ReplayReport:
    role: str
    inputs: int = 0
    recorded_outputs: int = 0
    replayed_outputs: int = 0
    missing: list[str] = field(default_factory=list)
    extra: list[str] = field(default_factory=list)
    changed: list[dict[str, Any]] = field(default_factory=list)

    @property
    def differences(self) -> int:
        return len(self.missing) + len(self.extra) + len(self.changed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "role": self.role, "inputs": self.inputs,
            "recorded_outputs": self.recorded_outputs,
            "replayed_outputs": self.replayed_outputs, "differences": self.differences,
            "missing": self.missing, "extra": self.extra, "changed": self.changed,
        }


def _outputs_by_id(records, producer: str) -> dict[str, dict]:
    out = {}
    for record in records:
        try:
            event = decode(record.topic, record.value, 1 << 40)
        except DecodeError:
            continue
        if event.producer != producer:
            continue
        body = {k: v for k, v in to_builtins(event).items() if k not in IGNORED_FIELDS}
        out[event.event_id] = {"topic": record.topic, **body}
    return out


def _diff(a: dict, b: dict) -> dict[str, Any]:
    keys = sorted(set(a) | set(b))
    return {k: {"recorded": a.get(k), "replayed": b.get(k)} for k in keys if a.get(k) != b.get(k)}


async def replay(recorded: Bus, role: str, cfg: Config, *, name: str | None = None,
                 settle_s: float = 0.5, timeout_s: float = 600.0) -> ReplayReport:
    """Run a fresh ``role`` over ``recorded``'s inputs; compare with its recorded outputs."""
    name = name or role
    actor = build_actor(role, cfg)
    report = ReplayReport(role=role)
    inputs = await read_topics(recorded, actor.consumes)
    report.inputs = len(inputs)
    emitted = [t for t in actor.emits if t != TELEMETRY]
    recorded_out = _outputs_by_id(await read_topics(recorded, emitted), name)
    partitions = {t.name: t.partitions for t in await recorded.topics()}
    with tempfile.TemporaryDirectory(prefix="gyre-replay-") as tmp:
        async with EmbeddedBus(f"{tmp}/scratch.db") as scratch:
            for topic in actor.consumes:
                await scratch.create_topics([topic], partitions.get(topic, 4))
            by_topic: dict[str, list] = {}
            for r in sorted(inputs, key=lambda r: (r.timestamp, r.partition, r.offset)):
                by_topic.setdefault(r.topic, []).append((r.key, r.value))
            for topic, messages in by_topic.items():
                await scratch.publish(topic, messages)
            runner = ActorRunner(actor, scratch, run_id=cfg.run.run_id, name=name,
                                 heartbeat_s=3600)
            task = asyncio.create_task(runner.run())
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_s
            while loop.time() < deadline and not task.done():
                await asyncio.sleep(settle_s)
                if await scratch.lag(runner.group, actor.consumes) == 0:
                    await asyncio.sleep(settle_s)
                    break
            runner.stop()
            await task
            replayed = _outputs_by_id(await read_topics(scratch, emitted), name)
    report.recorded_outputs = len(recorded_out)
    report.replayed_outputs = len(replayed)
    report.missing = sorted(set(recorded_out) - set(replayed))
    report.extra = sorted(set(replayed) - set(recorded_out))
    for eid in sorted(set(recorded_out) & set(replayed)):
        diff = _diff(recorded_out[eid], replayed[eid])
        if diff:
            report.changed.append({"event_id": eid, "fields": diff})
    return report


def report_json(report: ReplayReport) -> bytes:
    return msgspec.json.format(msgspec.json.encode(report.to_dict()), indent=2)
