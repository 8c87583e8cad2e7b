"""Macro-actions: named sub-routines the policy calls as one action; a wrapper expands them.

A macro is declared in config (``[macros]``) or in code, in one of two forms:

- a **sequence**: a fixed list of environment actions (``gather_axe = ["mine rock",
  "smelt ore", "chop tree", "chop tree"]``);
- a **script**: ``"module:function"``, a small scripted policy called as
  ``function(observation, steps_done) -> next environment action | None`` (None: its
  sub-goal is met, stop).

The policy sees each macro name as one more action: the name's words join the tokenizer's
vocabulary and the constrained action set (``gyre_async/compose.py``), so it generates it like
any other action. Prefer one-word names (``gather_axe``: ``_`` keeps it one token of the
word tokenizer): the policy then picks a macro with a single token, as it picks a workshop
verb (the workshop reads an action by its first word).

:class:`MacroEnv` wraps an environment. A step whose text (lower-cased, split into words)
*starts with* a macro's name (the longest such name wins; ``gather_axe tree`` calls
``gather_axe``, as ``chop stone`` is ``chop tree`` in the workshop) runs the macro's
primitive steps on the inner environment, and **stops early** after a primitive step that

1. ends the episode (done or truncated: the inner step cap counts primitive steps),
2. reaches a milestone (a sub-task boundary: the policy decides what comes next), or
3. fails: the environment reports ``info["ok"] is False`` (e.g. ``smelt`` with no ore) or
   ``info["valid"] is False`` (text it did not understand);

otherwise it ends when the sequence is exhausted, the script returns None, or after
``max_primitive_steps``. A macro with nothing to do (its script stops at once) takes no
environment step; the wrapper then still counts the decision and truncates the episode
once ``max_steps`` decisions were made, so a policy cannot loop on it forever. Any other
text passes through unchanged as one primitive step. Macros do not nest: what a macro
emits goes to the inner environment as it is.

The answer to a macro call is one :class:`StepResult` for the whole call: the last
observation, the *summed* feedback, every milestone reached, done/truncated/success/score
of the last primitive step, and in ``info``: ``macro`` (its name) and ``primitives``
(:class:`~schemas.events.PrimitiveStep` per environment step). The sampler puts both on
the ``TrajectoryStep`` (fields ``macro`` and ``primitives``), so a trajectory records both
levels: the policy-level action with its tokens and log-probs (what PPO credits, one
training row per decision) and the primitive steps (for audit and for counting).

Accounting: an environment step is a *primitive* step everywhere steps are budgeted or
reported (``loop.max_env_steps``, ``summary.json``'s ``env_steps``, ``SegmentClosed.env_steps``,
``ops/bench/macro.py``), see :func:`env_steps_of`. Training rows, the learner's
``batch_steps`` and ``policy-version.env_steps`` (steps trained on), the sampler's
staleness admission, and the evaluator's ``mean_length`` / ``env_steps`` count policy-level
decisions (one row per decision). The learner discounts per decision (gamma per row, not
gamma**k).
``sampler.step_timeout_s`` bounds one whole decision, macro expansion included.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from gyre_async.envs.base import Env, StepResult
from gyre_async.imports import import_callable
from schemas.events import MAX_PRIMITIVES_PER_STEP, PrimitiveStep, TrajectoryStep

#: ``(observation, steps_done) -> next env action, or None when the sub-goal is met``.
MacroScript = Callable[[str, int], "str | None"]

#: Built-in macro libraries, by name: ``"module:function"`` returning ``{name: Macro}``.
LIBRARIES: dict[str, str] = {
    "workshop": "gyre_async.envs.workshop_macros:workshop_macros",
}

_NAME = re.compile(r"^[a-z][a-z0-9_']*( [a-z0-9_']+)*$")


def normalize(text: str) -> str:
    return " ".join(text.lower().split())


@dataclass(frozen=True)
class Macro:
    """One named sub-routine: a fixed ``sequence`` of env actions, or a ``script``."""

    name: str
    sequence: tuple[str, ...] = ()
    script: MacroScript | None = None

    def __post_init__(self) -> None:
        if not _NAME.match(self.name):
            raise ValueError(f"macro name {self.name!r}: use lower-case words separated by "
                             "single spaces (the policy generates it word by word)")
        if (self.script is None) == (not self.sequence):
            raise ValueError(f"macro {self.name!r}: give exactly one of a non-empty sequence "
                             "of env actions or a script")

    def next_action(self, observation: str, steps_done: int) -> str | None:
        if self.script is not None:
            return self.script(observation, steps_done)
        return self.sequence[steps_done] if steps_done < len(self.sequence) else None


def load_script(target: str) -> MacroScript:
    return import_callable(target, "macro script")


def load_library(target: str) -> Callable[[], dict[str, Macro]]:
    """The factory of a built-in macro library (a :data:`LIBRARIES` value)."""
    return import_callable(target, "macro script")


def macros_from_config(section: Any) -> dict[str, Macro]:
    """The macros a ``[macros]`` section declares (built-in library first, then ``define``)."""
    out: dict[str, Macro] = {}
    if section.builtin:
        if section.builtin not in LIBRARIES:
            raise ValueError(f"macros.builtin = {section.builtin!r} is unknown; known: "
                             f"{', '.join(sorted(LIBRARIES))} (or leave it empty)")
        out.update(load_library(LIBRARIES[section.builtin])())
    for name, spec in section.define.items():
        key = normalize(name)
        if isinstance(spec, str):
            out[key] = Macro(key, script=load_script(spec))
        else:
            out[key] = Macro(key, sequence=tuple(spec))
    return out


def macro_words(section: Any) -> tuple[str, ...]:
    """Words of every macro name, in a fixed order (they extend the tokenizer's vocabulary)."""
    names = sorted(macros_from_config(section)) if _enabled(section) else []
    return tuple(dict.fromkeys(w for n in names for w in n.split()))


def _enabled(section: Any) -> bool:
    return bool(section.builtin or section.define)


def with_macros(env: Env, section: Any) -> Env:
    """``env`` wrapped in a :class:`MacroEnv` when ``section`` declares macros, else ``env``."""
    if not _enabled(section):
        return env
    return MacroEnv(env, macros_from_config(section), section.max_primitive_steps)


def env_steps_of(step: TrajectoryStep) -> int:
    """Primitive environment steps one recorded step cost (1 for a plain action)."""
    return len(step.primitives) if step.macro else 1


def step_fields(result: StepResult) -> dict[str, Any]:
    """The ``TrajectoryStep`` fields that record a macro call (empty for a plain action)."""
    if "macro" not in result.info:
        return {}
    return {"macro": result.info["macro"], "primitives": list(result.info["primitives"])}


class MacroEnv(Env):
    """An environment whose action set also holds named macros, expanded here."""

    def __init__(self, inner: Env, macros: Mapping[str, Macro], max_primitive_steps: int = 16):
        if not 1 <= max_primitive_steps <= MAX_PRIMITIVES_PER_STEP:
            raise ValueError(f"macros.max_primitive_steps must be in 1..{MAX_PRIMITIVES_PER_STEP}")
        self.inner = inner
        # expansion is a function of the observations (scripts must be pure), so an
        # episode can be rebuilt exactly when the inner environment's can
        self.rebuildable = inner.rebuildable
        self.macros = {normalize(k): v for k, v in macros.items()}
        self._longest_first = sorted(self.macros, key=lambda n: -len(n.split()))
        self.max_primitive_steps = max_primitive_steps
        self.max_steps = inner.max_steps
        self._observation = ""
        self._score = 0.0
        self._decisions = 0

    async def reset(self, task_id: str, seed: int) -> str:
        self._observation = await self.inner.reset(task_id, seed)
        self._score, self._decisions = 0.0, 0
        return self._observation

    def admissible_actions(self) -> list[str]:
        inner = self.inner.admissible_actions()
        return [*inner, *self.macros] if inner else []

    def task(self) -> str:
        return self.inner.task()

    async def close(self) -> None:
        await self.inner.close()

    async def step(self, action: str) -> StepResult:
        self._decisions += 1
        macro = self.match(action)
        if macro is None:
            return self._seen(await self.inner.step(action))
        primitives: list[PrimitiveStep] = []
        milestones: list = []
        feedback, changed, latency = 0.0, False, 0.0
        last: StepResult | None = None
        while len(primitives) < self.max_primitive_steps:
            text = macro.next_action(self._observation, len(primitives))
            if text is None:
                break
            last = self._seen(await self.inner.step(text))
            ok = last.info.get("ok", True) is not False and last.info.get("valid", True) is not False
            primitives.append(PrimitiveStep(action=text, feedback=last.feedback, ok=ok))
            milestones += last.milestones
            feedback += last.feedback
            changed = changed or last.state_changed
            latency += float(last.info.get("latency_s", 0.0))
            if last.over or last.milestones or not ok:
                break
        info: dict[str, Any] = {"macro": macro.name, "primitives": primitives,
                                "latency_s": latency}
        if last is None:  # nothing to do: no environment step was taken
            return StepResult(observation=self._observation, feedback=0.0, done=False,
                              truncated=self._decisions >= self.max_steps, success=False,
                              score=self._score, info=info)
        return StepResult(observation=last.observation, feedback=feedback, done=last.done,
                          truncated=last.truncated, success=last.success, score=last.score,
                          milestones=tuple(milestones), state_changed=changed,
                          info={**last.info, **info})

    def match(self, action: str) -> Macro | None:
        """The macro ``action`` calls: the longest name its words start with (None: none)."""
        words = action.lower().split()
        for name in self._longest_first:
            parts = name.split()
            if words[:len(parts)] == parts:
                return self.macros[name]
        return None

    def _seen(self, result: StepResult) -> StepResult:
        self._observation, self._score = result.observation, result.score
        if not result.over and self._decisions >= self.max_steps:
            # decisions are capped too (macros that take no env step must not loop forever)
            return StepResult(observation=result.observation, feedback=result.feedback,
                              done=False, truncated=True, success=False, score=result.score,
                              milestones=result.milestones,
                              state_changed=result.state_changed, info=result.info)
        return result
