"""Environments: the async text-environment API, its guards, and the built-in task family.

- :mod:`.base`: :class:`Env`, :class:`StepResult`, :func:`guarded_step` / :func:`guarded_reset`
  (timeouts, exceptions and oversized observations become :class:`EnvFailure` values) and the
  registry: :func:`make_env` (``"workshop"``, ``"gym:<id>"``) and :func:`env_vocabulary`
  (the words each environment's text uses: every environment owns its vocabulary, and the
  composition root :mod:`gyre_async.compose` hands it to the policy's tokenizer).
- :mod:`.workshop`: the long-horizon workshop family the quickstart trains on
  (``"workshop"``), and its truly long settings ``"workshop-long"`` (every seed >= 300
  steps, cap 1,000) and ``"workshop-xl"`` (>= 1,000 steps, cap 3,000).
- :mod:`.gym_adapter`: Gymnasium environments with text observations/actions.
- :mod:`.faults`: the sampler's fault drill (``task.fail_episode_rate``): a share of
  training episodes crash at a random step (the failure-masking bench).
- :mod:`.subprocess_env`: any of them in a child process with memory and CPU-time limits
  (``"subprocess"``).
- :mod:`.text_games` and its adapters :mod:`.twx` (``"twx"``, TextWorldExpress),
  :mod:`.scienceworld` (``"scienceworld"``) and :mod:`.textworld_env` (``"textworld"``):
  offline text games with milestones read from game state, admissible-action hints or
  constrained choice, gold demonstrations, and cached vocabularies. Their packages are
  imported only when such an environment is built.
"""

from gyre_async.envs import scienceworld as _scienceworld  # noqa: F401 - registers "scienceworld"
from gyre_async.envs import textworld_env as _textworld  # noqa: F401 - registers "textworld"
from gyre_async.envs import twx as _twx  # noqa: F401 - registers "twx"
from gyre_async.envs.base import (
    MAX_OBSERVATION_CHARS,
    Env,
    EnvFailure,
    EnvVocabulary,
    StepResult,
    env_vocabulary,
    guarded_reset,
    guarded_step,
    make_env,
    register_env,
    registered_envs,
)
from gyre_async.envs.subprocess_env import EnvProcessError, SubprocessEnv
from gyre_async.envs.text_games import TextGameEnv, game_vocabulary, is_text_game
from gyre_async.envs.workshop import (
    ACTION_WORDS,
    ACTIONS,
    FARMING_ACTIONS,
    ITEMS,
    RECIPES,
    VOCAB,
    WorkshopConfig,
    WorkshopEnv,
    lower_bound_steps,
    oracle_action,
    parse_observation,
)

__all__ = [
    "ACTIONS", "ACTION_WORDS", "Env", "EnvFailure", "EnvProcessError", "EnvVocabulary",
    "SubprocessEnv", "env_vocabulary",
    "FARMING_ACTIONS", "ITEMS", "MAX_OBSERVATION_CHARS", "RECIPES", "StepResult",
    "TextGameEnv", "VOCAB", "WorkshopConfig", "WorkshopEnv", "game_vocabulary",
    "guarded_reset", "guarded_step", "is_text_game", "lower_bound_steps", "make_env",
    "oracle_action",
    "parse_observation", "register_env", "registered_envs",
]
