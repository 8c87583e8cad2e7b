"""Demonstrations: the offline data of warm-start (``gyre warmstart``) and export (``gyre export``).

Format: JSON Lines, one episode per line (``format`` names the version)::

    {"format": "gyre-demonstration/2", "env": "twx", "env_config": {"game": "twc", ...},
     "task_id": "twx:3", "seed": 3, "source": "gold", "success": true, "score": 1.0,
     "steps": [{"observation": "...", "action": "take dirty teal dress",
                "milestones": ["points:1"], "task": "..."}, ...]}

- ``observation`` is exactly what the environment adapter returned before the action (what
  the sampler's context builder read), ``action`` the text the agent wrote, ``milestones``
  the names of those the action reached (the context's milestone summary is rebuilt from
  them). ``task`` is the environment's statement of the task when the observation was
  seen (``Env.task``: segment openings hold it). So :func:`training_pairs` and
  :func:`training_segments` rebuild the very contexts the sampler would have built.
  Version 1 files (no ``task``) still give window contexts; segment contexts need version 2.
- ``source``: ``gold`` (a simulator's gold path), ``walkthrough`` (TextWorld), or
  ``export:<run_id>`` (a successful online trajectory, see :mod:`gyre_async.offline.export`).
- ``env`` / ``env_config`` / ``task_id`` / ``seed`` identify the episode, so it can be
  replayed: the demonstration's actions, played again, give the same observations.
"""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import msgspec

from gyre_async.core.rollout import EpisodeState, milestone_summary
from gyre_async.envs import make_env
from gyre_async.envs.base import StepResult
from gyre_async.envs.text_games import TextGameEnv
from gyre_async.policy.context import ContextBuilder
from schemas.config import SegmenterConfig
from schemas.events import Milestone

FORMAT = "gyre-demonstration/2"
#: the format before steps carried the task (window contexts only need what it has)
FORMAT_V1 = "gyre-demonstration/1"


class DemoStep(msgspec.Struct, kw_only=True):
    observation: str
    action: str
    milestones: list[str] = []
    task: str = ""


class Demonstration(msgspec.Struct, kw_only=True):
    env: str
    env_config: dict[str, Any]
    task_id: str
    seed: int
    source: str
    success: bool
    score: float
    steps: list[DemoStep]
    format: str = FORMAT


def write_demonstrations(path: str, demos: Iterable[Demonstration]) -> int:
    """Write JSONL atomically; returns how many episodes were written."""
    from gyre_async.storage.atomic import atomic_write_bytes

    lines = [msgspec.json.encode(d) for d in demos]
    atomic_write_bytes(path, b"".join(line + b"\n" for line in lines))
    return len(lines)


def read_demonstrations(path: str) -> list[Demonstration]:
    """Read a JSONL file; a bad line is an error naming the file, line and field."""
    decoder = msgspec.json.Decoder(Demonstration)
    out = []
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                demo = decoder.decode(line)
            except msgspec.ValidationError as exc:
                raise ValueError(f"{path}:{n}: not a demonstration ({exc}); see "
                                 "gyre_async/offline/demonstrations.py for the format") from None
            if demo.format not in (FORMAT, FORMAT_V1):
                raise ValueError(f"{path}:{n}: format {demo.format!r}, this build reads {FORMAT!r}")
            out.append(demo)
    return out


def replay(env: TextGameEnv, actions: Sequence[str], task_id: str, seed: int, *,
           env_name: str, env_config: dict[str, Any], source: str) -> Demonstration:
    """Play ``actions`` from the start of episode ``(task_id, seed)``, recording each step."""
    observation = env.reset_sync(task_id, seed)
    steps: list[DemoStep] = []
    success, score = False, 0.0
    for action in actions:
        task = env.task()
        result = env.step_sync(action)
        steps.append(DemoStep(observation=observation, action=action,
                              milestones=[m.name for m in result.milestones], task=task))
        observation, success, score = result.observation, result.success, result.score
        if result.over:
            break
    return Demonstration(env=env_name, env_config=dict(env_config), task_id=task_id, seed=seed,
                         source=source, success=success, score=score, steps=steps)


def gold_demonstrations(env_name: str, env_config: dict[str, Any], seeds: Iterable[int],
                        *, source: str = "gold") -> list[Demonstration]:
    """Record the environment's own solutions (gold paths, walkthroughs) for ``seeds``.

    Each is replayed through the adapter, so observations are the adapter's and
    ``success`` says whether the gold sequence really solved the episode (kept either way;
    :func:`training_pairs` can skip failures).
    """
    # Recorded without the step cap, and with "snap" off: a gold action is valid as written,
    # and snapping never changes what the agent sees (only "hint" does, and stays on).
    recording = {**env_config, "max_steps": 100_000}
    if recording.get("admissible") == "snap":
        recording["admissible"] = "off"
    env = make_env(env_name, **recording)
    if not isinstance(env, TextGameEnv):
        raise ValueError(f"environment {env_name!r} has no demonstrations (text games do: "
                         "twx, scienceworld, textworld)")
    try:
        out = []
        for seed in seeds:
            task_id = f"{env_name}:{seed}"
            env.reset_sync(task_id, seed)
            out.append(replay(env, env.demonstration(), task_id, seed, env_name=env_name,
                              env_config=env_config, source=source))
        return out
    finally:
        env._release()


def training_pairs(demos: Iterable[Demonstration], builder: ContextBuilder,
                   successful_only: bool = True) -> list[tuple[list[int], str]]:
    """(context tokens, action text) per step, contexts built as the sampler builds them
    (:func:`gyre_async.core.rollout.run_episode`: recent turns + milestone summary + observation)."""
    pairs: list[tuple[list[int], str]] = []
    h = builder.history_turns
    for demo in demos:
        if successful_only and not demo.success:
            continue
        history: deque[tuple[str, str]] = deque(maxlen=max(h, 1))
        reached: list[str] = []
        for step in demo.steps:
            turns = list(history)[-h:] if h else []
            pairs.append((builder.build(step.observation, turns, milestone_summary(reached)),
                          step.action))
            history.append((step.observation, step.action))
            reached.extend(step.milestones)
    return pairs


class SegmentExample(msgspec.Struct, frozen=True):
    """One segment of a demonstration as segment contexts hold it: its whole token
    sequence, and per step (context length, action length), the action's tokens being
    the sequence's next ones (what ``CausalLMPolicy.evaluate_sequences`` reads)."""

    sequence: list[int]
    decisions: list[tuple[int, int]]


def training_segments(demos: Iterable[Demonstration], builder: ContextBuilder,
                      segments: SegmenterConfig,
                      tokens_of: Callable[[str], list[int] | None],
                      successful_only: bool = True) -> tuple[list[SegmentExample], int]:
    """Segment contexts of the demonstrations, cut where the sampler would cut them, and how
    many demonstration steps were left out.

    Each demonstration is walked through the sampler's own :class:`EpisodeState` (its
    contexts, its segment rule asked with the fields a text game's step carries: a step's
    milestones are its state change, its last step ends the episode), so every sequence is
    the one the sampler would have built playing those actions. ``tokens_of`` gives the
    tokens the policy writes for an action (None: it cannot write it); a demonstration with
    such a step is left out whole, since its sequences would not be the sampler's."""
    if not builder.segments:
        raise ValueError("training_segments: the builder makes window contexts "
                         "(training_pairs reads those)")
    out: list[SegmentExample] = []
    left_out = 0
    for demo in demos:
        if successful_only and not demo.success or not demo.steps:
            continue
        if demo.format == FORMAT_V1:
            raise ValueError(f"demonstration {demo.task_id} ({demo.source}) is {FORMAT_V1}, "
                             "written before steps carried the task, which segment contexts "
                             "open with: record it again with this build (gold paths are "
                             "recorded when no demonstration file is given)")
        written = [tokens_of(step.action) for step in demo.steps]
        if any(tokens is None for tokens in written):
            left_out += len(demo.steps)
            continue
        state = EpisodeState.first(demo.steps[0].observation, builder, segments,
                                   demo.steps[0].task)
        sequence: list[int] = []
        decisions: list[tuple[int, int]] = []
        for i, (step, tokens) in enumerate(zip(demo.steps, written)):
            assert tokens is not None
            context = state.context(builder)
            sequence = [*context, *tokens]
            decisions.append((len(context), len(tokens)))
            last = i == len(demo.steps) - 1
            reached = tuple(Milestone(name=name, proof="demonstration")
                            for name in step.milestones)
            result = StepResult(observation="" if last else demo.steps[i + 1].observation,
                                feedback=0.0, done=last, truncated=False,
                                success=last and demo.success, score=0.0,
                                milestones=reached, state_changed=bool(reached))
            after = "" if last else demo.steps[i + 1].task
            if state.advance(builder, step.action, tokens, result, after).boundary is not None:
                out.append(SegmentExample(sequence, decisions))
                decisions = []
    return out, left_out


def default_path(name: str) -> str:
    from gyre_async.envs.cache import cache_dir

    return os.path.join(cache_dir("demonstrations"), name)
