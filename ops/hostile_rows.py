"""The rows of the hostile-input matrix: what ``ops/hostile.py`` publishes, and where.

Each row crafts one hostile record for one topic of a live run (with, for a few rows, legit
records before and after it that put it in context: the steps around an out-of-order one)
and says how the run must refuse it:

- ``dead-letter``: every role in ``refusers`` sends it to ``dead-letter`` with a reason
  (other consumers of the topic may also ignore it, e.g. the evaluator a version it does not
  evaluate);
- ``duplicate``: it repeats the id of an event already handled, so every consumer skips it
  (``duplicates`` in their heartbeats: handlers are idempotent by event id);
- ``foreign``: it carries another run's id, so every consumer skips it (``foreign_events``:
  topics are shared by every run on a cluster);
- ``not-folded``: an event of the ``keeper`` topic that only a (re)starting keeper reads
  back: the restarted keeper must not take it into its slots (nor delete what it names);
- ``split``: legit input whose output would not fit on the bus in one event (a segment of
  64 steps with maximum-length action texts): it must be announced in parts that each
  fit, all of its steps segmented, nothing dead-lettered (the hostile record is the step
  that closes the segment).

Crafted events are msgpack maps written by hand (``msgspec.msgpack.encode`` of a dict), so
they can hold what the event classes refuse to build (NaN, a 200,000-step range, a newer
schema version). Every crafted id derives from the row's name: a row is the same bytes in
every run of the same scene. The row list is the single source of the docs' table
(``python ops/hostile.py --markdown docs/hostile-inputs.md``).
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec

from gyre_async.storage.urls import normalize_store_url
from schemas import event_id
from schemas.events import MAX_TEXT_CHARS
from schemas.topics import (
    EVAL,
    EVAL_REQUEST,
    KEEPER,
    POLICY_VERSION,
    SCORED,
    SEGMENT_CLOSED,
    TELEMETRY,
    TRAJECTORY_STEP,
)

Expect = Literal["dead-letter", "duplicate", "foreign", "not-folded", "split"]
Message = tuple[bytes | None, bytes]


@dataclass
class Scene:
    """What the rows need to know about the live run they attack."""

    run_id: str
    run_dir: Path
    outside: Path  # a folder outside every root: nothing may appear, change or vanish there
    sentinel: Path  # a valid checkpoint file in ``outside`` (its sha256 in its name)
    sentinel_sha: str
    port: int  # a local listening socket: a connection to it is an outbound call
    version: int  # the latest policy version when the rows are crafted
    live: dict[str, bytes]  # one real record's bytes per topic (for duplicates)
    live_step: dict[str, Any]  # a real trajectory step (tokens the policy knows)

    def segment_store(self) -> str:
        """The run's segment store as its addresses spell it (rows that must be refused for
        something else than their address name it)."""
        return normalize_store_url(str(self.run_dir / "segments.zarr"))[0]

    def checkpoint_root(self) -> str:
        """The learner's checkpoint folder as its addresses spell it."""
        return normalize_store_url(str(self.run_dir / "checkpoints"))[0]

    def plain_segment_store(self) -> str:
        return str(self.run_dir / "segments.zarr")


@dataclass(frozen=True)
class Crafted:
    """The records a row publishes on its topic, in order; ``hostile`` indexes the one the
    run must refuse (the others are legit context, audited like any)."""

    messages: list[Message]
    hostile: int = 0


@dataclass(frozen=True)
class Row:
    name: str
    topic: str
    expect: Expect
    refusers: tuple[str, ...]  # roles that must dead-letter it (``dead-letter`` rows)
    what: str  # one line for the docs
    craft: Callable[[Scene], Crafted]
    fast: bool = False  # in the test suite's subset
    #: ``live``: published while every role runs; ``restart``: right before every role is
    #: restarted, so the restarts meet it first (what a rebuild makes of the latest events)
    when: Literal["live", "restart"] = "live"


# -- crafting helpers ---------------------------------------------------------------------------

def _pack(data: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode(data)


def _envelope(scene: Scene, tag: str, name: str, key: str, **fields: Any) -> dict[str, Any]:
    return {"type": tag, "event_id": event_id("hostile", scene.run_id, name),
            "run_id": scene.run_id, "producer": "hostile", "key": key, "schema_version": 1,
            "ts": time.time(), **fields}


def _one(data: dict[str, Any]) -> Crafted:
    return Crafted([(str(data.get("key", "")).encode() or None, _pack(data))])


def _step(scene: Scene, tid: str, index: int, variant: str = "", **over: Any) -> dict[str, Any]:
    """A trajectory step of the crafted trajectory ``tid`` (tokens from a real step)."""
    live = scene.live_step
    data = _envelope(scene, "trajectory-step", f"step/{tid}/{index}/{variant}", tid,
                     trajectory_id=tid, task_id=live["task_id"], step_index=index,
                     policy_version=live["policy_version"],
                     context_tokens=live["context_tokens"], action_tokens=live["action_tokens"],
                     action_logprobs=live["action_logprobs"],
                     next_context_tokens=live.get("next_context_tokens"))
    data.update(over)
    return data


def _steps(scene: Scene, tid: str, indices: list[int], hostile_at: int,
           hostile: dict[str, Any], **over: Any) -> Crafted:
    """Steps ``indices`` of ``tid`` (with fields ``over``), the hostile one inserted at
    position ``hostile_at``; the last one published ends the trajectory (an open
    trajectory would hold the segmenter's commit)."""
    msgs = [_step(scene, tid, i, **over) for i in indices]
    msgs.insert(hostile_at, hostile)
    msgs[-1]["done"] = True
    return Crafted([(tid.encode(), _pack(m)) for m in msgs], hostile_at)


def _segment(scene: Scene, name: str, address: str, **over: Any) -> dict[str, Any]:
    tid = f"hostile-{name}"
    data = _envelope(scene, "segment-closed", name, tid,
                     segment_id=event_id("hostile-segment", scene.run_id, name),
                     trajectory_id=tid, task_id=scene.live_step["task_id"], step_start=0,
                     step_end=4, boundary="max-length", address=address,
                     content_hash="0" * 64, min_policy_version=0, max_policy_version=0)
    data.update(over)
    return data


def _scored(scene: Scene, name: str, address: str, **over: Any) -> dict[str, Any]:
    tid = f"hostile-{name}"
    data = _envelope(scene, "scored", name, tid,
                     segment_id=event_id("hostile-segment", scene.run_id, name),
                     trajectory_id=tid, task_id=scene.live_step["task_id"], address=address,
                     content_hash="0" * 64, step_start=0, step_end=4,
                     min_policy_version=scene.version, trajectory_done=False, success=False,
                     components={"outcome": 0.0}, step_rewards=[0.0] * 4, total=0.0,
                     decided_by="outcome")
    data.update(over)
    return data


def _version(scene: Scene, name: str, producer: str, checkpoint: str, **over: Any
             ) -> dict[str, Any]:
    """A policy version far ahead of the run's (a sampler would load it at once), marked
    final (the evaluator evaluates it whatever its schedule), naming ``checkpoint`` with the
    sentinel's true sha256."""
    data = _envelope(scene, "policy-version", name, "policy",
                     version=scene.version + 1000, checkpoint=checkpoint,
                     checkpoint_hash=scene.sentinel_sha, parent=scene.version, reason="update",
                     metrics={"final": 1.0})
    data.update(producer=producer, **over)
    return data


def _kept(scene: Scene, name: str, producer: str, address: str) -> dict[str, Any]:
    return _envelope(scene, "kept-checkpoint", name, "keeper", slot="best",
                     version=max(scene.version, 0), address=address,
                     sha256=scene.sentinel_sha, why="forged", producer=producer)


def _rollback(scene: Scene, name: str, producer: str, checkpoint: str) -> dict[str, Any]:
    return _envelope(scene, "rollback", name, "keeper", sequence=1,
                     regressed_version=max(scene.version, 0), restore_version=0,
                     slot="best", checkpoint=checkpoint, checkpoint_hash=scene.sentinel_sha,
                     learning_rate=1e-4, previous_learning_rate=3e-4, why="forged",
                     producer=producer)


def _random_bytes(name: str) -> Callable[[Scene], Crafted]:
    def craft(scene: Scene) -> Crafted:
        rng = random.Random(f"hostile/{name}")  # the same bytes in every run
        return Crafted([(b"hostile", bytes(rng.randrange(256) for _ in range(96)))])
    return craft


def _truncated(scene: Scene) -> Crafted:
    whole = _pack(_step(scene, "hostile-truncated", 0))
    return Crafted([(b"hostile-truncated", whole[: len(whole) // 2])])


def _unknown_tag(topic: str) -> Callable[[Scene], Crafted]:
    def craft(scene: Scene) -> Crafted:
        return _one(_envelope(scene, "teleport", f"teleport/{topic}", "hostile", to="mars"))
    return craft


def _copy_of_live(topic: str, change: Callable[[dict], None] | None = None
                  ) -> Callable[[Scene], Crafted]:
    """A real record of ``topic`` again, under its id (``change``: with altered content)."""
    def craft(scene: Scene) -> Crafted:
        value = scene.live[topic]
        if change is not None:
            data = msgspec.msgpack.decode(value)
            change(data)
            value = _pack(data)
        key = msgspec.msgpack.decode(scene.live[topic]).get("key", "")
        return Crafted([(key.encode() or None, value)])
    return craft


def _outside_checkpoint(scene: Scene) -> str:
    return str(scene.sentinel)


def _relative_checkpoint(scene: Scene) -> str:
    """The sentinel as a path relative to the working directory (``../outside/...``)."""
    return f"../{scene.outside.name}/{scene.sentinel.name}"


def _dotdot_checkpoint(scene: Scene, root: str) -> str:
    """The sentinel reached from inside a root (``<run>/checkpoints/../../outside/...``)."""
    return f"{scene.run_dir / root}/../../{scene.outside.name}/{scene.sentinel.name}"


def _ftp(scene: Scene, what: str) -> str:
    return f"ftp://127.0.0.1:{scene.port}/{what}"


# -- the rows -----------------------------------------------------------------------------------

def _rows() -> list[Row]:
    seg, sid = "segments.zarr", "#hostile-segment"
    rows = [
        # trajectory-step: the segmenter
        Row("random-bytes-step", TRAJECTORY_STEP, "dead-letter", ("segmenter",),
            "96 random bytes", _random_bytes("step"), fast=True),
        Row("truncated-msgpack-step", TRAJECTORY_STEP, "dead-letter", ("segmenter",),
            "a valid step cut in half", _truncated, fast=True),
        Row("unknown-tag-step", TRAJECTORY_STEP, "dead-letter", ("segmenter",),
            "an event type no build knows", _unknown_tag(TRAJECTORY_STEP)),
        Row("newer-schema-step", TRAJECTORY_STEP, "dead-letter", ("segmenter",),
            "schema_version 99",
            lambda s: _one(_step(s, "hostile-schema", 0, schema_version=99))),
        Row("nan-logprob-step", TRAJECTORY_STEP, "dead-letter", ("segmenter",),
            "NaN in action_logprobs",
            lambda s: _one(_step(s, "hostile-nan", 0,
                                 action_logprobs=[math.nan] * len(s.live_step["action_tokens"]))),
            fast=True),
        Row("inf-feedback-step", TRAJECTORY_STEP, "dead-letter", ("segmenter",),
            "+inf environment feedback",
            lambda s: _one(_step(s, "hostile-inf", 0, feedback=math.inf))),
        Row("oversized-step", TRAJECTORY_STEP, "dead-letter", ("segmenter",),
            "a 1.5 MB step (the bus limit is 1 MB)",
            lambda s: _one(_step(s, "hostile-oversized", 0, observation_ref="x" * 1_500_000))),
        Row("duplicate-id-step", TRAJECTORY_STEP, "duplicate", (),
            "a real step published again under its id", _copy_of_live(TRAJECTORY_STEP)),
        Row("duplicate-id-changed-step", TRAJECTORY_STEP, "duplicate", (),
            "a real step's id with other log-probs",
            _copy_of_live(TRAJECTORY_STEP, lambda d: d.update(
                action_logprobs=[-9.0] * len(d["action_logprobs"])))),
        Row("out-of-order-late-step", TRAJECTORY_STEP, "dead-letter", ("segmenter",),
            "step 3 after steps 0-2 and 5 (its gap already cut)",
            lambda s: _steps(s, "hostile-late", [0, 1, 2, 5, 6], 4,
                             _step(s, "hostile-late", 3))),
        Row("out-of-order-repeated-step", TRAJECTORY_STEP, "dead-letter", ("segmenter",),
            "step 1 again under another id, after step 2",
            lambda s: _steps(s, "hostile-repeat", [0, 1, 2, 3], 3,
                             _step(s, "hostile-repeat", 1, variant="again"))),
        Row("step-after-the-end", TRAJECTORY_STEP, "dead-letter", ("segmenter",),
            "step 2 after step 1 ended its trajectory",
            lambda s: Crafted([(b"hostile-after-end", _pack(m)) for m in (
                _step(s, "hostile-after-end", 0), _step(s, "hostile-after-end", 1, done=True),
                _step(s, "hostile-after-end", 2))], 2)),
        Row("long-action-texts-segment", TRAJECTORY_STEP, "split", (),
            f"64 steps with {MAX_TEXT_CHARS:,}-character action texts: one segment-closed "
            "would be over 1 MB",
            lambda s: _steps(s, "hostile-long-texts", list(range(63)), 63,
                             _step(s, "hostile-long-texts", 63,
                                   action_text="b" * MAX_TEXT_CHARS),
                             action_text="a" * MAX_TEXT_CHARS)),
        # segment-closed: the arbiter
        Row("random-bytes-segment-closed", SEGMENT_CLOSED, "dead-letter", ("arbiter",),
            "96 random bytes", _random_bytes("segment-closed")),
        Row("huge-range-segment-closed", SEGMENT_CLOSED, "dead-letter", ("arbiter",),
            "a ~300-byte event claiming a 200,000-step range",
            lambda s: _one(_segment(s, "huge-range", f"{s.segment_store()}{sid}",
                                    step_end=200_000)), fast=True),
        Row("long-range-segment-closed", SEGMENT_CLOSED, "dead-letter", ("arbiter",),
            "8,000 steps: decodes, but longer than the run's segments",
            lambda s: _one(_segment(s, "long-range", f"{s.segment_store()}{sid}",
                                    step_end=8_000))),
        Row("nan-feedback-segment-closed", SEGMENT_CLOSED, "dead-letter", ("arbiter",),
            "NaN in per-step feedback",
            lambda s: _one(_segment(s, "nan-feedback", f"{s.segment_store()}{sid}",
                                    feedback=[0.0, math.nan, 0.0, 0.0]))),
        Row("newer-schema-segment-closed", SEGMENT_CLOSED, "dead-letter", ("arbiter",),
            "schema_version 99",
            lambda s: _one(_segment(s, "newer-schema", f"{s.segment_store()}{sid}",
                                    schema_version=99))),
        Row("ftp-segment-address", SEGMENT_CLOSED, "dead-letter", ("arbiter",),
            "address ftp://127.0.0.1:<listening port>/x#id",
            lambda s: _one(_segment(s, "ftp", _ftp(s, "x#hostile-segment"))), fast=True),
        Row("relative-segment-address", SEGMENT_CLOSED, "dead-letter", ("arbiter",),
            "address ../outside/segments.zarr#id",
            lambda s: _one(_segment(s, "relative", f"../{s.outside.name}/{seg}{sid}"))),
        Row("absolute-segment-address", SEGMENT_CLOSED, "dead-letter", ("arbiter",),
            "address <outside>/segments.zarr#id (absolute, outside the run)",
            lambda s: _one(_segment(s, "absolute", f"{s.outside / seg}{sid}"))),
        Row("dotdot-segment-address", SEGMENT_CLOSED, "dead-letter", ("arbiter",),
            "address <run>/segments.zarr/../../outside/segments.zarr#id",
            lambda s: _one(_segment(s, "dotdot", f"{s.plain_segment_store()}/../../"
                                                 f"{s.outside.name}/{seg}{sid}"))),
        Row("duplicate-id-segment-closed", SEGMENT_CLOSED, "duplicate", (),
            "a real segment announced again under its id", _copy_of_live(SEGMENT_CLOSED)),
        # scored: the learner
        Row("ftp-scored-address", SCORED, "dead-letter", ("learner",),
            "address ftp://127.0.0.1:<listening port>/x#id",
            lambda s: _one(_scored(s, "ftp-scored", _ftp(s, "x#hostile-segment"))), fast=True),
        Row("http-scored-address", SCORED, "dead-letter", ("learner",),
            "address http://127.0.0.1:<listening port>/x#id",
            lambda s: _one(_scored(s, "http-scored",
                                   f"http://127.0.0.1:{s.port}/x#hostile-segment"))),
        Row("relative-scored-address", SCORED, "dead-letter", ("learner",),
            "address ../outside/segments.zarr#id",
            lambda s: _one(_scored(s, "relative-scored", f"../{s.outside.name}/{seg}{sid}"))),
        Row("absolute-scored-address", SCORED, "dead-letter", ("learner",),
            "address <outside>/segments.zarr#id",
            lambda s: _one(_scored(s, "absolute-scored", f"{s.outside / seg}{sid}"))),
        Row("nan-reward-scored", SCORED, "dead-letter", ("learner",),
            "NaN in step_rewards",
            lambda s: _one(_scored(s, "nan-scored", f"{s.segment_store()}{sid}",
                                   step_rewards=[0.0, math.nan, 0.0, 0.0]))),
        Row("unknown-tag-scored", SCORED, "dead-letter", ("learner",),
            "an event type no build knows", _unknown_tag(SCORED)),
        Row("duplicate-id-scored", SCORED, "duplicate", (),
            "a real verdict again under its id, another total",
            _copy_of_live(SCORED, lambda d: d.update(total=d["total"] + 100.0))),
        # policy-version: the sampler, the evaluator, the keeper
        Row("forged-version-wrong-producer", POLICY_VERSION, "dead-letter",
            ("sampler", "evaluator", "keeper"),
            "version +1000 by 'mallory', naming a valid checkpoint outside the run",
            lambda s: _one(_version(s, "forged-mallory", "mallory", _outside_checkpoint(s))),
            fast=True),
        Row("forged-version-other-run", POLICY_VERSION, "foreign", (),
            "version +1000 of another run id",
            lambda s: _one(_version(s, "forged-other-run", "learner", _outside_checkpoint(s),
                                    run_id=f"{s.run_id}-other"))),
        Row("version-checkpoint-outside", POLICY_VERSION, "dead-letter",
            ("sampler", "evaluator", "keeper"),
            "by 'learner', checkpoint: an absolute path outside the run",
            lambda s: _one(_version(s, "outside", "learner", _outside_checkpoint(s)))),
        Row("version-checkpoint-relative", POLICY_VERSION, "dead-letter",
            ("sampler", "evaluator", "keeper"),
            "by 'learner', checkpoint: ../outside/v...safetensors",
            lambda s: _one(_version(s, "relative", "learner", _relative_checkpoint(s)))),
        Row("version-checkpoint-dotdot", POLICY_VERSION, "dead-letter",
            ("sampler", "evaluator", "keeper"),
            "by 'learner', checkpoint: <run>/checkpoints/../../outside/v...safetensors",
            lambda s: _one(_version(s, "dotdot", "learner",
                                    _dotdot_checkpoint(s, "checkpoints")))),
        Row("version-checkpoint-ftp", POLICY_VERSION, "dead-letter",
            ("sampler", "evaluator", "keeper"),
            "by 'learner', checkpoint: ftp://127.0.0.1:<listening port>/v...safetensors",
            lambda s: _one(_version(s, "ftp", "learner", _ftp(s, s.sentinel.name)))),
        Row("forged-version-missing-checkpoint", POLICY_VERSION, "dead-letter",
            ("sampler", "evaluator"),
            "version +1000 by 'learner', stamped a day ahead, naming a checkpoint in the "
            "run's root that no file has (the keeper answers with a checkpoint-fault)",
            lambda s: _one(_version(s, "missing", "learner",
                                    f"{s.checkpoint_root()}/v{s.version + 1000:012d}-"
                                    f"{'0' * 64}.safetensors", checkpoint_hash="0" * 64,
                                    ts=time.time() + 86_400))),
        Row("forged-version-missing-checkpoint-at-restart", POLICY_VERSION, "dead-letter",
            ("sampler", "evaluator"),
            "the same, published just before every role restarts: the newest version a "
            "restart finds",
            lambda s: _one(_version(s, "missing-at-restart", "learner",
                                    f"{s.checkpoint_root()}/v{s.version + 2000:012d}-"
                                    f"{'0' * 64}.safetensors", checkpoint_hash="0" * 64,
                                    version=s.version + 2000)),
            fast=True, when="restart"),
        Row("nan-metrics-version", POLICY_VERSION, "dead-letter",
            ("sampler", "evaluator", "keeper"),
            "NaN in metrics",
            lambda s: _one(_version(s, "nan-metrics", "learner", _outside_checkpoint(s),
                                    metrics={"loss": math.nan}))),
        Row("random-bytes-version", POLICY_VERSION, "dead-letter",
            ("sampler", "evaluator", "keeper"),
            "96 random bytes", _random_bytes("policy-version")),
        Row("duplicate-id-version", POLICY_VERSION, "duplicate", (),
            "a real version again under its id", _copy_of_live(POLICY_VERSION)),
        # keeper: the learner (rollback orders), the keeper's own restart (its slots)
        Row("forged-kept-checkpoint-wrong-producer", KEEPER, "not-folded", (),
            "'best' slot by 'mallory', naming a valid checkpoint outside the run",
            lambda s: _one(_kept(s, "kept-mallory", "mallory", _outside_checkpoint(s))),
            fast=True),
        Row("kept-checkpoint-outside", KEEPER, "not-folded", (),
            "'best' slot by 'keeper', file outside the keeper's store",
            lambda s: _one(_kept(s, "kept-outside", "keeper", _outside_checkpoint(s)))),
        Row("kept-checkpoint-dotdot", KEEPER, "not-folded", (),
            "'best' slot by 'keeper', <run>/keeper/../../outside/v...safetensors",
            lambda s: _one(_kept(s, "kept-dotdot", "keeper",
                                 _dotdot_checkpoint(s, "keeper")))),
        Row("forged-rollback-wrong-producer", KEEPER, "dead-letter", ("learner",),
            "rollback order by 'mallory' to a checkpoint outside the run",
            lambda s: _one(_rollback(s, "rollback-mallory", "mallory",
                                     _outside_checkpoint(s)))),
        Row("rollback-checkpoint-outside", KEEPER, "dead-letter", ("learner",),
            "rollback order by 'keeper' to a checkpoint outside its store",
            lambda s: _one(_rollback(s, "rollback-outside", "keeper",
                                     _outside_checkpoint(s)))),
        Row("random-bytes-keeper", KEEPER, "dead-letter", ("learner",),
            "96 random bytes", _random_bytes("keeper")),
        # eval: the keeper; eval-request: the evaluator; telemetry: the sampler
        Row("nan-eval-result", EVAL, "dead-letter", ("keeper",),
            "NaN success rate",
            lambda s: _one(_envelope(s, "eval-result", "nan-eval", "eval",
                                     policy_version=max(s.version, 0), episodes=4,
                                     success_rate=math.nan, mean_score=0.0, mean_length=1.0)),
            fast=True),
        Row("random-bytes-eval", EVAL, "dead-letter", ("keeper",),
            "96 random bytes", _random_bytes("eval")),
        Row("random-bytes-eval-request", EVAL_REQUEST, "dead-letter", ("evaluator",),
            "96 random bytes", _random_bytes("eval-request")),
        Row("nan-heartbeat", TELEMETRY, "dead-letter", ("sampler",),
            "a heartbeat with a NaN stat",
            lambda s: _one(_envelope(s, "heartbeat", "nan-heartbeat", "hostile",
                                     actor="hostile", role="hostile", processed=0, lag=0,
                                     in_flight=0, uptime_s=math.nan))),
        Row("random-bytes-telemetry", TELEMETRY, "dead-letter", ("sampler",),
            "96 random bytes", _random_bytes("telemetry")),
    ]
    names = [r.name for r in rows]
    assert len(names) == len(set(names)), "row names must be unique"
    return rows


ROWS: tuple[Row, ...] = tuple(_rows())
FAST_ROWS: tuple[Row, ...] = tuple(r for r in ROWS if r.fast)
