"""A bad input is dead-lettered, never kept: through real buses, every path where one input
could stop a role for good.

- a ``segment-closed`` claiming an absurd step range (a few hundred bytes that would make a
  ``scored`` event of megabytes) is refused at decode; the arbiter scores on, commits, and
  restarts cleanly;
- an output too large for the bus dead-letters the input that made it (the size and the
  limit in the reason) and the offset is committed: never a crash loop, whichever role;
- a legitimate segment of 64 steps with the longest action texts is split into parts that
  each fit the bus, and every part is scored;
- a buffered input whose later processing fails (the learner's) is dead-lettered once and
  leaves the buffer: later batches train;
- read-back decodes with the live size limit: an oversized record is a bad record.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from scratch import ScratchBus, run_until
from test_bad_inputs import store_segment, tiny_learner_config

from actors.arbiter import Arbiter
from actors.echo import EchoActor
from actors.learner import Learner
from actors.segmenter import Segmenter
from gyre_async.bus import open_bus
from gyre_async.bus.reading import ReadCounts, UndecodableRecord, read_events, read_topics
from gyre_async.runtime.actor import ActorRunner
from gyre_async.storage.segments import SegmentStore
from schemas import decode, encode, event_id
from schemas.config import ArbiterConfig, EchoConfig, RuleSpec, SegmenterConfig
from schemas.events import (
    MAX_TEXT_CHARS,
    PolicyVersion,
    Probe,
    Scored,
    SegmentClosed,
    SegmentDropped,
    TrajectoryStep,
)
from schemas.topics import (
    DEAD_LETTER,
    POLICY_VERSION,
    PROBE_IN,
    PROBE_OUT,
    SCORED,
    SEGMENT_CLOSED,
    TELEMETRY,
    TRAJECTORY_STEP,
)


def segment(run_id: str, traj: str, start: int, n: int, **kw) -> SegmentClosed:
    return SegmentClosed(
        event_id=event_id("seg", run_id, traj, start), run_id=run_id, producer="test",
        key=traj, segment_id=f"{traj}-{start}", trajectory_id=traj, task_id="task",
        step_start=start, step_end=start + n, boundary="max-length", address="a",
        content_hash="h", min_policy_version=0, max_policy_version=0, **kw)


async def events_of(bus, topic: str, run_id: str) -> list:
    return [e for r in await read_topics(bus, [topic])
            if (e := decode(topic, r.value, 1 << 30)).run_id == run_id]


async def dead_letters_of(bus, run_id: str) -> list:
    """This test's dead letters (on a shared broker, other tests' bad records, refused by
    this test's consumer too, carry this run's id: their original bytes tell them apart)."""
    return [d for d in await events_of(bus, DEAD_LETTER, run_id)
            if run_id.encode() in d.original]


async def run_while(runner: ActorRunner, waiting, timeout: float = 60) -> BaseException | None:
    """Run until ``waiting()`` is false (or the timeout); the actor's error, if it crashed."""
    task = asyncio.create_task(runner.run())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not task.done() and await waiting():
        await asyncio.sleep(0.1)
    crashed = task.done()
    runner.stop()
    try:
        await asyncio.wait_for(task, 30)
    except Exception as exc:  # noqa: BLE001 - returned for the assertion to show
        return exc
    return RuntimeError("crashed") if crashed else None


async def test_a_segment_claiming_200000_steps_is_dead_lettered_and_the_arbiter_scores_on(
        bus_url, unique):
    """~300 bytes claiming 200,000 steps would make a 1.8 MB verdict: refused at decode."""
    good = [segment(unique, "a", 0, 4, feedback=[0.0] * 4), segment(unique, "b", 0, 3)]
    absurd = msgspec.to_builtins(segment(unique, "x", 0, 1))
    absurd["step_end"] = 200_000
    absurd_bytes = msgspec.msgpack.encode(absurd)
    assert len(absurd_bytes) < 400
    late = segment(unique, "c", 0, 2)
    async with open_bus(bus_url) as bus:
        await bus.create_topics([SEGMENT_CLOSED, SCORED, DEAD_LETTER], 2)
        await bus.publish(SEGMENT_CLOSED, [(b"a", encode(good[0])), (b"x", absurd_bytes),
                                           (b"b", encode(good[1])), (b"c", encode(late))])
        arbiter = Arbiter(ArbiterConfig(), max_segment_steps=32)
        runner = ActorRunner(arbiter, bus, run_id=unique, heartbeat_s=30, partitions=2)

        async def not_done() -> bool:
            return (len(await events_of(bus, SCORED, unique)) < 3
                    or runner.dead_letters < 1 or await bus.lag(runner.group, [SEGMENT_CLOSED]))

        error = await run_while(runner, not_done)
        assert error is None, repr(error)
        scored = await events_of(bus, SCORED, unique)
        dead = await dead_letters_of(bus, unique)
        assert sorted(e.segment_id for e in scored) == ["a-0", "b-0", "c-0"]
        assert len(dead) == 1 and dead[0].original == absurd_bytes
        assert "200000" in dead[0].reason and "steps" in dead[0].reason, dead[0].reason
        assert await bus.lag(runner.group, [SEGMENT_CLOSED]) == 0  # the commit moved past it

        # a restart finds nothing to redo and does not crash
        again = ActorRunner(Arbiter(ArbiterConfig(), max_segment_steps=32), bus,
                            run_id=unique, heartbeat_s=30, partitions=2)

        async def briefly() -> bool:
            await asyncio.sleep(1.0)
            return False

        assert await run_while(again, briefly) is None
        assert again.processed == 0 and again.dead_letters == 0
        assert len(await events_of(bus, SCORED, unique)) == 3


async def test_a_segment_longer_than_the_runs_segments_is_dead_lettered(scratch_bus):
    """Within the schema's bound but longer than this run's segmenter ever closes."""
    await scratch_bus.publish(SEGMENT_CLOSED, segment("r", "x", 0, 500), segment("r", "y", 0, 5),
                              key=b"k")
    runner = scratch_bus.runner(Arbiter(ArbiterConfig(), max_segment_steps=32), run_id="r")
    await run_until(runner, lambda: runner.processed + runner.dead_letters >= 2)
    dead = await scratch_bus.dead_letters()
    scored = await scratch_bus.events(SCORED)
    assert [e.segment_id for e in scored] == ["y-0"]
    assert len(dead) == 1 and "max_segment_steps (32)" in dead[0].reason, dead[0].reason


async def test_a_verdict_too_large_for_the_bus_dead_letters_its_segment_and_commits(
        bus_url, unique):
    """A bus limit of 4 KiB: a 1000-step segment (a few hundred bytes) would be scored with
    9 KB of rewards. The segment is dead-lettered with the size and the limit, the arbiter's
    state is untouched (it is still the fold of its log), the next segment is scored."""
    big = segment(unique, "big", 0, 1000)
    small = segment(unique, "small", 0, 3)
    async with open_bus(bus_url) as producer, \
            open_bus(bus_url, max_message_bytes=4096) as bus:
        await producer.create_topics([SEGMENT_CLOSED, SCORED, DEAD_LETTER], 2)
        await producer.publish(SEGMENT_CLOSED, [(b"big", encode(big)), (b"s", encode(small))])
        arbiter = Arbiter(ArbiterConfig())  # no step bound from a config: the size decides
        runner = ActorRunner(arbiter, bus, run_id=unique, heartbeat_s=30, partitions=2)

        async def not_done() -> bool:
            return (runner.processed + runner.dead_letters < 2
                    or await bus.lag(runner.group, [SEGMENT_CLOSED]) > 0)

        assert await run_while(runner, not_done) is None
        dead = await dead_letters_of(bus, unique)
        scored = await events_of(bus, SCORED, unique)
        assert await bus.lag(runner.group, [SEGMENT_CLOSED]) == 0
    assert [e.segment_id for e in scored] == ["small-0"]
    assert len(dead) == 1 and dead[0].original == encode(big)
    reason = dead[0].reason
    assert "output too large" in reason and "4096" in reason and "Scored" in reason, reason
    assert "big-0" not in arbiter.core.handled  # nothing applied for what never went out


async def test_any_roles_oversized_output_dead_letters_its_input(bus_url, unique):
    """The runtime's own check, for a role that measures nothing itself: an echo whose
    answer is larger than the probe it answers (its producer name is longer)."""
    limit = 4096
    name = "echo-" + "n" * 300
    fits = Probe(event_id=event_id("p", unique, 0), run_id=unique, producer="t", key="k",
                 seq=0, payload="x" * (limit - 400))
    assert len(encode(fits)) <= limit
    small = Probe(event_id=event_id("p", unique, 1), run_id=unique, producer="t", key="k",
                  seq=1, payload="ok")
    async with open_bus(bus_url, max_message_bytes=limit) as bus:
        await bus.create_topics([PROBE_IN, PROBE_OUT, DEAD_LETTER], 1)
        await bus.publish(PROBE_IN, [(b"k", encode(fits)), (b"k", encode(small))])
        runner = ActorRunner(EchoActor(EchoConfig()), bus, run_id=unique, name=name,
                             heartbeat_s=30, partitions=1)

        async def not_done() -> bool:
            return (runner.processed + runner.dead_letters < 2
                    or await bus.lag(runner.group, [PROBE_IN]) > 0)

        assert await run_while(runner, not_done) is None
        out = await events_of(bus, PROBE_OUT, unique)
        dead = await dead_letters_of(bus, unique)
    assert [p.seq for p in out] == [1]
    assert len(dead) == 1 and dead[0].original == encode(fits)[: limit // 2]  # its start
    assert "output too large" in dead[0].reason and f"limit {limit}" in dead[0].reason


async def test_an_output_the_broker_refuses_dead_letters_its_input(noida, unique):
    """The broker's own limit (about 1 MiB on noida-db) is below ours (4 MB): the echo's
    answer passes our check and the broker refuses it (``MessageTooLarge`` at publish). The
    input is dead-lettered instead; its dead letter, too large as well with the whole probe
    in it, keeps less of the original bytes until it fits; the next probe is answered."""
    name = "echo-" + "n" * 100_000  # the answer carries it twice (producer, and in the key)
    big = Probe(event_id=event_id("p", unique, 0), run_id=unique, producer="t", key="k",
                seq=0, payload="x" * 1_000_000)
    small = Probe(event_id=event_id("p", unique, 1), run_id=unique, producer="t", key="k",
                  seq=1, payload="ok")
    async with open_bus(f"kafka://{noida}", max_message_bytes=4_000_000) as bus:
        await bus.create_topics([PROBE_IN, PROBE_OUT, DEAD_LETTER], 1)
        await bus.publish(PROBE_IN, [(b"k", encode(big))])
        await bus.publish(PROBE_IN, [(b"k", encode(small))])
        runner = ActorRunner(EchoActor(EchoConfig()), bus, run_id=unique, name=name,
                             heartbeat_s=30, partitions=1)

        async def not_done() -> bool:
            return (runner.processed + runner.dead_letters < 2
                    or await bus.lag(runner.group, [PROBE_IN]) > 0)

        assert await run_while(runner, not_done) is None
        out = await events_of(bus, PROBE_OUT, unique)
        dead = await dead_letters_of(bus, unique)
    # the answer to the small probe may be written by each attempt (a Kafka publish is not
    # atomic across batches): copies with one event id, which consumers drop
    assert {p.event_id for p in out} == {event_id("echo", small.event_id)}
    dead = list({d.event_id: d for d in dead}.values())
    assert len(dead) == 1 and "refused by the broker" in dead[0].reason, dead[0].reason
    assert 0 < len(dead[0].original) < len(encode(big))
    assert encode(big).startswith(dead[0].original)


def long_steps(run_id: str, tid: str, n: int) -> list[TrajectoryStep]:
    """``n`` steps whose action texts are as long as a step may carry, each one word (so the
    farming guard names each by its whole text), each paid a little feedback."""
    return [TrajectoryStep(
        event_id=event_id("s", tid, i), run_id=run_id, producer="test", key=tid,
        trajectory_id=tid, task_id="task", step_index=i, policy_version=0,
        context_tokens=[1, 2, 3], action_tokens=[4, 5], action_logprobs=[-0.5, -0.5],
        action_text=f"{i:02d}" + "w" * (MAX_TEXT_CHARS - 2), feedback=0.01,
        next_context_tokens=[1, 2], done=i == n - 1, success=i == n - 1) for i in range(n)]


async def test_a_64_step_segment_of_longest_actions_is_split_to_fit_and_scored(tmp_path):
    """64 x 16 KiB of action text: one announcement would be over 1 MB. The segmenter cuts
    it into parts that fit (length cuts; the last keeps the trajectory's end), and the
    arbiter scores every part with a small verdict (farming memory names bounded)."""
    steps = long_steps("r", "t", 64)
    async with open_bus(f"sqlite:///{tmp_path}/events.db") as bus:
        await bus.create_topics([TRAJECTORY_STEP, SEGMENT_CLOSED, SCORED], 1)
        await bus.publish(TRAJECTORY_STEP, [(b"t", encode(s)) for s in steps])
        segmenter = Segmenter(SegmenterConfig(max_segment_steps=64, write_delay_s=0.0),
                              str(tmp_path / "segments.zarr"), "r")
        arbiter = Arbiter(ArbiterConfig(rules=[RuleSpec(name="env_feedback", weight=1.0)]),
                          max_segment_steps=64)
        runners = [ActorRunner(a, bus, run_id="r", heartbeat_s=30, partitions=1)
                   for a in (segmenter, arbiter)]
        tasks = [asyncio.create_task(r.run()) for r in runners]
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and not any(t.done() for t in tasks):
            scored = await events_of(bus, SCORED, "r")
            if sum(e.step_end - e.step_start for e in scored) >= 64:
                break
            await asyncio.sleep(0.2)
        crashed = [t for t in tasks if t.done()]
        for r in runners:
            r.stop()
        await asyncio.gather(*tasks)
        assert not crashed
        closed_records = await read_topics(bus, [SEGMENT_CLOSED])
        scored_records = await read_topics(bus, [SCORED])
        dead = await read_topics(bus, [DEAD_LETTER])
    closed = sorted((decode(SEGMENT_CLOSED, r.value) for r in closed_records),
                    key=lambda e: e.step_start)
    assert len(closed) > 1, "the segment should have been split"
    assert all(len(r.value) <= bus.max_message_bytes for r in closed_records)
    assert [(c.step_start, c.step_end) for c in closed] == list(
        zip([0] + [c.step_end for c in closed[:-1]], [c.step_end for c in closed]))
    assert closed[-1].step_end == 64 and closed[-1].boundary == "trajectory-end"
    assert all(c.boundary == "max-length" and not c.trajectory_done for c in closed[:-1])
    assert [a for c in closed for a in c.actions] == [s.action_text for s in steps]
    scored = [decode(SCORED, r.value) for r in scored_records]
    assert all(isinstance(e, Scored) for e in scored)
    assert sorted(e.segment_id for e in scored) == sorted(c.segment_id for c in closed)
    assert max(len(r.value) for r in scored_records) < 16_384
    assert all(len(k) <= 80 for e in scored for k in e.guard_state)
    assert dead == []


async def test_a_segment_that_cannot_be_written_is_dead_lettered_and_the_rest_announced(
        tmp_path, scratch_bus):
    """The segment id of trajectory t already holds other content in the store: the
    batched write fails for good. That segment is dead-lettered (its first step, with the
    reason); the other one of the batch is written and announced; the offsets commit."""
    from gyre_async.core.segmenter import ClosedSegment, segment_arrays
    from gyre_async.core.segmenter import segment_id as segment_id_of

    def steps_of(tid: str, token: int) -> list[TrajectoryStep]:
        return [msgspec.structs.replace(s, action_text="go", action_tokens=[token, token])
                for s in long_steps("r", tid, 4)]

    mine, theirs = steps_of("t", 7), steps_of("t", 9)
    store = SegmentStore(str(tmp_path / "segments.zarr"))
    taken = ClosedSegment("t", tuple(theirs), "trajectory-end", True)
    store.write(segment_id_of("r", ClosedSegment("t", tuple(mine), "trajectory-end", True)),
                segment_arrays(taken))
    await scratch_bus.publish(TRAJECTORY_STEP, *mine, *steps_of("u", 7))
    segmenter = Segmenter(SegmenterConfig(write_delay_s=0.0), str(tmp_path / "segments.zarr"), "r")
    runner = scratch_bus.runner(segmenter, run_id="r")

    async def done() -> bool:
        return await scratch_bus.bus.lag(runner.group, [TRAJECTORY_STEP]) == 0

    await run_until(runner, done)
    closed = await scratch_bus.events(SEGMENT_CLOSED)
    dead = await scratch_bus.dead_letters()
    assert [c.trajectory_id for c in closed] == ["u"]
    assert len(dead) == 1 and decode(TRAJECTORY_STEP, dead[0].original) == mine[0]
    assert "trajectory 't' not written" in dead[0].reason and "SegmentConflict" in dead[0].reason


async def test_a_buffered_segment_that_fails_later_is_dead_lettered_once_and_batches_train(
        tmp_path, tiny, scratch_bus):
    """A verdict whose step range does not match its stored arrays (6 claimed, 4 stored)
    fails only when the learner assembles a batch. It is refused alone (a dead letter and
    a ``segment-dropped``), leaves the buffer, and the next batches train."""
    cfg = tiny_learner_config(tiny, batch_steps=8)
    store = SegmentStore(str(tmp_path / "segments.zarr"))
    a, b, c, d = (store_segment(store, t) for t in ("traj-a", "traj-b", "traj-c", "traj-d"))
    bent = msgspec.structs.replace(store_segment(store, "traj-m"), step_end=6,
                                   step_rewards=[0.5] * 6, total=3.0)
    await scratch_bus.publish(SCORED, a, bent, b, c, d)
    learner = Learner(cfg)
    runner = scratch_bus.runner(learner)

    async def done() -> bool:
        return learner.core.version >= 2 and await scratch_bus.bus.lag(runner.group, [SCORED]) == 0

    await run_until(runner, done, timeout=120)
    dead = await scratch_bus.dead_letters()
    dropped = [e for e in await scratch_bus.events(TELEMETRY) if isinstance(e, SegmentDropped)]
    versions = [e for e in await scratch_bus.events(POLICY_VERSION) if isinstance(e, PolicyVersion)]
    assert len(dead) == 1 and dead[0].source_offset == 1, [x.reason for x in dead]
    assert "arrays do not match" in dead[0].reason and bent.segment_id in dead[0].reason
    assert decode(SCORED, dead[0].original) == bent
    assert [x.segment_id for x in dropped] == [bent.segment_id]
    assert [v.version for v in versions] == [0, 1, 2]
    assert versions[1].trained_segments == [a.segment_id, b.segment_id]
    assert versions[2].trained_segments == [c.segment_id, d.segment_id]
    assert learner.core.buffer == []


async def test_read_back_treats_an_oversized_record_as_a_bad_record(tmp_path):
    """A record live consumers refuse (over the bus limit) is not decoded on read-back
    either: skipped and counted, or raised, as the reader declares."""
    url = f"sqlite:///{tmp_path}/events.db"
    fat = Probe(event_id="fat", run_id="r", producer="t", key="k", seq=0,
                payload="x" * 30_000)
    thin = Probe(event_id="thin", run_id="r", producer="t", key="k", seq=1)
    async with open_bus(url, max_message_bytes=1 << 20) as writer:
        await writer.create_topics([PROBE_IN], 1)
        await writer.publish(PROBE_IN, [(b"k", encode(fat)), (b"k", encode(thin))])
    async with open_bus(url, max_message_bytes=4096) as bus:
        counts = ReadCounts()
        seen = [e.event_id async for _, e in read_events(bus, [PROBE_IN], counts=counts)]
        assert seen == ["thin"]
        assert counts.skipped == 1 and "oversized" in counts.last_skip_reason
        assert "4096" in counts.last_skip_reason
        with pytest.raises(UndecodableRecord, match="oversized"):
            async for _ in read_events(bus, [PROBE_IN], on_bad="raise"):
                pass
        # the live consumer refuses it the same way (a scratch runner on this bus: its limit)
        runner = ScratchBus(bus, run_id="r").runner(EchoActor(EchoConfig()))
        await run_until(runner, lambda: runner.processed + runner.dead_letters >= 2)
        assert runner.dead_letters == 1 and runner.processed == 1

