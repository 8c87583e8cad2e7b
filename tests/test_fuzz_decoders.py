"""Fuzzing the wire contract and the actors that consume it.

1. Random bytes (and random msgpack carrying a real type tag) to ``schemas.decode`` for
   every topic: an event of that topic's union comes back, or ``DecodeError`` — never any
   other exception.
2. Random *structurally valid* events, built from each Struct's fields: encode -> decode
   round-trips. One field broken (wrong type, NaN/inf, negative index, too many tokens):
   ``DecodeError`` whose reason names the field.
3. Handler fuzz through a real (embedded) bus: the echo actor, the arbiter and the segmenter
   get a few hundred mixed inputs (garbage, valid, invalid, duplicates); the actor keeps
   running and every input is accounted for: processed + dead letters + duplicates == inputs.

``GYRE_FUZZ_EXAMPLES`` scales the decoder example counts (default 10 000 per decoder).
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import time
import typing

import msgspec
import pytest
from conftest import TinyConfig
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from schemas import DecodeError, decode, encode, event_id
from schemas.events import (
    MAX_TEXT_CHARS,
    MAX_TOKENS_PER_STEP,
    SCHEMA_VERSION,
    EnvError,
    Milestone,
    Probe,
    Scored,
    SegmentClosed,
    SegmentDropped,
    TrajectoryStep,
)
from schemas.topics import (
    DEAD_LETTER,
    PROBE_IN,
    SCORED,
    SEGMENT_CLOSED,
    TOPIC_UNIONS,
    TRAJECTORY_STEP,
)

N = int(os.environ.get("GYRE_FUZZ_EXAMPLES", "10000"))
#: Structured examples cost ~3 ms each here (generation dominates), so the per-topic
#: structured properties default to fewer; GYRE_FUZZ_STRUCT_EXAMPLES=10000 for a long soak.
N_STRUCT = int(os.environ.get("GYRE_FUZZ_STRUCT_EXAMPLES", "250"))
_HC = [HealthCheck.too_slow, HealthCheck.data_too_large]
FUZZ = settings(max_examples=N, deadline=None, database=None, suppress_health_check=_HC)
FUZZ_STRUCT = settings(max_examples=N_STRUCT, deadline=None, database=None,
                       suppress_health_check=_HC)
TOPICS = sorted(TOPIC_UNIONS)


def union_types(topic: str) -> tuple[type, ...]:
    union = TOPIC_UNIONS[topic]
    return typing.get_args(union) or (union,)


def tag_of(cls: type) -> str:
    return msgspec.inspect.type_info(cls).tag


# -- 1. random bytes ------------------------------------------------------------------------

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
                     st.floats(), st.text(max_size=8), st.binary(max_size=8))
_values = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)),
    max_leaves=12)


def _tagged_msgpack(topic: str) -> st.SearchStrategy[bytes]:
    """Random maps that carry one of the topic's real type tags (reach the typed decoder)."""
    tags = [tag_of(c) for c in union_types(topic)] + ["unknown-tag"]
    return st.builds(
        lambda tag, body, version: msgspec.msgpack.encode(
            {**body, "type": tag, "schema_version": version}),
        st.sampled_from(tags), st.dictionaries(st.text(max_size=12), _values, max_size=6),
        st.integers(-2, SCHEMA_VERSION + 1))


@pytest.mark.slow
@FUZZ
@given(st.one_of(st.binary(max_size=256), st.sampled_from(TOPICS).flatmap(_tagged_msgpack)))
def test_random_bytes_decode_or_decode_error(data: bytes):
    # Every example goes to every topic's decoder: N examples per decoder, one generation.
    for topic in TOPICS:
        try:
            event = decode(topic, data)
        except DecodeError as exc:
            assert exc.reason
            continue
        assert isinstance(event, union_types(topic)), (topic, event)


# -- 2. structurally valid events, and one field broken -----------------------------------

_small_int = st.integers(0, 10_000)
_finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)
_text = st.text(max_size=12)


def _strategy_for(t: msgspec.inspect.Type) -> st.SearchStrategy:
    I = msgspec.inspect  # noqa: E741
    if isinstance(t, I.IntType):
        return _small_int
    if isinstance(t, I.FloatType):
        return _finite
    if isinstance(t, I.StrType):
        return _text
    if isinstance(t, I.BoolType):
        return st.booleans()
    if isinstance(t, I.BytesType):
        return st.binary(max_size=32)
    if isinstance(t, I.NoneType):
        return st.none()
    if isinstance(t, I.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, I.ListType):
        return st.lists(_strategy_for(t.item_type), max_size=5)
    if isinstance(t, I.DictType):
        return st.dictionaries(_text, _strategy_for(t.value_type), max_size=4)
    if isinstance(t, I.UnionType):
        return st.one_of([_strategy_for(x) for x in t.types])
    if isinstance(t, I.StructType):
        return _struct_fields(t.cls).map(lambda kw: t.cls(**kw))
    raise NotImplementedError(f"no strategy for {t!r}")


def _struct_fields(cls: type) -> st.SearchStrategy[dict]:
    required, optional = {}, {}
    for f in msgspec.inspect.type_info(cls).fields:
        if f.name == "schema_version":
            strat = st.integers(0, SCHEMA_VERSION)
        elif f.name == "ts":
            strat = st.floats(0, 2e9)
        else:
            strat = _strategy_for(f.type)
        (required if f.required else optional)[f.name] = strat
    return st.fixed_dictionaries(required, optional=optional)


def _repair(cls: type, kw: dict) -> dict:
    """Satisfy cross-field constraints that field-wise generation cannot know."""
    name = cls.__name__
    if name == "TrajectoryStep":
        kw["action_logprobs"] = [-abs(x) for x in kw["action_logprobs"]]
        kw["action_logprobs"] = (kw["action_logprobs"]
                                 + [-0.5] * len(kw["action_tokens"]))[: len(kw["action_tokens"])]
    elif name == "SegmentClosed":
        n = max(len(kw.get("feedback", [])), 1 + kw["step_end"] % 7)
        if kw.get("feedback"):
            n = len(kw["feedback"])
        kw["step_end"] = kw["step_start"] + n
        kw["min_policy_version"] = abs(kw["min_policy_version"])
        if kw.get("actions"):  # one text per step
            kw["actions"] = [kw["actions"][i % len(kw["actions"])] for i in range(n)]
        if "milestone_steps" in kw:
            kw["milestone_steps"] = [kw["step_start"] + i % n
                                     for i in range(len(kw.get("milestones", [])))]
    elif name == "Scored":
        kw["step_end"] = kw["step_start"] + len(kw["step_rewards"])
    elif name == "Rollback":
        kw["learning_rate"] = abs(kw["learning_rate"]) + 1e-6
    return kw


def valid_events(cls: type) -> st.SearchStrategy:
    return _struct_fields(cls).map(lambda kw: cls(**_repair(cls, kw)))


def topic_events(topic: str) -> st.SearchStrategy:
    return st.one_of([valid_events(c) for c in union_types(topic)])


@pytest.mark.parametrize("topic", TOPICS)
def test_valid_events_round_trip(topic):
    @FUZZ_STRUCT
    @given(topic_events(topic))
    def check(event) -> None:
        data = encode(event)
        back = decode(topic, data)
        assert back == event
        assert encode(back) == data

    check()


def _fields(cls: type) -> dict[str, msgspec.inspect.Type]:
    return {f.name: f.type for f in msgspec.inspect.type_info(cls).fields}


def _holds_float(t: msgspec.inspect.Type) -> bool:
    I = msgspec.inspect  # noqa: E741
    if isinstance(t, I.FloatType):
        return True
    if isinstance(t, I.UnionType):
        return any(_holds_float(x) for x in t.types)
    if isinstance(t, I.ListType):
        return _holds_float(t.item_type)
    if isinstance(t, I.DictType):
        return _holds_float(t.value_type)
    if isinstance(t, I.StructType):
        return any(_holds_float(f.type) for f in t.fields)
    return False


#: Fields that must reject NaN/inf at decode: every field of every event whose type holds a
#: float anywhere (rewards, log-probs, feedback, metrics, eval rates, timestamps, nested
#: primitive steps), read off the schema so that a float field added later is covered too.
MUST_BE_FINITE: dict[str, tuple[str, ...]] = {
    cls.__name__: fields for topic in TOPICS for cls in union_types(topic)
    if (fields := tuple(f for f, t in _fields(cls).items() if _holds_float(t)))}
#: Indices with a non-negative constraint in the schema.
NON_NEGATIVE: dict[str, tuple[str, ...]] = {
    "TrajectoryStep": ("step_index", "policy_version"),
    "EnvError": ("step_index",),
    "SegmentClosed": ("step_start",),
    "PolicyVersion": ("version",),
    "Probe": ("seq",),
}


def _poison(value, bad: float):
    """Put a non-finite float into a float, a list of floats or a dict of floats."""
    if isinstance(value, list):
        return [bad] + value[1:] if value else [bad]
    if isinstance(value, dict):
        return {**value, "k": bad}
    return bad


@st.composite
def broken_event(draw, topic: str):
    """(bytes, field, expected reason fragment) for an event with exactly one field broken."""
    event = draw(topic_events(topic))
    cls = type(event)
    name = cls.__name__
    d = msgspec.to_builtins(event, builtin_types=(bytes,))
    fields = _fields(cls)
    kinds = ["wrong-type"]
    if name in MUST_BE_FINITE:
        kinds.append("non-finite")
    if name in NON_NEGATIVE:
        kinds.append("negative")
    if name == "TrajectoryStep":
        kinds += ["too-many-tokens", "too-long-text"]
    kind = draw(st.sampled_from(kinds))
    if kind == "wrong-type":
        field = draw(st.sampled_from(sorted(f for f in fields if f != "schema_version")))
        t = fields[field]
        is_textual = isinstance(t, (msgspec.inspect.StrType, msgspec.inspect.LiteralType))
        d[field] = 12345 if is_textual else "wrong-type"
        expect = f"$.{field}"
    elif kind == "non-finite":
        field = draw(st.sampled_from(MUST_BE_FINITE[name]))
        bad = draw(st.sampled_from([math.nan, math.inf, -math.inf]))
        t = fields[field]
        if isinstance(t, msgspec.inspect.ListType) and \
                isinstance(t.item_type, msgspec.inspect.StructType):  # a nested float
            inner = t.item_type.cls
            item = msgspec.to_builtins(inner(**draw(_struct_fields(inner))))
            item.update({f: bad for f, ft in _fields(inner).items() if _holds_float(ft)})
            d[field] = [item]
        else:
            d[field] = _poison(d[field], bad)
        if field == "action_logprobs":  # keep the lengths consistent: only one thing broken
            d["action_tokens"] = (d["action_tokens"] + [1])[: len(d[field])] or [1]
            d[field] = d[field][: len(d["action_tokens"])]
        if field == "feedback" and name == "SegmentClosed":
            d["step_end"] = d["step_start"] + len(d[field])
            # milestones stay inside the (possibly shorter) step range: one thing broken
            d["milestone_steps"] = [d["step_start"]] * len(d["milestone_steps"])
        if field == "step_rewards":
            d["step_end"] = d["step_start"] + len(d[field])
        expect = field
    elif kind == "negative":
        field = draw(st.sampled_from(NON_NEGATIVE[name]))
        d[field] = -draw(st.integers(1, 2**40))
        if field == "step_start":
            d["step_end"] = d[field] + max(len(d["feedback"]), 1)
        expect = field
    elif kind == "too-many-tokens":
        field = "context_tokens"
        d[field] = [1] * (MAX_TOKENS_PER_STEP + 1 - len(d["action_tokens"]))
        expect = "tokens"
    else:
        field = "action_text"
        d[field] = "x" * (MAX_TEXT_CHARS + 1)
        expect = field
    return msgspec.msgpack.encode(d), field, expect


@pytest.mark.parametrize("topic", TOPICS)
def test_one_broken_field_is_rejected_naming_it(topic):
    @FUZZ_STRUCT
    @given(broken_event(topic))
    def check(case) -> None:
        data, field, expect = case
        with pytest.raises(DecodeError) as info:
            decode(topic, data)
        assert expect in info.value.reason, (field, info.value.reason)

    check()


# -- 3. handler fuzz through a real bus -----------------------------------------------------

def _garbage(rng: random.Random) -> bytes:
    choice = rng.randrange(4)
    if choice == 0:
        return rng.randbytes(rng.randrange(0, 64))
    if choice == 1:
        return msgspec.msgpack.encode({"type": rng.choice(["probe", "segment-closed",
                                                           "trajectory-step", "x"]),
                                       "seq": rng.choice([1, "a", None, -3])})
    if choice == 2:  # a valid event of another topic
        return encode(Probe(event_id=f"g{rng.random()}", run_id="t", producer="f", seq=1)) \
            if rng.random() < 0.5 else encode(EnvError(
                event_id=f"g{rng.random()}", run_id="t", producer="f", trajectory_id="x",
                task_id="x", step_index=0, kind="timeout", message="m"))
    return msgspec.msgpack.encode({"schema_version": 99, "type": "probe"})


def _rand_float(rng: random.Random) -> float:
    return rng.choice([0.0, 1.0, -1.5, rng.uniform(-10, 10), 1e30, -1e30])


def _step(rng: random.Random, tid: str, index: int) -> TrajectoryStep:
    n_act = rng.randrange(0, 4)
    return TrajectoryStep(
        event_id=event_id("step", tid, index, rng.random()), run_id="t", producer="fuzz",
        key=tid, trajectory_id=tid, task_id="task", step_index=index,
        policy_version=rng.randrange(0, 3),
        context_tokens=[rng.randrange(0, 2**31) for _ in range(rng.randrange(0, 6))],
        action_tokens=[rng.randrange(0, 2**31) for _ in range(n_act)],
        action_logprobs=[-rng.random() * 5 for _ in range(n_act)],
        action_text=rng.choice(["", "go", "x" * 50]), feedback=_rand_float(rng),
        milestones=[Milestone(name=rng.choice(["a", "b"]), proof=rng.choice(["", "p"]))]
        if rng.random() < 0.2 else [],
        state_changed=rng.random() < 0.1, done=rng.random() < 0.05,
        truncated=rng.random() < 0.03, success=rng.random() < 0.5,
        next_context_tokens=rng.choice([None, [1, 2, 3]]),
    )


def _segment(rng: random.Random, i: int) -> SegmentClosed:
    start = rng.randrange(0, 50)
    n = rng.randrange(1, 6)
    milestones = [Milestone(name=rng.choice(["a", "b", "c"]), proof=rng.choice(["", "p"]))
                  for _ in range(rng.randrange(0, 3))]
    # milestone steps inside the segment, or absent (outside ones are refused at decode:
    # the `_invalid` mutations cover that path)
    steps = [start + rng.randrange(n) for _ in milestones] if rng.random() < 0.8 else []
    return SegmentClosed(
        event_id=event_id("seg", i, rng.random()), run_id="t", producer="fuzz",
        key=f"traj{i % 7}", segment_id=f"s{i}", trajectory_id=f"traj{i % 7}", task_id="task",
        step_start=start, step_end=start + n, boundary=rng.choice(
            ["milestone", "state-change", "max-length", "trajectory-end"]),
        address="a", content_hash="h", min_policy_version=0, max_policy_version=1,
        trajectory_done=rng.random() < 0.3, success=rng.random() < 0.5,
        milestones=milestones, milestone_steps=steps,
        feedback=rng.choice([[], [_rand_float(rng) for _ in range(n)]]),
        actions=["x"] * n,
    )


def _scored(rng: random.Random, i: int) -> Scored:
    """A structurally valid verdict on a segment in another store: the learner must refuse
    it visibly (a dead letter: an address outside the run's roots), not stall on it."""
    n = rng.randrange(1, 40)
    return Scored(
        event_id=event_id("scored", i, rng.random()), run_id="t", producer="fuzz",
        key=f"traj{i % 7}", segment_id=f"s{i}", trajectory_id=f"traj{i % 7}", task_id="task",
        address=rng.choice(["elsewhere#s1", f"file:///nonexistent/segments.zarr#s{i}"]),
        content_hash="h", step_start=0, step_end=n, min_policy_version=0,
        trajectory_done=rng.random() < 0.3, success=rng.random() < 0.5,
        components={"outcome": _rand_float(rng)}, step_rewards=[_rand_float(rng)] * n,
        total=_rand_float(rng), decided_by="outcome")


def _probe(rng: random.Random, i: int) -> Probe:
    return Probe(event_id=event_id("probe", i), run_id="t", producer="fuzz", key=f"k{i % 5}",
                 seq=i, payload=rng.choice(["p", "boom", ""]))


def _invalid(event) -> bytes:
    d = msgspec.to_builtins(event, builtin_types=(bytes,))
    for field in ("seq", "step_index", "step_start"):
        if field in d:
            d[field] = -1
            break
    else:
        d["event_id"] = 5
    return msgspec.msgpack.encode(d)


def make_inputs(role: str, n: int, seed: int) -> list[tuple[bytes | None, bytes]]:
    rng = random.Random(seed)
    out: list[tuple[bytes | None, bytes]] = []
    counters: dict[str, int] = {}
    for i in range(n):
        r = rng.random()
        if role == "segmenter":
            tid = f"traj{rng.randrange(8)}"
            index = counters.get(tid, 0) + rng.choice([0, 1, 1, 1, 1, 2, -1])
            counters[tid] = max(index, 0)
            event = _step(rng, tid, max(index, 0))
        elif role == "arbiter":
            event = _segment(rng, i)
        elif role == "learner":
            event = _scored(rng, i)
        else:
            event = _probe(rng, i)
        if r < 0.15:
            out.append((b"k", _garbage(rng)))
        elif r < 0.25:
            out.append((b"k", _invalid(event)))
        elif r < 0.32 and out:
            out.append(rng.choice(out))  # exact redelivery of an earlier input
        else:
            out.append((event.key.encode() or None, encode(event)))
    if role == "segmenter":  # end every trajectory, so open segments close and commit
        for t in range(8):
            err = EnvError(event_id=event_id("end", t), run_id="t", producer="fuzz",
                           key=f"traj{t}", trajectory_id=f"traj{t}", task_id="task",
                           step_index=counters.get(f"traj{t}", 0) + 1, kind="timeout",
                           message="end")
            out.append((err.key.encode(), encode(err)))
    return out


def _decodes(topic: str, value: bytes) -> bool:
    try:
        decode(topic, value)
    except DecodeError:
        return False
    return True


def _actor(role: str, tmp_path, tiny: TinyConfig):
    if role == "echo":
        from actors.echo import EchoActor
        from schemas.config import EchoConfig

        return EchoActor(EchoConfig(fail_on_payload="boom")), PROBE_IN
    if role == "arbiter":
        from actors.arbiter import Arbiter
        from schemas.config import ArbiterConfig

        return Arbiter(ArbiterConfig()), SEGMENT_CLOSED
    if role == "learner":
        from actors.learner import Learner

        cfg = tiny.config(run={"run_dir": str(tmp_path), "run_id": "t"})
        return Learner(cfg), SCORED
    from actors.segmenter import Segmenter
    from schemas.config import SegmenterConfig

    return (Segmenter(SegmenterConfig(), store_url=str(tmp_path / "seg.zarr"), run_id="t"),
            TRAJECTORY_STEP)


@pytest.mark.parametrize("role,seed", [("echo", 1), ("arbiter", 2), ("segmenter", 3),
                                       ("learner", 4)])
async def test_actor_survives_fuzz_and_drops_nothing(role, seed, tmp_path, tiny):
    from gyre_async.bus import open_bus
    from gyre_async.bus.reading import read_topics
    from gyre_async.runtime.actor import ActorRunner

    actor, topic = _actor(role, tmp_path, tiny)
    inputs = make_inputs(role, 300, seed)
    async with open_bus(f"sqlite:///{tmp_path}/events.db") as bus:
        await bus.create_topics([topic], 2)
        await bus.publish(topic, inputs)
        runner = ActorRunner(actor, bus, run_id="t", heartbeat_s=30, partitions=2)
        task = asyncio.create_task(runner.run())
        deadline = time.monotonic() + 60
        accounted = 0
        lag = -1
        while time.monotonic() < deadline and not task.done():
            await asyncio.sleep(0.1)
            accounted = runner.processed + runner.dead_letters + runner.duplicates
            if accounted >= len(inputs):
                lag = await bus.lag(runner.group, actor.consumes)
                if lag == 0 or role in ("segmenter", "learner"):
                    break
        crashed = task.done()
        runner.stop()
        try:
            await asyncio.wait_for(task, 30)
        except Exception as exc:  # noqa: BLE001 - reported below with the counters
            error = exc
        else:
            error = None
        dead = [decode(DEAD_LETTER, r.value) for r in await read_topics(bus, [DEAD_LETTER])]
        dropped = {e.segment_id for r in await read_topics(bus, ["telemetry"])
                   if isinstance(e := decode("telemetry", r.value), SegmentDropped)}
    assert not crashed, f"{role} crashed: {error!r}"
    assert error is None, f"{role} failed on stop: {error!r}"
    assert len(dead) == runner.dead_letters
    assert runner.processed + len(dead) + runner.duplicates == len(inputs), (
        runner.processed, len(dead), runner.duplicates, len(inputs))
    if role == "learner":  # every verdict it took is refused visibly or still buffered
        buffered = {b.scored.segment_id for b in actor.core.buffer}
        taken = {decode(SCORED, v).segment_id for _, v in inputs if _decodes(SCORED, v)}
        # an address outside the run's segment stores: dead-lettered before any read
        untrusted = {decode(SCORED, d.original).segment_id for d in dead
                     if "untrusted address" in d.reason}
        assert taken <= dropped | buffered | untrusted, \
            sorted(taken - dropped - buffered - untrusted)[:5]
        assert untrusted
    if role not in ("segmenter", "learner"):
        # The segmenter (open segments) and the learner (its unfilled batch) may still hold
        # their last offsets uncommitted (commit_floor) until a later batch arrives; the
        # stateless roles must be fully caught up.
        assert lag == 0
