"""Adapter: a Gymnasium environment with text observations/actions as a Gyre :class:`Env`.

Gymnasium's API is synchronous; a slow ``step`` would block the sampler's whole event loop,
so by default calls run in a worker thread (``asyncio.to_thread``). A hung call then only
holds its own trajectory: :func:`~gyre_async.envs.base.guarded_step` times it out (the thread
itself cannot be killed; it is abandoned and the sampler should drop the instance).

Everything below can be given in ``task.env_config`` (TOML): lists of strings as lists,
functions as ``"module:function"`` strings, ``make_kwargs`` as a table.

- observation: used as is when it is a ``str``; otherwise ``render_observation(obs)`` must
  turn it into text (there is no silent ``str(array)``).
- action: ``parse_action(text)`` returns the Gymnasium action, or ``None`` for "invalid";
  without it, a ``Discrete`` space is matched against its action names, else against the
  decimal index. Names come from, first found: ``action_names`` in config, an
  ``action_names`` attribute of the environment, its ``get_action_meanings()`` (Atari).
  Text is compared as the word tokenizer splits it (case and spacing do not matter).
- ``admissible`` (as for the text games): ``off`` (default) an invalid action costs a step
  and does nothing (the environment is not called; the observation repeats with
  ``info["valid"] = False``); ``hint`` the action names are put in front of every
  observation; ``snap`` the text is replaced by the action name sharing most words with it
  (reported in ``info["executed"]``), so every action the policy writes is a valid one.
- ``success``: ``success_fn(info, terminated)``, by default ``info["is_success"]`` or
  ``info["success"]``; ``score``: ``info["score"]`` when present, else the return so far.
- milestones, read from the environment's state: ``milestone_fn(gym_env, info)`` returns
  :class:`Milestone` s, or else the environment's own ``milestones()`` method returns the
  facts that hold now (milestone name -> the state fact proving it). Each name is reported
  once per episode, at the step where it first holds.

The vocabulary a word-level policy needs (:func:`gym_vocabulary`) is the action names'
words, an environment's ``vocabulary`` attribute or config list (texts whose words it may
show), and the words of observations seen while playing ``vocab_episodes`` (default 8)
random-action episodes on fixed seeds, so every role of a run collects the same words.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from gyre_async.envs.base import Env, EnvVocabulary, StepResult
from gyre_async.envs.text_games import BASE_WORDS, AdmissibleMode, snap_action, words
from gyre_async.imports import import_callable
from schemas.events import Milestone
from schemas.hint import present_hint

#: Random-action episodes played to collect observation words, and their step cap.
VOCAB_EPISODES, VOCAB_MAX_STEPS = 8, 200


def _key(text: str) -> str:
    """``text`` as the word tokenizer writes it back (lower case, words split by spaces)."""
    return " ".join(words(text))


def _resolve(fn: Callable[..., Any] | str | None, kind: str) -> Callable[..., Any] | None:
    return import_callable(fn, f"gym adapter {kind}") if isinstance(fn, str) else fn


def declared_action_names(env: Any) -> list[str] | None:
    """The action names the environment itself declares (``action_names``, Atari meanings)."""
    inner = getattr(env, "unwrapped", env)
    names = getattr(inner, "action_names", None)
    if names is None and callable(getattr(inner, "get_action_meanings", None)):
        names = inner.get_action_meanings()
    return [str(n) for n in names] if names is not None else None


class GymTextEnv(Env):
    """Wrap one ``gymnasium.Env`` instance (see the module docstring for the text rules)."""

    def __init__(self, env: Any, *, render_observation: Callable[[Any], str] | str | None = None,
                 parse_action: Callable[[str], Any | None] | str | None = None,
                 action_names: Sequence[str] | None = None, max_steps: int | None = None,
                 success_fn: Callable[[dict, bool], bool] | str | None = None,
                 milestone_fn: Callable[[Any, dict], Iterable[Milestone]] | str | None = None,
                 admissible: AdmissibleMode = "off", in_thread: bool = True,
                 vocabulary: Sequence[str] = (), vocab_episodes: int = VOCAB_EPISODES):
        """``vocabulary`` and ``vocab_episodes`` are read by :func:`gym_vocabulary` only."""
        if admissible not in ("off", "hint", "snap"):
            raise ValueError(f"admissible must be 'off', 'hint' or 'snap', not {admissible!r}")
        self.env = env
        self._render = _resolve(render_observation, "render_observation")
        self._parse = _resolve(parse_action, "parse_action")
        self._success_fn = _resolve(success_fn, "success_fn")
        self._milestone_fn = _resolve(milestone_fn, "milestone_fn")
        names = action_names if action_names is not None else declared_action_names(env)
        self._names = [_key(n) for n in names] if names else None
        spec_cap = getattr(getattr(env, "spec", None), "max_episode_steps", None)
        self.max_steps = int(max_steps or spec_cap or 1000)
        self.admissible = admissible
        self._in_thread = in_thread
        self._discrete_n = self._discrete_size(env)
        if self._parse is None and self._discrete_n is None:
            raise ValueError("GymTextEnv: the action space is not Discrete; pass parse_action "
                             "to turn action text into a Gymnasium action")
        if self._names is not None and self._parse is None and len(self._names) != self._discrete_n:
            raise ValueError(f"GymTextEnv: {len(self._names)} action_names for a Discrete("
                             f"{self._discrete_n}) action space")
        if admissible != "off" and self._names is None:
            raise ValueError(f"GymTextEnv: admissible = {admissible!r} needs action names "
                             "(action_names in env_config, or on the environment)")
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

    def text(self, obs: Any) -> str:
        """A Gymnasium observation as text (``render_observation``, or the string itself)."""
        if self._render is not None:
            return self._render(obs)
        if isinstance(obs, str):
            return obs
        raise TypeError(f"GymTextEnv: observation is a {type(obs).__name__}, not text; pass "
                        "render_observation to turn it into a string")

    def _action(self, text: str) -> Any | None:
        if self._parse is not None:
            return self._parse(text)
        if self._names is not None:
            key = _key(text)
            return self._names.index(key) if key in self._names else None
        key = text.strip()
        return int(key) if key.isdigit() and int(key) < (self._discrete_n or 0) else None

    def _present(self, observation: str) -> str:
        if self.admissible == "hint" and self._names:
            return present_hint(list(self._names), observation)
        return observation

    async def reset(self, task_id: str, seed: int) -> str:
        """Reset with ``seed``; ``task_id`` is only recorded (Gymnasium ids name the task)."""
        obs, _info = await self._call(self.env.reset, seed=seed)
        self._obs_text, self._steps, self._return, self._seen = self.text(obs), 0, 0.0, set()
        return self._present(self._obs_text)

    async def step(self, action: str) -> StepResult:
        self._steps += 1
        cap = self._steps >= self.max_steps
        executed = action
        if self.admissible == "snap" and self._names:
            executed = snap_action(action, self._names)
        gym_action = self._action(executed)
        if gym_action is None:
            return StepResult(observation=self._present(self._obs_text), feedback=0.0,
                              done=False, truncated=cap, success=False, score=self._return,
                              info={"valid": False, "step": self._steps})
        obs, reward, terminated, truncated, info = await self._call(self.env.step, gym_action)
        self._obs_text = self.text(obs)
        self._return += float(reward)
        info = dict(info)
        if self._success_fn is not None:
            success = bool(self._success_fn(info, bool(terminated)))
        else:
            success = bool(info.get("is_success", info.get("success", False)))
        milestones = self._new_milestones(info)
        info.update(valid=True, step=self._steps, executed=executed)
        return StepResult(
            observation=self._present(self._obs_text), feedback=float(reward),
            done=bool(terminated), truncated=bool(truncated) or (cap and not terminated),
            success=success, score=float(info.get("score", self._return)),
            milestones=tuple(milestones), state_changed=bool(milestones), info=info)

    def _new_milestones(self, info: dict) -> list[Milestone]:
        if self._milestone_fn is not None:
            reached = list(self._milestone_fn(self.env, info))
        elif callable(getattr(getattr(self.env, "unwrapped", self.env), "milestones", None)):
            facts: Mapping[str, str] = getattr(self.env, "unwrapped", self.env).milestones()
            reached = [Milestone(name=name, proof=str(proof)) for name, proof in facts.items()]
        else:
            return []
        new = [m for m in reached if m.name not in self._seen]
        self._seen.update(m.name for m in new)
        return new

    def admissible_actions(self) -> list[str]:
        return list(self._names) if self._names is not None else []

    def action_words(self) -> list[str]:
        """Words valid actions are made of: the names', or the digits of unnamed indices
        (``[]`` when ``parse_action`` decides what is valid)."""
        if self._names is not None:
            return sorted({w for name in self._names for w in words(name)})
        if self._parse is None:
            return sorted({w for i in range(self._discrete_n or 0) for w in words(str(i))})
        return []

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


_VOCABULARIES: dict[str, EnvVocabulary] = {}


def gym_vocabulary(env_id: str, env_config: Mapping[str, Any] | None = None) -> EnvVocabulary:
    """The words a Gymnasium environment's text uses (see the module docstring).

    Sorted, so the order (the token ids) does not depend on the order words were met;
    computed once per process and config. Words an observation shows only in states the
    probe episodes never reached become ``<unk>``: list them in ``vocabulary``.
    """
    config = dict(env_config or {})
    cache_key = json.dumps([env_id, config], sort_keys=True, default=str)
    if cache_key not in _VOCABULARIES:
        _VOCABULARIES[cache_key] = _collect(env_id, config)
    return _VOCABULARIES[cache_key]


def _collect(env_id: str, config: dict[str, Any]) -> EnvVocabulary:
    episodes = int(config.get("vocab_episodes", VOCAB_EPISODES))
    adapter = make_gym_env(env_id, **{**config, "in_thread": False})
    seen: set[str] = set(BASE_WORDS)
    declared = [*config.get("vocabulary", ()),
                *getattr(getattr(adapter.env, "unwrapped", adapter.env), "vocabulary", ())]
    for text in declared:
        seen.update(words(text))
    action_words = adapter.action_words()
    seen.update(action_words)
    gym_env = adapter.env
    try:
        for seed in range(episodes):
            obs, _info = gym_env.reset(seed=seed)
            gym_env.action_space.seed(seed)
            seen.update(words(adapter.text(obs)))
            for _ in range(min(adapter.max_steps, VOCAB_MAX_STEPS)):
                obs, _r, terminated, truncated, _info = gym_env.step(gym_env.action_space.sample())
                seen.update(words(adapter.text(obs)))
                if terminated or truncated:
                    break
    finally:
        gym_env.close()
    return EnvVocabulary(tuple(sorted(seen)), tuple(action_words))
