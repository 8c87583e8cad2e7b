"""TextWorldExpress (``textworld-express``): fast text games (~1 ms/step), for tests and CI.

``make_env("twx", game="cookingworld", params="numLocations=1,...", split="train")``.
Games: cookingworld, twc, coin, mapreader, arithmetic, sorting, simonsays, peckingorder;
``params`` is the simulator's game-parameter string. Splits are the simulator's folds
(``train``, ``dev``, ``test``: disjoint seed ranges); the episode seed indexes the fold's
seed list. Milestones: each point of the game's partial score (``scoreRaw``), proven by the
simulator's score counter. Demonstrations: the simulator's gold action sequence. The task
(:meth:`Env.task`): the simulator's task description, and in CookingWorld the recipe too
once the cookbook has been read, in Simon Says with memorization the list of actions the
first observation gives (what the agent must still know when a segment context opens
after it).
All instances in a process share one JVM (:mod:`.jvm`).
"""

from __future__ import annotations

import json

from gyre_async.envs.jvm import new_interface
from gyre_async.envs.text_games import TextGameEnv, Turn, register_text_game

#: How CookingWorld's cookbook begins when read: that observation is the recipe, part of the
#: task from then on.
RECIPE_OPENING = "Gather all following ingredients"

#: What a first observation says when it holds the whole instruction (Simon Says with
#: ``memorization=1`` lists every action once, at the start, and never again): part of the
#: task, or a segment that opens mid-episode could not know what comes next.
INSTRUCTION_MARK = "take these actions in order:"


class TextWorldExpressEnv(TextGameEnv):
    #: replay checked (tests/test_env_rebuild.py): games are generated from their seed
    rebuildable = True

    def __init__(self, *, game: str = "cookingworld", params: str = "", max_steps: int = 50,
                 **common):
        super().__init__(max_steps=max_steps, **common)
        from textworld_express.constants import JAR_PATH

        self.game, self.params = game, params
        self._server = new_interface(JAR_PATH, "textworldexpress.runtime.PythonInterface",
                                     ("-Xverify:none",))
        message = self._server.load(game, params)
        if message:
            raise ValueError(f"textworld-express refused game {game!r} with params "
                             f"{params!r}: {message}")
        fold = {"train": self._server.getSeedsTrain, "dev": self._server.getSeedsDev,
                "test": self._server.getSeedsTest}[self.split]
        self._seeds = list(fold())
        self._info: dict = {}
        self._gold: list[str] = []
        self._description = ""

    def _turn(self, response: str, first: bool = False) -> Turn:
        info = json.loads(response)
        self._info = info
        raw = float(info.get("scoreRaw", 0.0))
        progress = {f"points:{k}": f"scoreRaw={raw:g}" for k in range(1, int(raw) + 1)}
        observation = info["observation"]
        task = ""
        if first:
            self._description = self._server.getTaskDescription()
            observation = f"{self._description} {observation}"
            task = observation if INSTRUCTION_MARK in observation else self._description
        elif observation.lstrip().startswith(RECIPE_OPENING):
            task = f"{self._description} {observation.strip()}"
        return Turn(observation=observation, score=float(info.get("score", 0.0)),
                    won=bool(info.get("tasksuccess")), lost=bool(info.get("taskfailure")),
                    progress=progress, raw_score=raw, task=task)

    def _start(self, task_id: str, seed: int) -> Turn:
        game_seed = self._seeds[seed % len(self._seeds)]
        turn = self._turn(self._server.generateNewGameJSON(game_seed, self.split, True), True)
        self._gold = list(self._server.getGoldActionSequence())
        return turn

    def _act(self, action: str) -> Turn:
        return self._turn(self._server.stepJSON(action))

    def _valid_actions(self) -> list[str]:
        return sorted(self._info.get("validActions", []))

    def _demonstration(self) -> list[str]:
        return self._gold


register_text_game("twx", TextWorldExpressEnv)
