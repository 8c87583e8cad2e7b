"""The workshop's built-in macro library (``[macros] builtin = "workshop"``).

Names are one word each (``_`` joins), so the policy calls a macro with one token, as it
calls a workshop verb. Sub-routines a person would name when explaining the workshop, none of which solves an
order, let alone an episode:

- ``gather_<item>`` for each of the six recipes: a *fixed sequence* that gathers the raw
  materials of **one unit** of that item, ingots first so the furnace's delay starts early
  (``gather_axe`` = mine rock, smelt ore, chop tree, chop tree). It does not look at the
  state: it does not know the current order, what is already in hand, how many units are
  left, or whether the ingots have landed. The policy still has to read the order, pick
  the matching macro (a wrong one wastes steps and materials), decide when to wait, when to
  ``craft``, and repeat per unit; selling and farming remain available to it.
- ``wait_furnace``: a *scripted* macro: ``wait`` while the furnace holds pending ingots
  (stops at once when it is empty, taking no step).

See :mod:`.macros` for how calls expand and how steps are counted.
"""

from __future__ import annotations

from gyre_async.envs.macros import Macro
from gyre_async.envs.workshop import RECIPES


def gather_sequence(item: str) -> tuple[str, ...]:
    """Env actions that gather one unit of ``item``'s materials (ingots first)."""
    recipe = RECIPES[item]
    return (("mine rock", "smelt ore") * recipe.get("ingot", 0)
            + ("chop tree",) * recipe.get("wood", 0)
            + ("cut stone",) * recipe.get("stone", 0))


def furnace_count(observation: str) -> int:
    """Pending ingots, read from the observation's ``furnace N .`` field (0 if absent)."""
    words = observation.split()
    if "furnace" not in words:
        return 0
    digits = []
    for w in words[words.index("furnace") + 1:]:
        if not w.isdigit():
            break
        digits.append(w)
    return int("".join(digits)) if digits else 0


def wait_for_furnace(observation: str, steps_done: int) -> str | None:
    """Scripted macro: wait until no ingot is pending."""
    return "wait" if furnace_count(observation) > 0 else None


def workshop_macros() -> dict[str, Macro]:
    out = {f"gather_{item}": Macro(f"gather_{item}", sequence=gather_sequence(item))
           for item in RECIPES}
    out["wait_furnace"] = Macro("wait_furnace", script=wait_for_furnace)
    return out
