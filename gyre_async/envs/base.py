"""The async environment API every Gyre environment implements, and the guards around it.

The sampler runs many environments concurrently on one event loop, so the API is async: a
slow tool call (``await asyncio.sleep`` inside ``step``, or a blocking call pushed to a
thread) blocks only its own trajectory. :func:`guarded_step` / :func:`guarded_reset` wrap a
call in a timeout and turn every way it can go wrong into an :class:`EnvFailure` value (which
the sampler publishes as an ``env-error`` event and ends the trajectory truncated) instead of
an exception that would kill the sampler, or a silent zero reward.

Episode semantics (Gymnasium's): ``done`` means the task itself ended (all sub-tasks done, or
an unrecoverable failure); ``truncated`` means it was cut by the step cap or a timeout. The
episode is over when either is true (:attr:`StepResult.over`); ``success`` is the verifiable
outcome and is final once the episode is over.
"""

from __future__ import annotations

import abc
import asyncio
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from schemas.events import MAX_TEXT_CHARS, Milestone

#: Default upper bound on an observation's length; longer ones are reported, never cut silently.
MAX_OBSERVATION_CHARS = MAX_TEXT_CHARS

FailureKind = Literal["timeout", "exception", "oversized-observation"]


@dataclass(frozen=True)
class StepResult:
    """What the environment answered to one action.

    ``feedback`` is the raw environment signal (e.g. the score delta, plus whatever the
    environment pays for its own reasons); it is *not* the training reward: the arbiter
    builds that from outcome, milestones and guards. ``milestones`` are only those newly
    reached at this step, each proven by a fact about environment state.
    """

    observation: str
    feedback: float
    done: bool
    truncated: bool
    success: bool
    score: float
    milestones: tuple[Milestone, ...] = ()
    state_changed: bool = False
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def over(self) -> bool:
        """The episode ended (task done, or cut by the step cap)."""
        return self.done or self.truncated


@dataclass(frozen=True)
class EnvFailure:
    """A step or reset that did not produce a usable answer (maps to ``EnvError``)."""

    kind: FailureKind
    message: str
    reason: str = ""  # set when the sampler, not the env, ended it (see ``EnvError.reason``)


def observation_hash(observation: str) -> str:
    """A short sha256 of an observation's text, logged on every step so that a rebuilt
    episode (the logged actions replayed into a fresh environment) can be checked against
    what the original one saw, without storing observations on the bus."""
    return hashlib.sha256(observation.encode()).hexdigest()[:16]


class Env(abc.ABC):
    """An environment with text observations and text actions.

    One instance runs one episode at a time; the sampler owns many instances. ``reset`` and
    ``step`` may await (tool latency); they must never block the event loop with synchronous
    work that can take long (push it to a thread, see the Gymnasium adapter).
    """

    #: Episode step cap: the step that reaches it returns ``truncated=True``.
    max_steps: int

    #: An episode can be rebuilt: ``reset(task_id, seed)`` followed by the same actions
    #: gives the same observations, in a fresh instance in another process. A restarted
    #: sampler then replays an episode its predecessor left open (checking every
    #: observation against the hash in the log) and continues it; otherwise it ends the
    #: episode as abandoned. Declare it only where a replay was checked: an environment
    #: with hidden randomness (an unseeded RNG, wall-clock, a remote service) must not.
    rebuildable: bool = False

    @abc.abstractmethod
    async def reset(self, task_id: str, seed: int) -> str:
        """Start the episode identified by ``(task_id, seed)``; return the first observation."""

    @abc.abstractmethod
    async def step(self, action: str) -> StepResult:
        """Apply one action (free text) and return the environment's answer."""

    def admissible_actions(self) -> list[str]:
        """Actions that are meaningful now; ``[]`` when the environment cannot say."""
        return []

    def task(self) -> str:
        """The task as the environment states it now: the goal, and what the episode has
        revealed of it since (CookingWorld: the recipe, once read). Segment contexts open
        with it, so a segment that opens mid-episode still knows what it is for; it must
        follow from the reset and the actions alone (a rebuilt episode gets it again).
        ``""``: the environment cannot say (its first observation is the only statement)."""
        return ""

    async def close(self) -> None:  # noqa: B027 - optional hook: most environments hold nothing
        """Release resources (processes, sockets). Idempotent."""


async def _guarded(coro: Any, timeout_s: float, max_chars: int, what: str) -> Any:
    # asyncio.timeout, not asyncio.wait_for: on Python 3.11 wait_for returns the result of
    # a step that finished just as the caller was cancelled, and swallows the cancellation
    # (a sampler slot then played on to its staleness gate and never stopped).
    try:
        async with asyncio.timeout(timeout_s):
            result = await coro
    except TimeoutError:
        return EnvFailure("timeout", f"{what} took longer than {timeout_s:g}s")
    except Exception as exc:  # noqa: BLE001 - every env error becomes a value (not cancel)
        return EnvFailure("exception", f"{what} raised {type(exc).__name__}: {exc}")
    observation = result.observation if isinstance(result, StepResult) else result
    if not isinstance(observation, str):
        return EnvFailure("exception", f"{what} returned a {type(observation).__name__} "
                                       "observation, expected str")
    if len(observation) > max_chars:
        return EnvFailure("oversized-observation",
                          f"{what} returned an observation of {len(observation)} characters "
                          f"(limit {max_chars})")
    return result


async def guarded_step(env: Env, action: str, timeout_s: float, *,
                       max_observation_chars: int = MAX_OBSERVATION_CHARS
                       ) -> StepResult | EnvFailure:
    """``env.step(action)`` bounded by ``timeout_s``; failures come back as values.

    A hung step only holds up the coroutine awaiting it; other environments' steps on the
    same loop proceed. Cancellation of the caller always propagates, even one that comes
    as the step finishes.
    """
    return await _guarded(env.step(action), timeout_s, max_observation_chars, "step")


async def guarded_reset(env: Env, task_id: str, seed: int, timeout_s: float, *,
                        max_observation_chars: int = MAX_OBSERVATION_CHARS) -> str | EnvFailure:
    """``env.reset(task_id, seed)`` bounded by ``timeout_s``; failures come back as values."""
    return await _guarded(env.reset(task_id, seed), timeout_s, max_observation_chars, "reset")


# --------------------------------------------------------------------------------------------
# Registry: environments are named in config ("workshop", "gym:CartPole-v1"), built here, and
# say here which words their text uses (the policy's tokenizer is built from that).


@dataclass(frozen=True)
class EnvVocabulary:
    """The words an environment's text is made of, for word-level tokenizers.

    The environment owns its vocabulary (the policy package never imports environments):
    ``words`` are every word its observations and actions use, in a fixed order (token ids
    follow it, so the order must not depend on the process); ``action_words`` the words its
    valid actions are made of (a text policy is constrained to them). Empty ``words``: the
    environment cannot say, and a byte-level tokenizer reads its text.
    """

    words: tuple[str, ...] = ()
    action_words: tuple[str, ...] = ()

    def plus_actions(self, extra: Sequence[str]) -> EnvVocabulary:
        """Also these action words (macro names), appended so existing ids do not move.

        A vocabulary that knows no words (byte-level text) stays empty.
        """
        if not self.words or not extra:
            return self
        return EnvVocabulary(tuple(dict.fromkeys((*self.words, *extra))),
                             tuple(dict.fromkeys((*self.action_words, *extra))))


VocabularyFn = Callable[[dict[str, Any]], EnvVocabulary]

_REGISTRY: dict[str, Callable[..., Env]] = {}
_VOCABULARIES: dict[str, VocabularyFn] = {}


def register_env(name: str, factory: Callable[..., Env],
                 vocabulary: VocabularyFn | None = None) -> None:
    """Make ``make_env(name, **config)`` call ``factory(**config)``.

    ``vocabulary(config)``, when given, answers :func:`env_vocabulary` for this name.
    """
    _REGISTRY[name] = factory
    if vocabulary is not None:
        _VOCABULARIES[name] = vocabulary
    else:
        _VOCABULARIES.pop(name, None)


def make_env(name: str, **config: Any) -> Env:
    """Build an environment by name.

    ``"gym:<id>"`` wraps ``gymnasium.make(<id>)`` in
    :class:`~gyre_async.envs.gym_adapter.GymTextEnv` (config goes to the adapter,
    ``make_kwargs`` to ``gymnasium.make``); ``<id>`` may be ``module:EnvId`` (Gymnasium
    imports ``module`` first, which registers the id).
    """
    if name.startswith("gym:"):
        from gyre_async.envs.gym_adapter import make_gym_env

        return make_gym_env(name[len("gym:"):], **config)
    return _factory(name)(**config)


def env_vocabulary(name: str, env_config: Mapping[str, Any] | None = None) -> EnvVocabulary:
    """The vocabulary of environment ``name`` built with ``env_config``.

    Registered environments answer with the ``vocabulary`` function they registered (none:
    an empty vocabulary, i.e. byte-level text); ``"gym:<id>"`` environments with
    :func:`~gyre_async.envs.gym_adapter.gym_vocabulary` (action names and probed
    observations).
    """
    config = dict(env_config or {})
    if name.startswith("gym:"):
        from gyre_async.envs.gym_adapter import gym_vocabulary

        return gym_vocabulary(name[len("gym:"):], config)
    _factory(name)  # an unknown name fails here, with the list of known ones
    vocabulary = _VOCABULARIES.get(name)
    return vocabulary(config) if vocabulary is not None else EnvVocabulary()


def _factory(name: str) -> Callable[..., Env]:
    try:
        return _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY)) or "none"
        raise ValueError(f"unknown environment {name!r}; registered: {known}; "
                         "or use 'gym:<gymnasium id>'") from None


def registered_envs() -> list[str]:
    return sorted(_REGISTRY)
