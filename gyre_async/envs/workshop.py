"""The workshop: Gyre's built-in long-horizon task family (what the quickstart trains on).

An episode is a chain of *orders* ("make 2 axes", then "make 1 lamp", ...). Every order is a
sub-task; completing it is a milestone proven by inventory state. The rules of the world are
fixed (the same for every seed), so a policy that learns them generalises to unseen seeds;
seeds only vary the sequence of orders, their quantities, the distractor text and latencies.

Rules of the world (the whole of it):

- ``chop tree`` -> +1 wood; ``cut stone`` -> +1 stone; ``mine rock`` -> +1 ore.
- ``smelt ore`` takes 1 ore; the ingot appears ``smelt_delay`` steps later (a *delayed
  effect*: the furnace count in the observation shows what is pending).
- ``craft`` makes one unit of the current order's item from its recipe (a *composite step*:
  every recipe needs two or three different materials)::

      axe 2 wood + 1 ingot       pick 1 wood + 2 ingot     saw 1 wood + 1 stone + 1 ingot
      hammer 1 wood + 2 stone + 1 ingot   lamp 1 stone + 2 ingot   shovel 2 wood + 1 stone

- ``polish tools`` / ``sweep floor`` pay a little ``feedback`` and change nothing; ``sell
  <material>`` pays the same and loses one unit of it (*reward farming*: a reward that is
  just env feedback can be farmed, and farming by selling undoes progress). ``look around``
  and ``wait`` do nothing. Unknown text costs a step and does nothing ("unknown action").
- Actions are parsed by their first word (``chop`` = ``chop tree``; ``sell`` also needs its
  material), unless ``strict_actions`` asks for the exact text.

Why selling exists: without a way to lose material, a uniformly random policy accumulates
everything it needs and finishes the chain (98% in a trial); with it, random play succeeds
0% of the time while still completing ~15% of orders, so early RL still sees milestones.

The observation is short and Markov: it states the current order and what is still needed
for the rest of it, already reduced to what to do, in a fixed word order::

    order 3 of 1 0 : axe x 2 . need wood 3 stone 0 ore 1 smelt 1 ingot 2 . furnace 0 .
    ready no . chop ok . wind blows

``need`` counts what the remaining units of the order still lack (``smelt`` = ore in hand to
put in the furnace, ``ore`` = ore still to mine, ``ingot`` = ingots not yet in hand), so
:func:`oracle_action` is a fixed rule of the observation: smelt, else mine, else craft when
ready, else chop, else cut, else wait. Numbers are written digit by digit so :data:`VOCAB`
stays small.
"""

from __future__ import annotations

import asyncio
import math
import random
from dataclasses import dataclass, field

import msgspec

from gyre_async.envs.base import Env, EnvVocabulary, StepResult, register_env
from schemas.events import Milestone

RECIPES: dict[str, dict[str, int]] = {
    "axe": {"wood": 2, "ingot": 1},
    "pick": {"wood": 1, "ingot": 2},
    "saw": {"wood": 1, "stone": 1, "ingot": 1},
    "hammer": {"wood": 1, "stone": 2, "ingot": 1},
    "lamp": {"stone": 1, "ingot": 2},
    "shovel": {"wood": 2, "stone": 1},
}
ITEMS: tuple[str, ...] = tuple(RECIPES)

MATERIALS: tuple[str, ...] = ("wood", "stone", "ore", "ingot")
#: Canonical action texts (what ``admissible_actions`` returns), all always available.
ACTIONS: tuple[str, ...] = (
    "chop tree", "cut stone", "mine rock", "smelt ore", "craft", "wait", "look around",
    "polish tools", "sweep floor", *(f"sell {m}" for m in MATERIALS))
FARMING_ACTIONS = frozenset({"polish tools", "sweep floor", *(f"sell {m}" for m in MATERIALS)})
_BY_VERB = {a.split()[0]: a for a in ACTIONS if not a.startswith("sell")}

#: Every word that appears in any action (for a constrained action vocabulary).
ACTION_WORDS: tuple[str, ...] = tuple(dict.fromkeys(w for a in ACTIONS for w in a.split()))

NOISE = ("a bird sings", "wind blows", "rain falls", "a cat sleeps", "bells ring",
         "smoke rises", "a dog barks")

#: Every word that can appear in an observation or action (a word tokenizer covers them all).
VOCAB: tuple[str, ...] = tuple(dict.fromkeys(
    [str(d) for d in range(10)]
    + ["order", "of", ":", "#", "x", ".", "need", "wood", "stone", "ore", "smelt", "ingot",
       "furnace", "ready", "yes", "no", "ok", "failed", "unknown", "action", "start", "done",
       "all"]
    + list(ITEMS) + list(ACTION_WORDS)
    + [w for phrase in NOISE for w in phrase.split()]))


class WorkshopConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Knobs of the workshop family. The defaults are the quickstart task."""

    n_orders: int = 10
    """Sub-tasks in the chain: the horizon knob (~8.4 shortest steps per order on average)."""
    min_solution_steps: int = 0
    """Floor on :func:`lower_bound_steps`: the seeded chain is extended by further orders
    (drawn from the same generator) until no solution can be shorter than this. 0: exactly
    ``n_orders`` orders. The long settings use it so *every* seed is provably long."""
    max_count: int = 2
    """Each order asks for 1..max_count units (drawn per seed)."""
    max_steps: int = 300
    """Episode cap; the step that reaches it is ``truncated``."""
    smelt_delay: int = 3
    """Steps after ``smelt ore`` before the ingot appears (the delayed effect)."""
    farm_feedback: float = 0.01
    """Feedback paid by each farming action (never advances the task)."""
    noise_prob: float = 0.3
    """Chance that an observation ends with a distractor phrase."""
    strict_actions: bool = False
    """Require the exact action text; by default the first word names the action."""
    latency_mean_s: float = 0.0
    """Mean tool latency per step (log-normal, drawn from the seed); 0 turns latency off."""
    latency_sigma: float = 1.0
    """Sigma of the log-normal latency (the long tail)."""
    latency_max_s: float = 60.0
    """Cap on one step's latency, so a single draw cannot stall a test forever."""

    def __post_init__(self) -> None:
        checks = [
            (1 <= self.n_orders <= 1000, "n_orders must be in 1..1000"),
            (0 <= self.min_solution_steps <= 10_000, "min_solution_steps must be in 0..10000"),
            (1 <= self.max_count <= 4, "max_count must be in 1..4"),
            (self.max_steps >= 1, "max_steps must be >= 1"),
            (0 <= self.smelt_delay <= 50, "smelt_delay must be in 0..50"),
            (0.0 <= self.noise_prob <= 1.0, "noise_prob must be in [0, 1]"),
            (self.latency_mean_s >= 0 and self.latency_sigma >= 0, "latency must be >= 0"),
            (math.isfinite(self.farm_feedback), "farm_feedback must be finite"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(f"WorkshopConfig: {message}")


def _num(n: int) -> str:
    return " ".join(str(n))


@dataclass
class _Order:
    item: str
    count: int
    made: int = 0


@dataclass
class _State:
    orders: list[_Order]
    inventory: dict[str, int] = field(default_factory=lambda: dict.fromkeys(
        ["wood", "stone", "ore", "ingot", *ITEMS], 0))
    furnace: list[int] = field(default_factory=list)  # step at which each ingot lands
    current: int = 0
    step: int = 0
    emitted: set[int] = field(default_factory=set)
    last: str = "start"
    over: bool = False


def _unit_steps(item: str) -> int:
    """Fewest actions that make one unit of ``item`` from nothing (see lower_bound_steps)."""
    r = RECIPES[item]
    return r.get("wood", 0) + r.get("stone", 0) + 2 * r.get("ingot", 0) + 1


def make_orders(config: WorkshopConfig, task_id: str, seed: int) -> list[_Order]:
    """The seeded order chain of an episode (what varies between tasks).

    ``n_orders`` orders, then more from the same generator while the chain's lower bound is
    under ``min_solution_steps`` (each order adds >= 4 steps, so this ends).
    """
    rng = random.Random(f"workshop|{task_id}|{seed}|orders")
    orders = [_Order(rng.choice(ITEMS), rng.randint(1, config.max_count))
              for _ in range(config.n_orders)]
    bound = sum(o.count * _unit_steps(o.item) for o in orders)
    while bound < config.min_solution_steps:
        orders.append(_Order(rng.choice(ITEMS), rng.randint(1, config.max_count)))
        bound += orders[-1].count * _unit_steps(orders[-1].item)
    return orders


def lower_bound_steps(config: WorkshopConfig, task_id: str, seed: int) -> int:
    """A proven lower bound on any solution's length (no policy can succeed faster).

    Every unit crafted consumes its materials, each wood/stone costs one action, each ingot
    two (mine + smelt), and the craft itself one; the inventory starts empty.
    """
    return sum(o.count * _unit_steps(o.item) for o in make_orders(config, task_id, seed))


class WorkshopEnv(Env):
    """The workshop as an :class:`Env`. Deterministic per ``(task_id, seed)``."""

    #: every draw (orders, distractors, latency) comes from RNGs seeded by (task, seed)
    rebuildable = True

    def __init__(self, config: WorkshopConfig | None = None, **overrides: object):
        base = config or WorkshopConfig()
        self.config = msgspec.structs.replace(base, **overrides) if overrides else base
        self.max_steps = self.config.max_steps
        self._state: _State | None = None
        self._noise = random.Random(0)
        self._latency = random.Random(0)

    # -- lifecycle -------------------------------------------------------------------------
    async def reset(self, task_id: str, seed: int) -> str:
        self._state = _State(orders=make_orders(self.config, task_id, seed))
        self._noise = random.Random(f"workshop|{task_id}|{seed}|noise")
        self._latency = random.Random(f"workshop|{task_id}|{seed}|latency")
        return self.observation()

    async def step(self, action: str) -> StepResult:
        latency = self._draw_latency()
        if latency > 0:
            await asyncio.sleep(latency)
        result = self.step_sync(action)
        result.info["latency_s"] = latency
        return result

    def admissible_actions(self) -> list[str]:
        return list(ACTIONS)

    # -- the world (synchronous, pure state machine) ---------------------------------------
    def step_sync(self, action: str) -> StepResult:
        """One step without latency (the rules); :meth:`step` adds the tool latency."""
        s = self._require_state()
        if s.over:
            raise RuntimeError("episode is over; call reset() before step()")
        before = self._completed()
        s.step += 1
        canonical = self._parse(action)
        feedback, changed, ok = 0.0, False, False
        if canonical is None:
            s.last = "unknown action"
        else:
            ok, changed = self._apply(canonical)
            s.last = f"{canonical.split()[0]} {'ok' if ok else 'failed'}"
            if canonical in FARMING_ACTIONS:
                feedback += self.config.farm_feedback
        inv = s.inventory
        while s.furnace and s.furnace[0] <= s.step:  # the delayed effect lands
            s.furnace.pop(0)
            inv["ingot"] += 1
        milestones = self._new_milestones()
        completed = self._completed()
        n = len(s.orders)
        feedback += (completed - before) / n
        done = completed == n
        truncated = not done and s.step >= self.max_steps
        s.over = done or truncated
        return StepResult(
            observation=self.observation(), feedback=feedback, done=done, truncated=truncated,
            success=done, score=completed / n, milestones=milestones,
            state_changed=changed or bool(milestones),
            info={"step": s.step, "action": canonical, "valid": canonical is not None, "ok": ok,
                  "order": min(s.current, n - 1)})

    def _parse(self, action: str) -> str | None:
        text = " ".join(action.lower().split())
        words = text.split()
        if self.config.strict_actions:
            return text if text in ACTIONS else None
        if not words:
            return None
        if words[0] == "sell":  # the object matters: it says what is lost
            candidate = " ".join(words[:2])
            return candidate if candidate in ACTIONS else None
        return _BY_VERB.get(words[0])

    def _apply(self, action: str) -> tuple[bool, bool]:
        """Apply a canonical action; return (it succeeded, state changed significantly)."""
        s = self._require_state()
        inv = s.inventory
        if action in ("chop tree", "cut stone", "mine rock"):
            inv[{"chop tree": "wood", "cut stone": "stone", "mine rock": "ore"}[action]] += 1
            return True, False
        if action == "smelt ore":
            if inv["ore"] == 0:
                return False, False
            inv["ore"] -= 1
            s.furnace.append(s.step + self.config.smelt_delay)
            return True, False
        if action.startswith("sell"):
            material = action.split()[1]
            if inv[material] == 0:
                return False, False
            inv[material] -= 1
            return True, False
        if action == "craft":
            if s.current >= len(s.orders) or not self._ready():
                return False, False
            order = s.orders[s.current]
            for material, k in RECIPES[order.item].items():
                inv[material] -= k
            inv[order.item] += 1
            order.made += 1
            if order.made == order.count:
                s.current += 1
            return True, True
        return True, False  # wait, look around, farming: no effect on the task

    def _ready(self) -> bool:
        s = self._require_state()
        recipe = RECIPES[s.orders[s.current].item]
        return all(s.inventory[m] >= k for m, k in recipe.items())

    def _completed(self) -> int:
        return sum(o.made >= o.count for o in self._require_state().orders)

    def _new_milestones(self) -> tuple[Milestone, ...]:
        """Milestones read from state: each order whose made count reached its target, once."""
        s = self._require_state()
        out = []
        for i, order in enumerate(s.orders):
            if order.made >= order.count and i not in s.emitted:
                s.emitted.add(i)
                out.append(Milestone(
                    name=f"craft:{order.item}#{i + 1}",
                    proof=(f"orders[{i}].made={order.made}/{order.count} "
                           f"inventory.{order.item}={s.inventory[order.item]} at step {s.step}")))
        return tuple(out)

    def needs(self) -> dict[str, int]:
        """What the rest of the current order still lacks (the ``need`` part of the obs)."""
        s = self._require_state()
        if s.current >= len(s.orders):
            return dict.fromkeys(("wood", "stone", "ore", "smelt", "ingot"), 0)
        order = s.orders[s.current]
        left, recipe, inv = order.count - order.made, RECIPES[order.item], s.inventory
        ingot_missing = max(0, left * recipe.get("ingot", 0) - inv["ingot"])
        unplanned = max(0, ingot_missing - len(s.furnace))
        return {"wood": max(0, left * recipe.get("wood", 0) - inv["wood"]),
                "stone": max(0, left * recipe.get("stone", 0) - inv["stone"]),
                "ore": max(0, unplanned - inv["ore"]),
                "smelt": min(inv["ore"], unplanned),
                "ingot": ingot_missing}

    def observation(self) -> str:
        s = self._require_state()
        n = len(s.orders)
        if s.current >= n:
            text = f"all {_num(n)} orders done . {s.last}"
        else:
            order, need = s.orders[s.current], self.needs()
            text = (f"order {_num(s.current + 1)} of {_num(n)} : {order.item} x "
                    f"{_num(order.count - order.made)} . need "
                    + " ".join(f"{k} {_num(v)}" for k, v in need.items())
                    + f" . furnace {_num(len(s.furnace))} . ready "
                    f"{'yes' if self._ready() else 'no'} . {s.last}")
        if self._noise.random() < self.config.noise_prob:
            text += " . " + self._noise.choice(NOISE)
        return text

    def _draw_latency(self) -> float:
        c = self.config
        if c.latency_mean_s <= 0:
            return 0.0
        mu = math.log(c.latency_mean_s) - c.latency_sigma ** 2 / 2  # so that E[latency] = mean
        return min(c.latency_max_s, self._latency.lognormvariate(mu, c.latency_sigma))

    def _require_state(self) -> _State:
        if self._state is None:
            raise RuntimeError("call reset() before using the environment")
        return self._state


def parse_observation(observation: str) -> dict[str, int | str]:
    """Read the fields of a workshop observation back (numbers rejoined from digits)."""
    words = observation.split()
    fields: dict[str, int | str] = {}
    if "need" in words:
        i = words.index("need") + 1
        while i < len(words) and words[i] != ".":
            key, i = words[i], i + 1
            digits = []
            while i < len(words) and words[i].isdigit():
                digits.append(words[i])
                i += 1
            fields[key] = int("".join(digits))
    if "ready" in words:
        fields["ready"] = words[words.index("ready") + 1]
    return fields


def oracle_action(observation: str) -> str:
    """The shortest-solution rule, read from the observation alone (proves it is Markov).

    Smelt, mine, craft when ready, chop, cut, else wait: the ingot pipeline goes first so
    the delayed effect starts as early as possible; crafting and gathering fill the wait.
    On a single order this is exactly optimal (a breadth-first search over every action
    agrees, see the tests). Over a chain it is optimal for an agent that, like the policy,
    does not see future orders; one that knew them could mine ahead while waiting, which is
    why tests bound the shortest solution from below with :func:`lower_bound_steps`.
    """
    f = parse_observation(observation)
    for key, action in (("smelt", "smelt ore"), ("ore", "mine rock"), ("ready", "craft"),
                        ("wood", "chop tree"), ("stone", "cut stone")):
        if f.get(key, 0) not in (0, "no"):
            return action
    return "wait"


#: Built-in settings by environment name: the quickstart task and the truly long ones. Every
#: seed of ``workshop-long`` provably needs >= 300 steps (cap 1,000), of ``workshop-xl``
#: >= 1,000 (cap 3,000); a uniformly random policy never finishes them and
#: :func:`oracle_action` finishes every seed (measured in docs/environments.md, checked by
#: tests/test_workshop_long.py). ``env_config`` overrides any field, as for ``workshop``.
SETTINGS: dict[str, WorkshopConfig] = {
    "workshop": WorkshopConfig(),
    "workshop-long": WorkshopConfig(n_orders=30, min_solution_steps=300, max_steps=1000),
    "workshop-xl": WorkshopConfig(n_orders=100, min_solution_steps=1000, max_steps=3000),
}


def _setting_factory(setting: WorkshopConfig):
    def build(**overrides: object) -> WorkshopEnv:
        return WorkshopEnv(setting, **overrides)
    return build


for _name, _setting in SETTINGS.items():
    register_env(_name, _setting_factory(_setting),
                 vocabulary=lambda _config: EnvVocabulary(VOCAB, ACTION_WORDS))
