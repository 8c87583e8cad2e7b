"""``gyre monitor``: a live terminal dashboard of a run, built only on bus subscription.

Why only a subscriber: the event log is the run's single source of truth, so a dashboard
that folds the same events every actor sees works unchanged for a ``gyre run`` in progress,
one process per role (embedded or Kafka), and a finished run's log — and it can never
disagree with ``metrics.jsonl`` / ``summary.json`` or the report: all of them fold the
events with the same :class:`~gyre_async.folds.run_fold.RunFold`.

:class:`MonitorState` is that fold, bounded for a long-lived follower, plus the monitor's
own derivations (rates, silent actors); it is pure (no I/O, no clock), which makes it
unit-testable with hand-made events. Every notion of "now" (silent actors, env steps/s) is
the newest event time, not the wall clock, so a finished log renders the way the run looked
at its end. :func:`monitor` is the I/O shell: :func:`~gyre_async.bus.reading.read_events`
on every topic from offset 0 (undecodable records skipped and counted on screen),
following new records, with a rich ``Live`` view (``monitor_view.render``); ``--once``
catches up to the current end, prints one frame, exits.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time

from gyre_async.bus.reading import end_offsets, read_events
from gyre_async.folds.run_fold import STEP_WINDOW_S, RunFold
from gyre_async.ui.monitor_view import make_console, render  # render re-exported: monitor.render
from schemas.events import EvalResult
from schemas.topics import ALL_TOPICS

#: Default actor heartbeat period (``ActorRunner.heartbeat_s``); silent after 3 of them.
HEARTBEAT_S = 5.0


class MonitorState(RunFold):
    """The run's fold as a follower keeps it (bounded), and what the screen derives from it."""

    def __init__(self, run_id: str | None = None, heartbeat_s: float = HEARTBEAT_S):
        super().__init__(run_id, keep_records=False)
        self.silent_after_s = 3 * heartbeat_s

    @property
    def latest_eval(self) -> EvalResult | None:
        """The evaluation of the newest version evaluated (as ``summary.json`` reports it)."""
        return self.evals[-1] if self.evals else None

    def env_steps_per_s(self) -> float:
        """Steps in the last ``STEP_WINDOW_S`` seconds before the newest event."""
        lo = self.newest_ts - STEP_WINDOW_S
        return sum(n for s, n in self.step_seconds.items() if s + 1 > lo) / STEP_WINDOW_S

    def env_steps_avg(self) -> float:
        """Mean env steps/s over the run (same formula as ``summary.json``)."""
        return self.steps / max(self.step_last_ts - self.step_first_ts, 1e-9)

    def role_rates(self) -> dict[str, float | None]:
        """Inputs processed per second, summed over each role's actors."""
        rates: dict[str, float | None] = {}
        for a in self.actors.values():
            r = a.rate()
            current = rates.get(a.role)
            if current is None:  # the role's first actor, or none of its actors has a rate yet
                rates[a.role] = r
            elif r is not None:
                rates[a.role] = current + r
        return rates

    def silent_actors(self) -> list[str]:
        """Actors without a heartbeat for more than 3 heartbeat periods of event time."""
        return sorted(a.actor for a in self.actors.values()
                      if self.newest_ts - a.last_ts > self.silent_after_s)


# -- the I/O shell -------------------------------------------------------------------------------
async def _known_topics(bus) -> list[str]:
    names = {t.name for t in await bus.topics()}
    return [t for t in ALL_TOPICS if t in names]


async def monitor(url: str, run_id: str | None = None, once: bool = False,
                  refresh_s: float = 0.5) -> int:
    """Fold every topic of the bus at ``url`` from the beginning and show it.

    ``once``: read up to the end offsets seen at start, print one frame, return. Otherwise
    follow new records (new topics too) until SIGINT/SIGTERM, redrawing every ``refresh_s``.
    """
    from gyre_async.bus import open_bus
    from gyre_async.bus.embedded import EmbeddedBus

    state = MonitorState(run_id)
    console = make_console(once)
    bus = open_bus(url)
    if isinstance(bus, EmbeddedBus) and not os.path.exists(bus.path):
        if once:
            print(f"gyre monitor: no event log at {bus.path}", file=sys.stderr)
            return 1
        while not os.path.exists(bus.path):  # the run has not created its log yet
            await asyncio.sleep(0.5)
    async with bus:
        if once:
            topics = await _known_topics(bus)
            if topics:  # up to the end offsets seen now, then stop
                async for record, event in read_events(bus, topics, on_bad="skip",
                                                       counts=state.read):
                    state.apply(event, record.topic)
            console.print(render(state, url=url, mode="caught up"))
            return 0
        await _follow(bus, state, console, url, refresh_s)
    return 0


async def _fold_following(bus, topics: list[str], state: MonitorState) -> None:
    async for record, event in read_events(bus, topics, on_bad="skip", follow=True,
                                           counts=state.read):
        state.apply(event, record.topic)


async def _follow(bus, state: MonitorState, console, url: str, refresh_s: float) -> None:
    """One following reader per group of topics as they appear (actors create them as they
    start); "catching up" until every partition reached the end it had when first seen."""
    from rich.live import Live

    from gyre_async.runtime.process import install_stop_signals

    stop = asyncio.Event()
    install_stop_signals(stop.set)
    followers: list[asyncio.Task] = []
    targets: dict[tuple[str, int], int] = {}
    covered: set[str] = set()
    next_scan = 0.0
    mode = "catching up"
    with Live(render(state, url=url, mode=mode), console=console, auto_refresh=False) as live:
        try:
            last_draw = time.monotonic()
            while not stop.is_set():
                if time.monotonic() >= next_scan and len(covered) < len(ALL_TOPICS):
                    new = [t for t in await _known_topics(bus) if t not in covered]
                    if new:
                        targets.update(await end_offsets(bus, new))
                        followers.append(asyncio.create_task(_fold_following(bus, new, state)))
                        covered.update(new)
                    next_scan = time.monotonic() + 2.0
                for task in followers:
                    if task.done():
                        task.result()  # a reader that failed stops the monitor, loudly
                await asyncio.sleep(min(refresh_s, 0.2))
                behind = any(state.read.next_offsets.get(tp, 0) < end
                             for tp, end in targets.items())
                mode = "catching up" if behind or not followers else "following"
                if time.monotonic() - last_draw >= refresh_s:
                    live.update(render(state, url=url, mode=mode, wall_now=time.time()),
                                refresh=True)
                    last_draw = time.monotonic()
            live.update(render(state, url=url, mode="stopped", wall_now=time.time()),
                        refresh=True)
        finally:
            for task in followers:
                task.cancel()
            await asyncio.gather(*followers, return_exceptions=True)
