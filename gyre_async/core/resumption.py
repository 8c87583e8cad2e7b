"""What a restarted sampler finds in the log: the episodes its predecessor left open.

A sampler that dies mid-episode leaves trajectories with neither a last step nor an
``env-error``; their open segments would pin the segmenter's commit floor forever. The
restarted sampler (same actor name) folds its own earlier ``trajectory-step`` log with
:class:`UnfinishedTrajectories` and, for each open trajectory, either

- **continues it** (:class:`OpenEpisode`): when the environment declares episodes
  rebuildable (``Env.rebuildable``) and the log holds every step from 0 with its
  observation hash, the sampler replays the logged actions into a fresh environment,
  checks each observation against the log and plays on as the same trajectory (same id,
  same task and seed, so the same GRPO group; step indices go on; no step is published
  twice: the replayed ones are in the log already); or
- **ends it visibly** with an ``EnvError`` (reason ``abandoned``; the segmenter closes it
  as truncated): nothing is lost or invented.

Fold only the events of one sampler (one actor name): with many samplers in a run, a
restarted replica resumes or ends its own open trajectories, never another replica's.
Trajectory ids carry the incarnation that *started* the episode (``<name>-<incarnation>-
<n>``); a continued episode keeps that id under its new incarnation, and nothing
downstream reads the incarnation back out of an id.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gyre_async.core.rollout import LoggedStep
from gyre_async.envs.base import FailureKind
from schemas import Event, event_id
from schemas.events import EnvError, TrajectoryStep

ABANDONED = "abandoned"


def task_id_of(env_name: str, seed: int) -> str:
    """The task id of a training episode: the environment's name and the episode's seed."""
    return f"{env_name}:{seed}"


def seed_of_task(env_name: str, task_id: str) -> int | None:
    """The seed :func:`task_id_of` put in ``task_id``; None when it is not ``env_name``'s."""
    prefix = f"{env_name}:"
    rest = task_id[len(prefix):] if task_id.startswith(prefix) else ""
    return int(rest) if rest.lstrip("-").isdigit() else None


@dataclass
class _Trajectory:
    task_id: str
    reset_hash: str = ""
    steps: dict[int, LoggedStep] = field(default_factory=dict)


@dataclass(frozen=True)
class OpenEpisode:
    """One open trajectory as the log has it: what rebuilding it needs, or why it cannot be.

    ``steps`` are the logged steps 0..n-1 in order (``next_step`` = n); ``unrebuildable``
    is ``""`` when the log is enough to rebuild it, else the reason (a step missing, a log
    written before observations were hashed, a task id of another environment).
    """

    trajectory_id: str
    task_id: str
    seed: int
    reset_hash: str
    steps: tuple[LoggedStep, ...]
    next_step: int
    unrebuildable: str = ""

    def ending(self, run_id: str, producer: str, *, kind: FailureKind = "exception",
               message: str, reason: str) -> EnvError:
        """The ``env-error`` that ends this trajectory (one per trajectory: same id on
        every restart, so a redelivered or re-made copy is a duplicate, not a second end)."""
        tid = self.trajectory_id
        return EnvError(event_id=event_id("env-error", run_id, tid), run_id=run_id,
                        producer=producer, key=tid, trajectory_id=tid, task_id=self.task_id,
                        step_index=self.next_step, kind=kind,
                        message=message, reason=reason)

    def abandoned(self, run_id: str, producer: str, why: str = "") -> EnvError:
        detail = why or self.unrebuildable
        return self.ending(run_id, producer, reason=ABANDONED,
                           message="abandoned: the sampler restarted mid-episode"
                           + (f" ({detail})" if detail else ""))


class UnfinishedTrajectories:
    """The trajectories a previous incarnation of a sampler left open, folded from its steps.

    ``steps`` counts what that sampler published, each step once (redelivered copies too),
    for :meth:`~gyre_async.core.sampler.SamplerCore.resume`.
    """

    def __init__(self) -> None:
        self._open: dict[str, _Trajectory] = {}
        self._last: dict[str, int] = {}  # trajectory id -> last step index (ended ones too)
        self._ended: set[str] = set()

    def fold(self, event: Event) -> None:
        match event:
            case TrajectoryStep():
                tid = event.trajectory_id
                self._last[tid] = max(self._last.get(tid, -1), event.step_index)
                if event.done or event.truncated:
                    self._ended.add(tid)
                if tid in self._ended:
                    self._open.pop(tid, None)
                    return
                trajectory = self._open.setdefault(tid, _Trajectory(event.task_id))
                trajectory.steps[event.step_index] = LoggedStep(
                    event.action_text, event.observation_hash, tuple(event.action_tokens),
                    event.policy_version)
                if event.step_index == 0:
                    trajectory.reset_hash = event.reset_hash
            case EnvError():
                self._ended.add(event.trajectory_id)
                self._open.pop(event.trajectory_id, None)

    @property
    def steps(self) -> int:
        """Steps published: steps are numbered from 0 without gaps in each trajectory."""
        return sum(last + 1 for last in self._last.values())

    def open_episodes(self, env_name: str) -> list[OpenEpisode]:
        """Every open trajectory, in the order of the log, with what rebuilding it needs."""
        return [self._episode(tid, t, env_name) for tid, t in self._open.items()
                if tid not in self._ended]

    def abandoned(self, run_id: str, producer: str) -> list[EnvError]:
        """The ``env-error`` ending each open trajectory (none of them continued)."""
        return [OpenEpisode(tid, t.task_id, 0, "", (), self._last[tid] + 1).abandoned(
            run_id, producer) for tid, t in self._open.items() if tid not in self._ended]

    def _episode(self, tid: str, trajectory: _Trajectory, env_name: str) -> OpenEpisode:
        next_step = self._last[tid] + 1
        steps = tuple(trajectory.steps[i] for i in range(next_step) if i in trajectory.steps)
        seed = seed_of_task(env_name, trajectory.task_id)
        why = ""
        if len(steps) < next_step:
            missing = next(i for i in range(next_step) if i not in trajectory.steps)
            why = f"step {missing} is not in the log"
        elif not trajectory.reset_hash or not all(s.observation_hash for s in steps):
            why = "the log has no observation hashes to check a rebuild against"
        elif seed is None:
            why = f"task {trajectory.task_id!r} is not one of environment {env_name!r}"
        return OpenEpisode(tid, trajectory.task_id, -1 if seed is None else seed,
                           trajectory.reset_hash, steps, next_step, why)
