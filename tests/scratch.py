"""One actor on a scratch bus: the tests' one way to run a single role.

``scratch_bus`` (conftest) opens an embedded bus in the test's folder; ``run`` starts one
actor on it through the real runner (:class:`~gyre_async.runtime.actor.ActorRunner`),
waits until ``until()`` holds (or the actor ends, or ``timeout``), stops it and returns
the runner; ``publish``, ``events`` and ``dead_letters`` put events in and read them back.
A test that feeds the actor in steps while it runs (publish, wait, publish again) keeps it
``running`` in the background and waits on each step with ``wait_until``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable

from gyre_async.bus import Bus
from gyre_async.bus.reading import read_events
from gyre_async.runtime.actor import Actor, ActorRunner
from schemas import Event, encode
from schemas.events import DeadLetter
from schemas.topics import DEAD_LETTER

Until = Callable[[], bool] | Callable[[], Awaitable[bool]]


async def _holds(until: Until) -> bool:
    answer = until()
    return bool(await answer) if inspect.isawaitable(answer) else bool(answer)


async def run_until(runner: ActorRunner, until: Until, timeout: float = 60) -> None:
    """Run ``runner`` until ``until()`` holds (a plain or an async predicate), it ends on
    its own, or ``timeout``; then stop it and wait for its end (an actor that crashed
    raises here)."""
    task = asyncio.create_task(runner.run())
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not task.done() and not await _holds(until):
        await asyncio.sleep(0.1)
    runner.stop()
    await task


async def wait_until(until: Until, timeout: float = 60, runner: ActorRunner | None = None
                     ) -> bool:
    """Whether ``until()`` holds within ``timeout`` (polled as ``run_until`` polls), for an
    actor kept ``running``: the test asserts on the answer at each step. With ``runner`` it
    answers as soon as that runner has ended (an actor that crashed: leaving ``running``
    raises its error), instead of waiting out the timeout."""
    deadline = time.monotonic() + timeout
    while not await _holds(until):
        if time.monotonic() >= deadline or (runner is not None and runner.stopping.is_set()):
            return False
        await asyncio.sleep(0.1)
    return True


class ScratchBus:
    def __init__(self, bus: Bus, run_id: str = "tiny", partitions: int = 1):
        self.bus = bus
        self.run_id = run_id
        self.partitions = partitions

    async def publish(self, topic: str, *events: Event, key: bytes | None = None) -> None:
        """``events`` on ``topic`` (created with the bus's partitions), keyed by ``key`` or
        each event's own key."""
        await self.bus.create_topics([topic], self.partitions)
        await self.bus.publish(topic, [(key or e.key.encode(), encode(e)) for e in events])

    def runner(self, actor: Actor, **options) -> ActorRunner:
        options = {"run_id": self.run_id, "heartbeat_s": 30, "partitions": self.partitions,
                   **options}
        return ActorRunner(actor, self.bus, **options)

    async def run(self, actor: Actor, until: Until, timeout: float = 60,
                  **options) -> ActorRunner:
        runner = self.runner(actor, **options)
        await run_until(runner, until, timeout)
        return runner

    @contextlib.asynccontextmanager
    async def running(self, actor: Actor, **options) -> AsyncIterator[ActorRunner]:
        """``actor`` running in the background (its runner is yielded) while the test
        publishes and waits in steps; stopped on leaving, and waited for (an actor that
        crashed raises there). For one wait only, ``run`` says it in one call."""
        runner = self.runner(actor, **options)
        task = asyncio.create_task(runner.run())
        try:
            yield runner
        finally:
            runner.stop()
            await task

    async def events(self, *topics: str) -> list[Event]:
        return [e async for _, e in read_events(self.bus, topics, on_bad="raise")]

    async def dead_letters(self) -> list[DeadLetter]:
        return [e for e in await self.events(DEAD_LETTER) if isinstance(e, DeadLetter)]
