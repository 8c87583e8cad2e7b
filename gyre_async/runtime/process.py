"""Process entry points: event loop choice (uvloop), signals, running actors."""

from __future__ import annotations

import asyncio
import ctypes
import os
import platform
import signal
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import structlog

from gyre_async.bus import Bus, open_bus
from gyre_async.config import bus_url
from gyre_async.runtime.actor import ActorRunner
from gyre_async.runtime.topology import build_actor
from schemas.config import Config

T = TypeVar("T")
log = structlog.get_logger(__name__)


#: Allocations this large or larger are served by mmap and given back when freed (glibc's
#: own starting value, held: 4 MiB still let the learner grow with varying batch shapes).
MMAP_THRESHOLD_BYTES = 128 << 10
_M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc malloc.h)


def pin_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Keep a long-running role's RSS flat. Allocations of ``nbytes`` or more always use mmap.

    By default glibc raises its mmap threshold (up to 32 MiB) each time a large mmapped
    block is freed. After a few updates the learner's batch tensors then come from the heap,
    where freed memory fragments and is seldom returned. RSS then climbs from update to
    update, with nothing leaking. Measured (``ops/bench/memory.py``, one 4,341-step
    trajectory): the learner's peak RSS 1,006 MB at 10% of it, 1,550 MB at 100%. 14 forward
    passes of one 270-step batch: 436 -> 1,062 MB, or 242 -> 253 MB once pinned; 16 PPO
    steps on minibatches of 40-63 steps: 379 -> 531 MB pinned at 4 MiB, 322 -> 325 MB at
    128 KiB. Setting the threshold turns the adjustment off. Returns False, doing nothing, off glibc or
    when ``MALLOC_MMAP_THRESHOLD_`` is set.
    """
    if platform.libc_ver()[0] != "glibc" or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        return bool(ctypes.CDLL("libc.so.6").mallopt(_M_MMAP_THRESHOLD, nbytes))
    except (OSError, AttributeError):  # pragma: no cover - no glibc after all
        return False


def run_main(main: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Run a coroutine on uvloop when it is installed (faster I/O), else asyncio; with the
    mmap threshold pinned first (:func:`pin_mmap_threshold`)."""
    pin_mmap_threshold()
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on POSIX
        return asyncio.run(main())
    return uvloop.run(main())


def open_run_bus(cfg: Config, override: str | None = None) -> Bus:
    return open_bus(bus_url(cfg, override), max_message_bytes=cfg.bus.max_message_bytes)


def dump_tasks() -> None:
    """Print every asyncio task's await chain to stderr (``kill -USR1 <pid>`` on a stuck actor).

    ``Task.print_stack`` shows only a suspended task's outermost frame; following ``cr_await``
    shows the innermost coroutine, which is where a hang actually waits.
    """
    import sys

    for task in asyncio.all_tasks():
        print(f"--- task {task.get_name()}", file=sys.stderr)
        for line in await_chain(task.get_coro()):
            print(f"    {line}", file=sys.stderr)


def await_chain(coro) -> list[str]:
    """``file:line in function`` for each coroutine/generator frame down the await chain."""
    out: list[str] = []
    while coro is not None and len(out) < 64:
        frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
        if frame is None:  # a future or another awaitable: the thing actually waited on
            out.append(repr(coro)[:300])
            break
        out.append(f"{frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
    return out


def install_stop_signals(stop: Callable[[], None]) -> None:
    """SIGTERM/SIGINT ask for a graceful stop: finish the batch, commit, leave.

    SIGUSR1 dumps every task's stack, for diagnosing a silent actor.
    """
    loop = asyncio.get_running_loop()
    try:
        loop.add_signal_handler(signal.SIGUSR1, dump_tasks)
    except (NotImplementedError, RuntimeError):  # pragma: no cover
        pass
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop)
        except (NotImplementedError, RuntimeError):  # pragma: no cover - non-main thread
            pass


async def run_actor(role: str, cfg: Config, bus_override: str | None = None,
                    name: str | None = None, metrics_port: int | None = None,
                    metrics_host: str | None = None) -> None:
    """One role in this process until SIGTERM (``gyre actor ROLE``)."""
    actor = build_actor(role, cfg)
    async with open_run_bus(cfg, bus_override) as bus:
        runner = ActorRunner(actor, bus, run_id=cfg.run.run_id, name=name or role,
                             partitions=cfg.bus.partitions)
        install_stop_signals(runner.stop)
        if metrics_port:
            from gyre_async.runtime.metrics import DEFAULT_HOST, serve_actor_metrics

            serve_actor_metrics(runner, metrics_port, host=metrics_host or DEFAULT_HOST)
        await runner.run()
