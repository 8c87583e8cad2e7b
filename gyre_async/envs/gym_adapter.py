"""Adapter: a Gymnasium environment with text observations/actions as a Gyre :class:`Env`.

Gymnasium's API is synchronous; a slow ``step`` would block the sampler's whole event loop,
so by default calls run in a worker thread (``asyncio.to_thread``). A hung call then only
holds its own trajectory: :func:`~gyre_async.envs.base.guarded_step` times it out (the thread
itself cannot be killed; it is abandoned and the sampler should drop the instance).

Text in, text out:

- observation: used as is when it is a ``str``; otherwise ``render_observation(obs)`` must
  turn it into text (there is no silent ``str(array)``).
- action: ``parse_action(text)`` returns the Gymnasium action, or ``None`` for "invalid";
  without it, a ``Discrete`` space is matched against ``action_names`` (whitespace and case
  normalised), or against the decimal index when no names are given.
- an invalid action costs a step and does nothing (the environment is not called); the
  observation repeats with ``info["valid"] = False``.
- ``success``: ``success_fn(info, terminated)``, by default ``info["is_success"]`` or
  ``info["success"]``; ``score``: ``info["score"]`` when present, else the return so far.
- milestones: ``milestone_fn(gym_env, info)`` may return :class:`Milestone` s read from the
  environment's state; each name is reported once per episode.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from schemas.events import Milestone

from gyre_async.envs.base import Env, StepResult


def _normalise(text: str) -> str:
    return " ".join(text.lower().split())


class GymTextEnv(Env):
    """Wrap one ``gymnasium.Env`` instance (see the module docstring for the text rules)."""

    def __init__(self, env: Any, *, render_observation: Callable[[Any], str] | None = None,
                 parse_action: Callable[[str], Any | None] | None = None,
                 action_names: Sequence[str] | None = None, max_steps: int | None = None,
                 success_fn: Callable[[dict, bool], bool] | None = None,
                 milestone_fn: Callable[[Any, dict], Iterable[Milestone]] | None = None,
                 in_thread: bool = True):
        self.env = env
        self._render = render_observation
        self._parse = parse_action
        self._names = [_normalise(n) for n in action_names] if action_names else None
        spec_cap = getattr(getattr(env, "spec", None), "max_episode_steps", None)
        self.max_steps = int(max_steps or spec_cap or 1000)
        self._success_fn = success_fn
        self._milestone_fn = milestone_fn
        self._in_thread = in_thread
        self._discrete_n = self._discrete_size(env)
        if self._parse is None and self._discrete_n is None:
            raise ValueError("GymTextEnv: the action space is not Discrete; pass parse_action "
                             "to turn action text into a Gymnasium action")
        if self._names is not None and len(self._names) != self._discrete_n:
            raise ValueError(f"GymTextEnv: {len(self._names)} action_names for a Discrete("
                             f"{self._discrete_n}) action space")
        self._obs_text = ""
        self._steps = 0
        self._return = 0.0
        self._seen: set[str] = set()

    @staticmethod
    def _discrete_size(env: Any) -> int | None:
        space = getattr(env, "action_space", None)
        n = getattr(space, "n", None)
        return int(n) if n is not None and type(space).__name__ == "Discrete" else None

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if self._in_thread:
            return await asyncio.to_thread(fn, *args, **kwargs)
        return fn(*args, **kwargs)

    def _text(self, obs: Any) -> str:
        if self._render is not None:
            return self._render(obs)
        if isinstance(obs, str):
            return obs
        raise TypeError(f"GymTextEnv: observation is a {type(obs).__name__}, not text; pass "
                        "render_observation to turn it into a string")

    def _action(self, text: str) -> Any | None:
        if self._parse is not None:
            return self._parse(text)
        key = _normalise(text)
        if self._names is not None:
            return self._names.index(key) if key in self._names else None
        return int(key) if key.isdigit() and int(key) < (self._discrete_n or 0) else None

    async def reset(self, task_id: str, seed: int) -> str:
        """Reset with ``seed``; ``task_id`` is only recorded (Gymnasium ids name the task)."""
        obs, _info = await self._call(self.env.reset, seed=seed)
        self._obs_text, self._steps, self._return, self._seen = self._text(obs), 0, 0.0, set()
        return self._obs_text

    async def step(self, action: str) -> StepResult:
        self._steps += 1
        cap = self._steps >= self.max_steps
        gym_action = self._action(action)
        if gym_action is None:
            return StepResult(observation=self._obs_text, feedback=0.0, done=False,
                              truncated=cap, success=False, score=self._return,
                              info={"valid": False, "step": self._steps})
        obs, reward, terminated, truncated, info = await self._call(self.env.step, gym_action)
        self._obs_text = self._text(obs)
        self._return += float(reward)
        info = dict(info)
        if self._success_fn is not None:
            success = bool(self._success_fn(info, bool(terminated)))
        else:
            success = bool(info.get("is_success", info.get("success", False)))
        milestones: list[Milestone] = []
        if self._milestone_fn is not None:
            for m in self._milestone_fn(self.env, info):
                if m.name not in self._seen:
                    self._seen.add(m.name)
                    milestones.append(m)
        info.update(valid=True, step=self._steps)
        return StepResult(
            observation=self._obs_text, feedback=float(reward), done=bool(terminated),
            truncated=bool(truncated) or (cap and not terminated), success=success,
            score=float(info.get("score", self._return)), milestones=tuple(milestones),
            state_changed=bool(milestones), info=info)

    def admissible_actions(self) -> list[str]:
        return list(self._names) if self._names is not None else []

    async def close(self) -> None:
        await self._call(self.env.close)


def make_gym_env(env_id: str, *, make_kwargs: dict[str, Any] | None = None,
                 **adapter_config: Any) -> GymTextEnv:
    """``gymnasium.make(env_id, **make_kwargs)`` wrapped in :class:`GymTextEnv`."""
    try:
        import gymnasium
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ImportError("the 'gym:' environments need gymnasium: pip install gymnasium") from exc
    return GymTextEnv(gymnasium.make(env_id, **(make_kwargs or {})), **adapter_config)
