"""A partition that leaves a member and comes back is read again from its committed offset,
and the runtime hands those records to the actor again (as a restart would): an actor that
released its state for the partition (the segmenter) needs every one of them."""

from __future__ import annotations

import asyncio
import uuid

from test_role_cores import step

from gyre_async.bus import embedded, open_bus
from gyre_async.runtime.actor import Actor, ActorRunner
from schemas import encode
from schemas.topics import TRAJECTORY_STEP


class _Recorder(Actor):
    """Records what it is handed and holds everything (the commit stays at 0)."""

    role = "recorder"
    consumes = (TRAJECTORY_STEP,)

    def __init__(self):
        self.handled: list[int] = []

    async def handle(self, event, record):
        self.handled.append(record.offset)
        return []

    def commit_floor(self):
        return {(TRAJECTORY_STEP, 0): 0}


def test_records_of_a_partition_that_comes_back_are_handled_again(tmp_path, monkeypatch):
    async def scenario():
        async with open_bus(f"sqlite:///{tmp_path}/events.db") as bus:
            await bus.create_topics([TRAJECTORY_STEP], 1)
            recorder = _Recorder()
            runner = ActorRunner(recorder, bus, run_id="t", partitions=1)
            task = asyncio.create_task(runner.run())
            await bus.publish(TRAJECTORY_STEP, [(b"a", encode(step("a", i))) for i in range(3)])

            async def until(cond, what):
                for _ in range(300):
                    if cond():
                        return
                    await asyncio.sleep(0.05)
                raise AssertionError(what)

            await until(lambda: len(recorder.handled) == 3, "first reading")
            # another member of the group takes the partition (the one whose id sorts first
            # owns it: the joiner's id is made to sort first; joining until a random id
            # did failed now and then, when the runner's own id sorted very early), then
            # leaves: it comes back to the runner
            monkeypatch.setattr(embedded.uuid, "uuid4", lambda: uuid.UUID(int=0))
            other = await bus.consumer(runner.group, (TRAJECTORY_STEP,))
            monkeypatch.undo()
            assert other.assignment(), "the joiner did not take the partition"
            before = runner.reassignments
            await until(lambda: runner.reassignments > before, "the partition never left")
            await other.close()
            await until(lambda: len(recorder.handled) >= 6, "the partition came back unread")
            runner.stop()
            await task
            return recorder.handled, runner.duplicates

    handled, duplicates = asyncio.run(scenario())
    assert handled == [0, 1, 2, 0, 1, 2], handled
    assert duplicates == 0
