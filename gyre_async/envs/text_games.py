"""Text games (ScienceWorld, TextWorld, TextWorldExpress) behind Gyre's async Env API.

The three adapters differ only in how they talk to their simulator; this module holds
what they share, so each adapter is a handful of blocking hooks:

- **Threads**: simulator calls block (py4j / a Z-machine), so ``reset`` and ``step`` run
  them on a worker thread; other environments and the policy keep moving meanwhile.
- **Seeds and splits**: an episode is ``(split, seed)``; the seed indexes the split's list
  of games / variations (modulo its size), so any integer is a valid seed and the
  validation split is disjoint from the training split by construction.
- **Milestones from state**: each hook returns the facts that hold now (``progress``:
  milestone name -> the state fact proving it: a score counter, a completed subgoal); a
  milestone is reported once, at the step where its fact first holds.
- **Admissible actions** (``admissible``): ``off``; ``hint`` (the valid actions, at most
  ``max_hint_actions``, are put in front of the observation, where the context builder
  drops them first when the window is short); ``snap`` (a constrained choice: the action
  the policy wrote is replaced by the valid action sharing most words with it, the executed
  text reported in ``info["executed"]``).
- **Vocabulary**: word tokenizers need every word the policy may read or write. It is
  collected by playing demonstration episodes of every split and cached as JSON (see
  :func:`game_vocabulary`); the cache lives in :func:`gyre_async.envs.cache.cache_dir`.
"""

from __future__ import annotations

import abc
import asyncio
import re
import string
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from gyre_async.envs.base import Env, EnvVocabulary, StepResult, register_env
from schemas.events import Milestone
from schemas.hint import HINT_PREFIX, present_hint

AdmissibleMode = Literal["off", "hint", "snap"]
_WORD = re.compile(r"[a-z_']+|\d|[^\sa-z\d]")


@dataclass(frozen=True)
class Turn:
    """A simulator's answer in adapter terms (built by the blocking hooks)."""

    observation: str
    score: float  # normalised: 1.0 is the task's full score
    won: bool = False
    lost: bool = False
    progress: dict[str, str] = field(default_factory=dict)
    raw_score: float = 0.0
    task: str = ""  # the task as known from now on (:meth:`Env.task`); "": unchanged


def one_line(text: str) -> str:
    """``text`` with every run of whitespace (line breaks too) one space: how observations
    and the task are presented."""
    return " ".join(text.split())


def words(text: str) -> list[str]:
    """The word tokenizer's split of ``text`` (lower-cased words, digits, punctuation)."""
    return _WORD.findall(text.lower())


def snap_action(action: str, valid: list[str]) -> str:
    """The valid action closest to ``action``: most shared words (Jaccard), then order."""
    if not valid:
        return action
    norm = " ".join(words(action))
    best, best_score = valid[0], -1.0
    mine = set(words(action))
    for candidate in valid:
        if " ".join(words(candidate)) == norm:
            return candidate
        theirs = set(words(candidate))
        score = len(mine & theirs) / max(len(mine | theirs), 1)
        if score > best_score:
            best, best_score = candidate, score
    return best


class TextGameEnv(Env):
    """Shared machinery of the text-game adapters (see the module docstring).

    Subclasses implement the blocking hooks ``_start``, ``_act``, ``_valid_actions`` and
    ``_demonstration``; they run on a worker thread, one call at a time per instance.
    """

    #: Split names this game knows, training split first.
    splits: tuple[str, ...] = ("train", "dev", "test")
    #: Whether vocabulary collection may ask for valid actions at every step (costly for
    #: ScienceWorld, which then contributes its own word list instead).
    vocab_from_valid_actions: bool = True

    def __init__(self, *, split: str = "train", max_steps: int = 100,
                 admissible: AdmissibleMode = "off", max_hint_actions: int = 24,
                 vocab_episodes: int = 40):
        """Common settings; ``vocab_episodes`` is read by :func:`game_vocabulary` only."""
        if split not in self.splits:
            raise ValueError(f"{type(self).__name__}: unknown split {split!r}; use one of "
                             f"{', '.join(self.splits)}")
        if admissible not in ("off", "hint", "snap"):
            raise ValueError(f"admissible must be 'off', 'hint' or 'snap', not {admissible!r}")
        self.split = split
        self.max_steps = max_steps
        self.admissible = admissible
        self.max_hint_actions = max_hint_actions
        self._valid: list[str] = []
        self._reached: set[str] = set()
        self._score = 0.0
        self._steps = 0
        self._task = ""
        self._lock = threading.Lock()

    # -- hooks (blocking; called on a worker thread) ---------------------------------------
    @abc.abstractmethod
    def _start(self, task_id: str, seed: int) -> Turn:
        """Begin the episode ``seed`` of ``self.split``; the first observation."""

    @abc.abstractmethod
    def _act(self, action: str) -> Turn:
        """Apply one action."""

    @abc.abstractmethod
    def _valid_actions(self) -> list[str]:
        """Actions valid in the current state."""

    @abc.abstractmethod
    def _demonstration(self) -> list[str]:
        """A solving action sequence for the episode just started (gold path, walkthrough)."""

    def _keep_as_is(self, action: str) -> bool:
        """Actions ``snap`` must not replace (e.g. answers to a disambiguation question)."""
        return False

    def vocabulary_text(self) -> list[str]:
        """Extra text whose words belong in the vocabulary (the simulator's word list)."""
        return []

    def _release(self) -> None:
        """Free the simulator (blocking)."""

    # -- the Env API -----------------------------------------------------------------------
    async def reset(self, task_id: str, seed: int) -> str:
        return await asyncio.to_thread(self.reset_sync, task_id, seed)

    async def step(self, action: str) -> StepResult:
        return await asyncio.to_thread(self.step_sync, action)

    def admissible_actions(self) -> list[str]:
        return list(self._valid)

    def task(self) -> str:
        return self._task

    async def close(self) -> None:
        await asyncio.to_thread(self._release)

    def demonstration(self) -> list[str]:
        """Gold actions of the current episode, from its start (call right after reset)."""
        with self._lock:
            return list(self._demonstration())

    # -- synchronous core (also used by tools that need no event loop) --------------------
    def reset_sync(self, task_id: str, seed: int) -> str:
        with self._lock:
            turn = self._start(task_id, seed)
            self._steps = 0
            self._score = turn.score
            self._reached = set(turn.progress)
            self._task = one_line(turn.task)
            self._valid = self._valid_actions() if self.admissible != "off" else []
            return self._present(turn.observation)

    def step_sync(self, action: str) -> StepResult:
        with self._lock:
            executed = action
            if self.admissible == "snap" and not self._keep_as_is(action):
                executed = snap_action(action, self._valid)
            turn = self._act(executed)
            self._steps += 1
            if turn.task:
                self._task = one_line(turn.task)
            new = tuple(Milestone(name=name, proof=proof)
                        for name, proof in turn.progress.items() if name not in self._reached)
            self._reached.update(m.name for m in new)
            feedback, self._score = turn.score - self._score, turn.score
            done = turn.won or turn.lost
            truncated = not done and self._steps >= self.max_steps
            if self.admissible != "off" and not (done or truncated):
                self._valid = self._valid_actions()
            return StepResult(
                observation=self._present(turn.observation), feedback=feedback, done=done,
                truncated=truncated, success=turn.won, score=turn.score, milestones=new,
                state_changed=bool(new),
                info={"executed": executed, "raw_score": turn.raw_score})

    def _present(self, observation: str) -> str:
        text = one_line(observation)
        if self.admissible == "hint":
            text = present_hint(self._valid[: self.max_hint_actions], text)
        return text


# -- registry of text games, and their vocabularies ----------------------------------------

_GAMES: dict[str, Callable[..., TextGameEnv]] = {}

#: env_config keys that do not change which words a game can show (excluded from the
#: vocabulary cache key, so training and validation configs share one vocabulary).
VOCAB_NEUTRAL_KEYS = frozenset({"split", "max_steps", "admissible", "max_hint_actions"})


def register_text_game(name: str, factory: Callable[..., TextGameEnv]) -> None:
    def vocabulary(env_config: dict[str, Any]) -> EnvVocabulary:
        vocab = game_vocabulary(name, env_config)
        return EnvVocabulary(tuple(vocab.words), tuple(vocab.action_words))

    register_env(name, factory, vocabulary=vocabulary)
    _GAMES[name] = factory


def is_text_game(name: str) -> bool:
    return name in _GAMES


@dataclass(frozen=True)
class Vocabulary:
    words: list[str]
    action_words: list[str]


#: Always in the vocabulary: digits, punctuation, and the hint's own words.
BASE_WORDS = [*string.digits, *string.punctuation, *words(HINT_PREFIX)]


def game_vocabulary(env_name: str, env_config: dict[str, Any] | None = None,
                    episodes_per_split: int | None = None) -> Vocabulary:
    """Every word a game's observations and actions use, collected once and cached.

    Collected by playing ``vocab_episodes`` (env_config, default 40) demonstration episodes
    of every split with the valid actions of each state, plus the simulator's own word
    list. The JSON cache is keyed by the game and its text-relevant config, so every role
    of a run (and every later run) builds the same tokenizer. Words never seen become
    ``<unk>`` (counted by the tests, not hidden).
    """
    import hashlib
    import json
    import os

    from gyre_async.envs.cache import cache_dir
    from gyre_async.storage.atomic import atomic_write_bytes

    config = dict(env_config or {})
    n = int(config.pop("vocab_episodes", episodes_per_split or 40))
    keyed = {k: v for k, v in sorted(config.items()) if k not in VOCAB_NEUTRAL_KEYS}
    key = hashlib.sha256(json.dumps([env_name, keyed, n]).encode()).hexdigest()[:16]
    path = os.path.join(cache_dir(), "vocab", f"{env_name}-{key}.json")
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
        return Vocabulary(data["words"], data["action_words"])
    vocab = _collect_vocabulary(env_name, keyed, n)
    atomic_write_bytes(path, json.dumps({"env": env_name, "env_config": keyed, "episodes": n,
                                         "words": vocab.words,
                                         "action_words": vocab.action_words}).encode())
    return vocab


def _collect_vocabulary(env_name: str, config: dict[str, Any], n: int) -> Vocabulary:
    seen: dict[str, None] = dict.fromkeys(BASE_WORDS)
    acting: dict[str, None] = {}

    def take(text: str, action: bool = False) -> None:
        for w in words(text):
            seen.setdefault(w)
            if action:
                acting.setdefault(w)

    factory = _GAMES[env_name]
    probe = factory(**config)
    try:
        for text in probe.vocabulary_text():
            take(text)
        for split in probe.splits:
            env = factory(**{**config, "split": split})
            try:
                for seed in range(n):
                    take(env.reset_sync(f"{env_name}:{seed}", seed))
                    gold = env.demonstration()
                    for action in gold:
                        take(action, action=True)
                        if env.vocab_from_valid_actions:
                            for valid in env._valid_actions():
                                take(valid, action=True)
                        result = env.step_sync(action)
                        take(result.observation)
                        if result.over:
                            break
            finally:
                env._release()
    finally:
        probe._release()
    return Vocabulary(sorted(seen), sorted(acting))
