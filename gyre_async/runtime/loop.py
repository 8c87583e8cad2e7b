"""``gyre run``: the whole gyre in one process — sample -> score -> update -> sample again.

All roles run as actors on one event loop, over the embedded bus in the run directory,
exactly as they would run one process per role (``gyre actor ROLE``). The loop folds the
bus as it goes (a :class:`RunFold`, like any monitor) and shows the fold to a ``watch``
callback: ``gyre run``'s progress display, which lives in ``ui/``. The run ends when the
learner's final version has been evaluated (``learner.max_versions``), when validation
reaches ``loop.target_success``, or at ``loop.max_wall_s`` / ``loop.max_env_steps``.
It ends by draining: the sampler stops first, then each downstream role handles what is
already on the bus, so nothing is left in flight; ``summary.json`` records how far behind
each consumer group still is (``final_lag``: state held on purpose, such as open segments).
At the end the run directory holds the event log, segment store, checkpoints and
``best.json`` (which weights to hand over: :mod:`gyre_async.core.keeper_best`);
:func:`run_loop` returns the run folded with its summary (the ``final`` and the ``best``
validated version among it), and ``gyre run`` writes ``metrics.jsonl``, the TensorBoard
scalars, ``learning_curve.png`` and ``summary.json`` from it
(:mod:`gyre_async.ui.run_outputs`).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import structlog

from gyre_async.bus.reading import read_events
from gyre_async.config import recorded_config
from gyre_async.core.evaluation import Evaluation, eval_trigger
from gyre_async.core.keeper_best import final_and_best, settle_best
from gyre_async.errors import ConfigError
from gyre_async.folds.final_lag import final_lag, within_bound
from gyre_async.folds.pacing import stale_dropped_fraction
from gyre_async.folds.run_fold import RunFold
from gyre_async.folds.runlog import current_policy_version, load_runlog, summarize
from gyre_async.runtime.actor import ActorRunner
from gyre_async.runtime.process import install_stop_signals, open_run_bus
from gyre_async.runtime.topology import RUN_ROLES, build_actor
from gyre_async.storage.atomic import atomic_write_bytes
from gyre_async.storage.roots import StorageRoots
from schemas import encode
from schemas.config import Config
from schemas.events import EvalResult
from schemas.topics import ALL_TOPICS, EVAL, POLICY_VERSION, SEGMENT_CLOSED, TELEMETRY

log = structlog.get_logger(__name__)

#: Once the sampler stops, these roles are told the run ends (the learner trains nothing
#: more: the stop condition, not the drain, decides the final policy), handle what is
#: already on the bus, in data-flow order, then let go of what waits for input that will
#: not come (the segmenter cuts its open segments, the learner refuses its partial batch
#: as ``budget-spent``), so the run ends with nothing in flight and nothing held. The
#: evaluator and keeper are not waited for: the final evaluation covers the latest version.
DRAINED_ROLES = ("segmenter", "arbiter", "learner")
DRAIN_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RunResult:
    """What a run leaves: its whole log folded (:func:`load_runlog`) and the figures of its
    end (``summary.json``'s content). Writing them is the caller's:
    :func:`gyre_async.ui.run_outputs.write_run_outputs` for ``gyre run``."""

    runlog: RunFold
    summary: dict


def _final_eval_seen(run: RunFold) -> bool:
    return run.final_version >= 0 and run.final_version in run.evaluated


async def _fold_into(bus, run: RunFold) -> None:
    async for record, event in read_events(bus, [SEGMENT_CLOSED, POLICY_VERSION, EVAL, TELEMETRY],
                                           on_bad="skip", follow=True, counts=run.read):
        run.apply(event, record.topic)


async def _watch(bus, run: RunFold, stop: asyncio.Event, cfg: Config,
                 watch: Callable[[RunFold], None] | None) -> None:
    """Fold the run as it goes, show it to ``watch``, and set ``stop`` when a stop
    condition of ``[loop]`` holds."""
    started = time.monotonic()
    folding = asyncio.create_task(_fold_into(bus, run))
    last_log = 0.0
    try:
        while not stop.is_set():
            await asyncio.wait([folding], timeout=0.25)
            if folding.done():
                folding.result()  # the reader failed: surface it
            if watch is not None:
                watch(run)
            now = time.monotonic()
            if now - last_log > 10:
                last_log = now
                log.info("progress", version=run.max_version, episodes=run.counts.episodes,
                         env_steps=run.segment_env_steps)
            loop = cfg.loop
            newest_eval = run.newest_eval
            if _final_eval_seen(run):
                stop.set()
            elif loop.target_success and newest_eval and \
                    newest_eval.success_rate >= loop.target_success:
                stop.set()
            elif loop.max_env_steps and run.segment_env_steps >= loop.max_env_steps:
                stop.set()
            elif loop.max_wall_s and now - started >= loop.max_wall_s:
                stop.set()
    finally:
        folding.cancel()
        await asyncio.gather(folding, return_exceptions=True)


async def _final_evaluation(cfg: Config, bus) -> None:
    """Evaluate the latest version if the run stopped before the evaluator reached it.

    A run cut by ``max_wall_s`` or ``max_env_steps`` still ends with a validation figure
    for the policy it actually produced, published like any other ``eval`` event.
    """
    latest = await current_policy_version(bus, cfg.run.run_id,
                                          StorageRoots.from_config(cfg).trusts)
    evaluated = {event.policy_version
                 async for _record, event in read_events(bus, [EVAL], on_bad="skip",
                                                         run_id=cfg.run.run_id)
                 if isinstance(event, EvalResult)}
    if latest is None or latest.version in evaluated:
        return
    final = msgspec.structs.replace(latest, metrics={**latest.metrics, "final": 1.0})
    result = await Evaluation.from_config(cfg).run(
        final, greedy=cfg.evaluator.greedy, trigger=eval_trigger(cfg, final),
        cause=final.event_id, producer="evaluator")
    await bus.publish_and_commit([(EVAL, [(result.key.encode(), encode(result))])])


async def _drain(runners: list[ActorRunner], tasks: list[asyncio.Task],
                 interrupted: asyncio.Event, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
    """Stop the source, then wait for each downstream role to catch up with the bus.

    Stopping every role at once leaves the last steps, segments and scores unhandled:
    the end of the run would show them as lag although no role fell behind. A second
    SIGINT/SIGTERM (``interrupted``) or ``timeout_s`` cuts the drain short.
    """
    by_role = {r.actor.role: (r, t) for r, t in zip(runners, tasks)}
    if "sampler" in by_role:
        sampler, task = by_role["sampler"]
        sampler.stop()
        await asyncio.gather(task, return_exceptions=True)  # a crash is raised by the caller
    for runner in runners:
        if runner.actor.role in DRAINED_ROLES:
            runner.actor.run_ending()  # e.g. the learner trains nothing more
    deadline = time.monotonic() + timeout_s

    async def caught_up(role: str, runner: ActorRunner, task: asyncio.Task) -> bool:
        while not task.done() and not await runner.caught_up():
            if interrupted.is_set() or time.monotonic() >= deadline:
                log.warning("run.drain_cut_short", role=role, interrupted=interrupted.is_set(),
                            unconsumed=await runner.unconsumed())
                return False
            await asyncio.sleep(0.05)
        return True

    for role in DRAINED_ROLES:
        if role not in by_role:
            continue
        runner, task = by_role[role]
        if not await caught_up(role, runner, task):
            return
        runner.actor.inputs_ended()  # e.g. the segmenter cuts its open segments
        if not await caught_up(role, runner, task):
            return


async def run_loop(cfg: Config, *, bus_override: str | None = None,
                   roles: tuple[str, ...] = RUN_ROLES,
                   watch: Callable[[RunFold], None] | None = None) -> RunResult:
    """Run ``roles`` on one bus until a stop condition, drain, evaluate the final version,
    and return the run folded. ``watch`` sees the live fold a few times a second (the
    progress display of ``gyre run``); nothing here draws or writes the run's outputs."""
    if cfg.learner.world_size > 1:
        raise ConfigError(
            f"learner.world_size = {cfg.learner.world_size}: gyre run trains with one learner "
            "process; run a data-parallel learner with `gyre launch CONFIG --replicas "
            "learner=N` (or torchrun), or set learner.world_size = 1")
    run_dir = cfg.run.run_dir
    os.makedirs(run_dir, exist_ok=True)
    # secrets redacted, and readable by the run's owner only (it names hosts and stores)
    atomic_write_bytes(os.path.join(run_dir, "config.json"), recorded_config(cfg),
                       permissions=0o600)
    started = time.monotonic()
    live = RunFold(cfg.run.run_id, keep_records=False)
    async with open_run_bus(cfg, bus_override) as bus:
        await bus.create_topics(ALL_TOPICS, cfg.bus.partitions)
        runners = [ActorRunner(build_actor(role, cfg), bus, run_id=cfg.run.run_id, name=role,
                               partitions=cfg.bus.partitions) for role in roles]
        stop = asyncio.Event()
        drain_s = 0.0
        install_stop_signals(stop.set)
        tasks = [asyncio.create_task(r.run(), name=r.name) for r in runners]
        watcher = asyncio.create_task(_watch(bus, live, stop, cfg, watch))
        try:
            stopper = asyncio.create_task(stop.wait())
            done, _ = await asyncio.wait([*tasks, stopper], return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                crash = None if task is stopper else task.exception()
                if crash is not None:
                    raise crash  # an actor crashed: surface it, loudly
            drain_started = time.monotonic()
            interrupted = asyncio.Event()
            install_stop_signals(interrupted.set)
            await _drain(runners, tasks, interrupted)
            drain_s = time.monotonic() - drain_started
            for task in tasks:
                crash = task.exception() if task.done() and not task.cancelled() else None
                if crash is not None:
                    raise crash
        finally:
            stop.set()
            for r in runners:
                r.stop()
            await asyncio.gather(*tasks, return_exceptions=True)
            await asyncio.gather(watcher, return_exceptions=True)
        await _final_evaluation(cfg, bus)
        lags = await final_lag(bus, {r.group: r.actor.consumes for r in runners
                                     if r.actor.consumes})
        runlog = await load_runlog(bus, run_id=cfg.run.run_id)
    wall = time.monotonic() - started
    summary = summarize(runlog, wall)
    summary["run_dir"] = os.path.abspath(run_dir)
    summary["mode"] = cfg.run.mode
    summary["drain_seconds"] = round(drain_s, 2)
    # stale-dropped env steps / sampled env steps: what the staleness gate's pacing avoids
    summary["stale_dropped_fraction"] = stale_dropped_fraction(runlog.dropped, runlog.segments,
                                                               runlog.steps)
    summary["final_lag"] = lags
    summary["final_lag_bound_steps"] = cfg.learner.batch_steps
    summary["final_lag_within_bound"] = within_bound(lags, cfg.learner.batch_steps)
    best = settle_best(run_dir, cfg.run.run_id, runlog.evals, runlog.versions)
    summary.update(final_and_best(cfg.run.run_id, runlog.evals, runlog.versions, best))
    return RunResult(runlog, summary)
