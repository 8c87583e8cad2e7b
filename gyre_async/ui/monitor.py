"""``gyre monitor``: a live terminal dashboard of a run, built only on bus subscription.

Why only a subscriber: the event log is the run's single source of truth, so a dashboard
that folds the same events every actor sees works unchanged for a ``gyre run`` in progress,
one process per role (embedded or Kafka), and a finished run's log — and it can never
disagree with ``metrics.jsonl`` / ``summary.json``, which are folded from the same events.

:class:`MonitorState` is pure (no I/O, no clock): it folds decoded events into the numbers
the screen shows, which makes it unit-testable with hand-made events. Every notion of
"now" (silent actors, env steps/s) is the newest event time, not the wall clock, so a
finished log renders the way the run looked at its end. :func:`monitor` is the I/O shell:
readers on every topic from offset 0, following new records, with a rich ``Live`` view
(``monitor_view.render``); ``--once`` catches up to the current end, prints one frame, exits.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import sys
import time
from dataclasses import dataclass, field

from schemas import DecodeError, decode
from schemas.events import (
    CriticReset, DeadLetter, EnvError, EvalResult, Heartbeat, PolicyVersion, RewardFailed, Scored,
    SegmentClosed, SegmentDropped, TrajectoryStep,
)
from schemas.topics import ALL_TOPICS

from gyre_async.ui.monitor_view import make_console, render  # render re-exported: monitor.render

#: Default actor heartbeat period (``ActorRunner.heartbeat_s``); silent after 3 of them.
HEARTBEAT_S = 5.0
STEP_WINDOW_S = 10.0  #: window of the "current" env steps/s, in seconds of event time
CURVE_POINTS = 240  #: points kept per curve (the sparklines show the tail)


@dataclass
class ActorSeen:
    """What the heartbeats of one actor name say (latest values + a short history)."""

    actor: str
    role: str
    last_ts: float = 0.0
    processed: int = 0
    lag: int = 0
    history: collections.deque = field(default_factory=lambda: collections.deque(maxlen=6))

    def rate(self) -> float | None:
        """Inputs processed per second over the last few heartbeats (None: not known yet)."""
        if len(self.history) < 2:
            return None
        (t0, p0), (t1, p1) = self.history[0], self.history[-1]
        return (p1 - p0) / (t1 - t0) if t1 > t0 else None


class MonitorState:
    """Live numbers of one run, folded from its events in any order the bus delivers them.

    Topics are read concurrently, so cross-topic order is not guaranteed: a policy version
    may name trained segments whose ``segment-closed`` has not been read yet; those wait in
    ``_pending_trained`` until it arrives.
    """

    def __init__(self, run_id: str | None = None, heartbeat_s: float = HEARTBEAT_S):
        self.run_id = run_id
        self.silent_after_s = 3 * heartbeat_s
        self.events = self.skipped = self.undecodable = 0
        self.by_topic: collections.Counter[str] = collections.Counter()
        self.run_ids: set[str] = set()
        self.newest_ts = 0.0
        # policy
        self.current: PolicyVersion | None = None
        self.max_version = -1
        self.versions = self.updates = 0
        self.rollbacks: list[tuple[float, int, int | None]] = []  # (ts, to version, parent)
        self.critic_resets: list[CriticReset] = []  # the learner's divergence detector fired
        self.learner_staleness = self.max_staleness_seen = 0.0
        # validation and training curves
        self.evals: list[EvalResult] = []
        self.episodes = self.successes = 0
        self._recent: collections.deque[float] = collections.deque(maxlen=100)
        self.train_curve: collections.deque[float] = collections.deque(maxlen=CURVE_POINTS)
        self._episode_return: dict[str, float] = {}
        self.returns: collections.deque[float] = collections.deque(maxlen=CURVE_POINTS)
        # segments and staleness
        self.segments = 0
        self._seg_min_version: dict[str, int] = {}
        self._pending_trained: dict[str, int] = {}
        self.staleness_hist: collections.Counter[int] = collections.Counter()
        self.dropped = 0
        self.dropped_hist: collections.Counter[int] = collections.Counter()
        # rewards
        self.scored = self.reward_failed = 0
        self.total_reward = 0.0
        self.components: dict[str, list[float]] = {}  # name -> [count, sum]
        # actors, steps, errors
        self.actors: dict[str, ActorSeen] = {}
        self.steps = 0
        self.step_first_ts = self.step_last_ts = 0.0
        self._step_secs: collections.Counter[int] = collections.Counter()
        self.env_errors = 0
        self.env_error_kinds: collections.Counter[str] = collections.Counter()
        self.dead_letters = 0
        self.latest_dead: collections.deque[DeadLetter] = collections.deque(maxlen=3)

    # -- folding ------------------------------------------------------------------------------
    def fold_record(self, record) -> None:
        """Decode and fold one bus record (undecodable bytes are counted, never fatal)."""
        try:
            event = decode(record.topic, record.value, 1 << 40)
        except DecodeError:
            self.undecodable += 1
            return
        self.fold(event, record)

    def fold(self, event, record=None) -> bool:
        """Apply one decoded event; returns False when it belongs to another run."""
        if self.run_id and getattr(event, "run_id", None) != self.run_id:
            self.skipped += 1
            return False
        self.events += 1
        if record is not None:
            self.by_topic[record.topic] += 1
        if len(self.run_ids) < 8:
            self.run_ids.add(event.run_id)
        ts = event.ts
        self.newest_ts = max(self.newest_ts, ts)
        match event:
            case TrajectoryStep():
                self._step(event)
            case SegmentClosed():
                self._segment(event)
            case Scored():
                self._score(event)
            case PolicyVersion():
                self._policy(event)
            case EvalResult():
                self.evals.append(event)
            case Heartbeat():
                self._heartbeat(event)
            case SegmentDropped():
                self.dropped += 1
                self.dropped_hist[event.staleness] += 1
                self._seg_min_version.pop(event.segment_id, None)
            case DeadLetter():
                self.dead_letters += 1
                self.latest_dead.append(event)
            case EnvError():
                self.env_errors += 1
                self.env_error_kinds[event.kind] += 1
            case RewardFailed():
                self.reward_failed += 1
            case CriticReset():
                self.critic_resets.append(event)
        return True

    def _step(self, e: TrajectoryStep) -> None:
        self.steps += 1
        self.step_first_ts = min(self.step_first_ts or e.ts, e.ts)
        self.step_last_ts = max(self.step_last_ts, e.ts)
        self._step_secs[int(e.ts)] += 1
        if len(self._step_secs) > 4 * STEP_WINDOW_S:  # keep only what the window can use
            horizon = self.newest_ts - 2 * STEP_WINDOW_S
            for sec in [s for s in self._step_secs if s < horizon]:
                del self._step_secs[sec]

    def _segment(self, e: SegmentClosed) -> None:
        self.segments += 1
        if e.trajectory_done:
            self.episodes += 1
            self.successes += int(e.success)
            self._recent.append(float(e.success))
            self.train_curve.append(sum(self._recent) / len(self._recent))
        learner_version = self._pending_trained.pop(e.segment_id, None)
        if learner_version is not None:
            self.staleness_hist[learner_version - e.min_policy_version] += 1
        else:
            self._seg_min_version[e.segment_id] = e.min_policy_version

    def _score(self, e: Scored) -> None:
        self.scored += 1
        self.total_reward += e.total
        for name, value in e.components.items():
            acc = self.components.setdefault(name, [0, 0.0])
            acc[0] += 1
            acc[1] += value
        ret = self._episode_return.pop(e.trajectory_id, 0.0) + e.total
        if e.trajectory_done:
            self.returns.append(ret)
        else:
            self._episode_return[e.trajectory_id] = ret

    def _policy(self, e: PolicyVersion) -> None:
        self.versions += 1
        self.max_version = max(self.max_version, e.version)
        # the policy in force is the last one published (a rollback may lower it)
        if self.current is None or (e.ts, e.version) >= (self.current.ts, self.current.version):
            self.current = e
        if e.reason == "update":
            self.updates += 1
        elif e.reason == "rollback":
            self.rollbacks.append((e.ts, e.version, e.parent))
            self.rollbacks.sort()
        if "charts/max_staleness_seen" in e.metrics:
            self.learner_staleness = e.metrics["charts/max_staleness_seen"]
            self.max_staleness_seen = max(self.max_staleness_seen, self.learner_staleness)
        learner_version = e.version - 1  # the version that was trained to produce this one
        for sid in e.trained_segments:
            min_version = self._seg_min_version.pop(sid, None)
            if min_version is None:
                self._pending_trained[sid] = learner_version
            else:
                self.staleness_hist[learner_version - min_version] += 1

    def _heartbeat(self, e: Heartbeat) -> None:
        seen = self.actors.get(e.actor)
        if seen is None:
            seen = self.actors[e.actor] = ActorSeen(e.actor, e.role)
        if e.ts < seen.last_ts:  # an older beat delivered late: latest values stay
            return
        if seen.history and e.processed < seen.history[-1][1]:
            seen.history.clear()  # the actor restarted: its counter began again
        seen.role, seen.last_ts, seen.processed, seen.lag = e.role, e.ts, e.processed, e.lag
        seen.history.append((e.ts, e.processed))

    # -- derived numbers ----------------------------------------------------------------------
    @property
    def latest_eval(self) -> EvalResult | None:
        """The evaluation of the newest version evaluated (as ``summary.json`` reports it)."""
        return max(self.evals, key=lambda p: (p.policy_version, p.ts), default=None)

    def eval_curve(self) -> list[EvalResult]:
        return sorted(self.evals, key=lambda p: (p.policy_version, p.ts))

    @property
    def train_success(self) -> float | None:
        return sum(self._recent) / len(self._recent) if self._recent else None

    def env_steps_per_s(self) -> float:
        """Steps in the last ``STEP_WINDOW_S`` seconds before the newest event."""
        lo = self.newest_ts - STEP_WINDOW_S
        return sum(n for s, n in self._step_secs.items() if s + 1 > lo) / STEP_WINDOW_S

    def env_steps_avg(self) -> float:
        """Mean env steps/s over the run (same formula as ``summary.json``)."""
        return self.steps / max(self.step_last_ts - self.step_first_ts, 1e-9)

    def role_rates(self) -> dict[str, float | None]:
        """Inputs processed per second, summed over each role's actors."""
        rates: dict[str, float | None] = {}
        for a in self.actors.values():
            r = a.rate()
            if a.role not in rates or rates[a.role] is None:
                rates[a.role] = r
            elif r is not None:
                rates[a.role] += r
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
    from gyre_async.bus.reading import iter_topics

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
                async for record in iter_topics(bus, topics):
                    state.fold_record(record)
            console.print(render(state, url=url, mode="caught up"))
            return 0
        await _follow(bus, state, console, url, refresh_s)
    return 0


async def _follow(bus, state: MonitorState, console, url: str, refresh_s: float) -> None:
    from rich.live import Live

    from gyre_async.runtime.process import install_stop_signals

    stop = asyncio.Event()
    install_stop_signals(stop.set)
    readers: list = []
    covered: set[str] = set()
    next_scan = 0.0
    mode = "catching up"
    with Live(render(state, url=url, mode=mode), console=console, auto_refresh=False) as live:
        try:
            last_draw = time.monotonic()
            while not stop.is_set():
                if time.monotonic() >= next_scan and len(covered) < len(ALL_TOPICS):
                    new = [t for t in await _known_topics(bus) if t not in covered]
                    if new:  # topics appear as actors start: one more reader for them
                        readers.append(await bus.reader(new))
                        covered.update(new)
                    next_scan = time.monotonic() + 2.0
                full = False
                for reader in readers:
                    records = await reader.fetch(5000, 0.1)
                    full |= len(records) >= 5000
                    for record in records:
                        state.fold_record(record)
                if not readers:
                    await asyncio.sleep(0.2)
                mode = "catching up" if full else "following"
                if time.monotonic() - last_draw >= refresh_s:
                    live.update(render(state, url=url, mode=mode, wall_now=time.time()),
                                refresh=True)
                    last_draw = time.monotonic()
            live.update(render(state, url=url, mode="stopped", wall_now=time.time()),
                        refresh=True)
        finally:
            for reader in readers:
                await reader.close()


# -- command line ----------------------------------------------------------------------------------
def _configure(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--bus", metavar="URL",
                   help="bus URL (default: $GYRE_BUS, else the config's run log)")
    p.add_argument("--config", help="config file (to find the run's bus)")
    p.add_argument("--run", dest="run_id", metavar="ID", help="show only events of this run id")
    p.add_argument("--once", action="store_true",
                   help="catch up to the current end, print one frame and exit")
    p.add_argument("--refresh", type=float, default=0.5, metavar="S",
                   help="seconds between redraws")
    return p


DESCRIPTION = ("Live dashboard of a run, by subscription to every topic of its bus: policy "
               "version, validation and training success, returns, reward components, "
               "staleness, throughput per role, consumer lag, heartbeats (silent actors "
               "named), rollbacks and dead letters. Works on a running `gyre run`, on actors "
               "in separate processes (embedded or Kafka) and on a finished run's log.")


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``gyre monitor`` on the CLI's subparsers (dispatch with :func:`run`)."""
    return _configure(subparsers.add_parser("monitor", help="live dashboard of a run's bus",
                                            description=DESCRIPTION))


def run(args: argparse.Namespace) -> int:
    """Run ``gyre monitor`` for parsed arguments; returns the exit status."""
    from gyre_async.config import bus_url, load_config
    from gyre_async.runtime.process import run_main

    url = bus_url(load_config(getattr(args, "config", None)), args.bus)
    try:
        return run_main(lambda: monitor(url, args.run_id, args.once, args.refresh))
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    """``python -m gyre_async.ui.monitor``: the same arguments as ``gyre monitor``."""
    from gyre_async.errors import ConfigError
    from gyre_async.runtime.logs import configure_logging

    args = _configure(argparse.ArgumentParser(prog="gyre monitor",
                                              description=DESCRIPTION)).parse_args(argv)
    configure_logging("WARNING")
    try:
        return run(args)
    except ConfigError as exc:
        print(f"gyre monitor: config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
