"""``gyre inspect TRAJECTORY_ID``: one trajectory, as the event log tells it.

Steps (action, feedback, milestones with their state proof, the policy version that acted,
tool latency), the segments it was cut into (boundary reason, store address), each
segment's reward components and the level that decided it, the learner batch (policy
version) that trained on each segment or why it was dropped, and environment errors.
Undecodable records are skipped and their number shown (an inspection of a damaged log
still shows what it can). With ``contexts``, each step's exact context too: a step of a
segment context carries only its new tokens, and the whole context is put back together
from the steps before it (:mod:`gyre_async.core.segment_context`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gyre_async.bus import Bus
from gyre_async.bus.reading import ReadCounts, read_events
from gyre_async.core.segment_context import resolve_trajectory
from schemas.events import (
    EnvError,
    PolicyVersion,
    Scored,
    SegmentClosed,
    SegmentDropped,
    TrajectoryStep,
)
from schemas.topics import POLICY_VERSION, SCORED, SEGMENT_CLOSED, TELEMETRY, TRAJECTORY_STEP


async def collect(bus: Bus, trajectory_id: str) -> dict[str, Any]:
    topics = [TRAJECTORY_STEP, SEGMENT_CLOSED, SCORED, POLICY_VERSION, TELEMETRY]
    steps, errors, segments, scored, dropped = [], [], [], {}, {}
    trained_in: dict[str, int] = {}
    read = ReadCounts()
    async for _record, event in read_events(bus, topics, on_bad="skip", counts=read):
        match event:
            case TrajectoryStep() if event.trajectory_id == trajectory_id:
                steps.append(event)
            case EnvError() if event.trajectory_id == trajectory_id:
                errors.append(event)
            case SegmentClosed() if event.trajectory_id == trajectory_id:
                segments.append(event)
            case Scored() if event.trajectory_id == trajectory_id:
                scored[event.segment_id] = event
            case SegmentDropped():
                dropped[event.segment_id] = event
            case PolicyVersion():
                for sid in event.trained_segments:
                    trained_in[sid] = event.version
    steps.sort(key=lambda s: s.step_index)
    segments.sort(key=lambda s: s.step_start)
    return {"steps": steps, "errors": errors, "segments": segments, "scored": scored,
            "dropped": {k: v for k, v in dropped.items() if k in {s.segment_id for s in segments}},
            "trained_in": trained_in, "undecodable": read.skipped}


def render(trajectory_id: str, info: dict[str, Any], max_steps: int = 0,
           contexts: bool = False, decode: Callable[[list[int]], str] | None = None) -> str:
    """The trajectory as text; ``contexts``: each step's whole context under it (token ids,
    or text through ``decode``)."""
    steps, segments = info["steps"], info["segments"]
    skipped = (f"  ({info['undecodable']} undecodable records of the log skipped)"
               if info.get("undecodable") else "")
    if not steps and not segments:
        return (f"no events for trajectory {trajectory_id!r} (ids look like sampler-<hex>-<n>)"
                + (f"\n{skipped}" if skipped else ""))
    lines = [f"trajectory {trajectory_id}: {len(steps)} steps, {len(segments)} segments"]
    if skipped:
        lines.append(skipped)
    if steps:
        last = steps[-1]
        versions = sorted({s.policy_version for s in steps})
        lines.append(f"  task {last.task_id}  success={last.success} score={last.score:.3f} "
                     f"done={last.done} truncated={last.truncated}  policy versions {versions}")
    lines.append("steps:")
    shown = steps if not max_steps else steps[:max_steps]
    whole = {s.step_index: s.context_tokens for s in resolve_trajectory(steps)} \
        if contexts else {}
    for s in shown:
        ms = ", ".join(f"{m.name} [{m.proof}]" for m in s.milestones)
        lines.append(f"  {s.step_index:>4} v{s.policy_version:<3} {s.action_text!r:<18} "
                     f"feedback {s.feedback:+.3f} latency {s.tool_latency_s * 1000:7.1f} ms"
                     + (f"  milestone: {ms}" if ms else ""))
        if contexts:
            context = whole.get(s.step_index)
            if context is None:
                lines.append("       context: not rebuilt (a step before it is missing)")
            else:
                shown_text = decode(context) if decode else " ".join(map(str, context))
                lines.append(f"       context ({len(context)} tokens, {len(s.context_tokens)} "
                             f"carried by this step): {shown_text!r}")
    if max_steps and len(steps) > max_steps:
        lines.append(f"  ... {len(steps) - max_steps} more (use --steps 0 for all)")
    for e in info["errors"]:
        lines.append(f"  env-error at step {e.step_index}: {e.kind}: {e.message}")
    lines.append("segments:")
    for seg in segments:
        sc = info["scored"].get(seg.segment_id)
        fate = (f"trained into v{info['trained_in'][seg.segment_id]}"
                if seg.segment_id in info["trained_in"] else
                f"dropped ({info['dropped'][seg.segment_id].reason})"
                if seg.segment_id in info["dropped"] else "not trained (yet)")
        reward = (f"total {sc.total:+.3f} by {sc.decided_by} "
                  + " ".join(f"{k}={v:+.3f}" for k, v in sc.components.items() if v)
                  if sc else "not scored")
        lines.append(f"  [{seg.step_start:>4},{seg.step_end:>4}) {seg.boundary:<14} "
                     f"v{seg.min_policy_version}-{seg.max_policy_version}  {reward}  {fate}")
    return "\n".join(lines)
