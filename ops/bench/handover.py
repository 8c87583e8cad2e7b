"""Hand-overs lose nothing: a segmenter and an arbiter replica leave and come back, many times.

One run of the tiny loop (``ops/configs/tiny.toml``, 4 partitions, no version budget) with a
sampler, a learner and two replicas each of the segmenter and the arbiter, all in this
process, each with its own runner and name (as ``gyre launch --replicas segmenter=2,arbiter=2``
names them). Then ``--cycles`` times:

1. *come back*: new incarnations of ``segmenter-1`` and ``arbiter-1`` start; the consumer
   groups move partitions to them, with the open and unwritten segments the stayers held;
2. wait until both have worked and the stayers hold only part of their topics;
3. *leave*: both stop; their partitions (and whatever they held unwritten) go back to the
   stayers, who must read them again from the commit floor and skip only what was durably
   segmented or scored;
4. wait until the stayers own every partition and have handled ``--steps-between`` more steps.

The cycles are as short as the group protocol allows, so a partition often comes back while
a segment closed from it still waits for its batched write: the window the hand-over fix is
about. At the end every role stops, and the shared invariant checker
(:mod:`gyre_async.audit.invariants`, as in the chaos run) audits the log and every segment
store: ``lost`` (a step committed by the segmenter in no segment, a finished trajectory not
segmented in full, a committed segment never scored, ...), ``duplicated_segments`` (a step
in two segments of different ids, a segment scored twice with different results: repeats
under the *same* id are the at-least-once design and counted apart, ``same_id_repeats``) and
``corrupt`` (a segment that fails its hash).

    python ops/bench/handover.py --cycles 50 --bus embedded
    python ops/bench/handover.py --cycles 50 --bus kafka          # its own Tansu broker
    python ops/bench/handover.py --cycles 50 --bus kafka://host:9092

Last line: {"bench": "handover", "bus", "cycles", "steps", "segments", "lost",
            "duplicated_segments", "same_id_repeats", "corrupt", "seconds"}
Exit status 0 only when lost, duplicated_segments and corrupt are 0.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import sys
import time
from pathlib import Path

from _common import TINY, make_config, ops_script, print_result, scratch_dir

from gyre_async.audit.invariants import check_run, read_run
from gyre_async.bus import open_bus
from gyre_async.runtime.actor import ActorRunner
from gyre_async.runtime.logs import configure_logging
from gyre_async.runtime.topology import build_actor
from schemas.events import SegmentClosed
from schemas.topics import ALL_TOPICS, SEGMENT_CLOSED

PARTITIONS = 4


def tiny_config(run_dir: Path, run_id: str, write_delay_s: float = 1.0):
    """The tiny loop with 4 partitions and no version budget (the run ends when we say).
    Closed segments wait up to ``write_delay_s`` for their batched write (the tiny config
    waits 0.25 s): a longer wait widens the window in which a partition moves while a
    segment closed from it is unwritten."""
    return make_config(TINY, run={"run_dir": str(run_dir), "run_id": run_id},
                       learner={"max_versions": 0}, bus={"partitions": PARTITIONS},
                       segmenter={"write_delay_s": write_delay_s, "write_batch_segments": 1024})


class Cycles:
    """The run: fixed roles, the two movers, and the waits between hand-overs."""

    def __init__(self, bus, cfg, timeout_s: float):
        self.bus, self.cfg = bus, cfg
        self.tasks: dict[ActorRunner, asyncio.Task] = {}
        self.deadline = time.monotonic() + timeout_s

    def start(self, role: str, name: str) -> ActorRunner:
        runner = ActorRunner(build_actor(role, self.cfg), self.bus, run_id=self.cfg.run.run_id,
                             name=name, partitions=PARTITIONS, heartbeat_s=1.0)
        self.tasks[runner] = asyncio.create_task(runner.run(), name=name)
        return runner

    async def stop(self, runners) -> None:
        for r in runners:
            r.stop()
        for r in runners:
            await self.tasks.pop(r)

    async def until(self, ready, what: str) -> None:
        while not ready():
            for r, task in self.tasks.items():
                if task.done():
                    task.result()  # an actor crashed: show why
                    raise AssertionError(f"{r.name} stopped by itself")
            if time.monotonic() > self.deadline:
                raise AssertionError(f"timed out waiting until {what}")
            await asyncio.sleep(0.02)

    async def run(self, cycles: int, steps_between: int, progress) -> None:
        stayers = [self.start("segmenter", "segmenter-0"), self.start("arbiter", "arbiter-0")]
        self.start("sampler", "sampler")
        self.start("learner", "learner")
        try:
            for cycle in range(cycles):
                movers = [self.start("segmenter", "segmenter-1"),
                          self.start("arbiter", "arbiter-1")]
                await self.until(lambda movers=movers: all(m.processed > 0 for m in movers)
                                 and all(0 < len(s.assignment) < PARTITIONS for s in stayers),
                                 f"cycle {cycle}: the movers took partitions and worked")
                await self.stop(movers)
                base = stayers[0].processed
                await self.until(lambda base=base: all(len(s.assignment) == PARTITIONS
                                                         for s in stayers)
                                 and stayers[0].processed >= base + steps_between,
                                 f"cycle {cycle}: the stayers took every partition back")
                progress(cycle + 1)
        finally:
            await self.stop(list(self.tasks))


async def measure(url: str, cfg, cycles: int, steps_between: int, timeout_s: float,
                  progress=lambda done: None) -> dict:
    """Run the cycles on ``url`` and audit the run; the bench's figures as a dict."""
    started = time.monotonic()
    async with open_bus(url) as bus:
        await bus.create_topics(ALL_TOPICS, PARTITIONS)
        await Cycles(bus, cfg, timeout_s).run(cycles, steps_between, progress)
        run = await read_run(bus, cfg.run.run_id)
    report = check_run(run, segment_store=f"{cfg.run.run_dir}/segments.zarr",
                       checkpoint_dir=f"{cfg.run.run_dir}/checkpoints",
                       max_staleness=cfg.loop.max_staleness)
    ids = collections.Counter(s.segment_id for s in run.events(SEGMENT_CLOSED, SegmentClosed))
    return {"bench": "handover", "cycles": cycles, "steps": report.counts["steps"],
            "segments": len(ids), "lost": len(report.lost),
            "duplicated_segments": len(report.duplicated),
            "same_id_repeats": sum(n - 1 for n in ids.values()),
            "corrupt": len(report.corrupt), "order": len(report.order),
            "seconds": round(time.monotonic() - started, 1),
            "examples": (report.lost + report.duplicated + report.corrupt)[:5]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Repeated leave/come-back cycles of a segmenter and an arbiter replica; "
                    "prints lost, duplicated and corrupt figures from the run's audit.")
    parser.add_argument("--cycles", type=int, default=10, help="leave/come-back cycles")
    parser.add_argument("--bus", default="embedded",
                        help="embedded, kafka (starts its own Tansu broker) or kafka://host:port")
    parser.add_argument("--steps-between", type=int, default=20,
                        help="steps the stayers handle alone between two cycles")
    parser.add_argument("--write-delay", type=float, default=1.0,
                        help="seconds a closed segment may wait for its batched write")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds for the whole run")
    args = parser.parse_args(argv)
    if args.cycles < 1:
        parser.error("--cycles must be at least 1")
    configure_logging("WARNING")
    broker = None
    with scratch_dir("gyre-handover-") as tmp:
        if args.bus == "embedded":
            url = f"sqlite:///{tmp}/events.db"
        elif args.bus == "kafka":
            broker = ops_script("brokers").start_broker("tansu", data_dir=f"{tmp}/tansu")
            url = f"kafka://{broker.host}:{broker.port}"
        else:
            url = args.bus
        cfg = tiny_config(Path(tmp) / "run", f"handover-{int(time.time())}",
                          args.write_delay)

        def progress(done: int) -> None:
            print(f"cycle {done}/{args.cycles}", file=sys.stderr, flush=True)

        try:
            result = asyncio.run(measure(url, cfg, args.cycles, args.steps_between,
                                         args.timeout, progress))
        finally:
            if broker is not None:
                broker.stop()
    result["bus"] = "embedded" if args.bus == "embedded" else "kafka"
    print_result(result)
    return 0 if result["lost"] == result["duplicated_segments"] == result["corrupt"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
