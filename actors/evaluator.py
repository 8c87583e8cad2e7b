"""Evaluator: a fixed validation set of unseen tasks, run on selected policy versions.

consumes: policy-version (PolicyVersion), eval-request (EvalRequest)
emits:    eval (EvalResult)

What is validated, and when, is :mod:`gyre_async.core.evaluation`'s. Besides the versions
it selects, any version named by an ``eval-request`` event (``gyre evaluate``) is
evaluated, with the decoding the request chooses. Decoding is greedy unless configured (or
requested) otherwise; the result says which (``decoding``) and why it ran (``trigger``).
"""

from __future__ import annotations

from gyre_async.bus.reading import read_events
from gyre_async.core.evaluation import Evaluation, eval_trigger
from gyre_async.runtime.actor import Actor, Emit
from schemas.config import Config
from schemas.events import EvalRequest, PolicyVersion
from schemas.topics import EVAL, EVAL_REQUEST, POLICY_VERSION


class Evaluator(Actor):
    role = "evaluator"
    consumes = (POLICY_VERSION, EVAL_REQUEST)
    emits = (EVAL,)
    max_batch = 1  # an evaluation takes seconds to minutes: publish each result at once

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.evaluation = Evaluation.from_config(cfg)

    @classmethod
    def from_config(cls, cfg: Config) -> Evaluator:
        return cls(cfg)

    async def on_stop(self) -> None:
        self.evaluation.holder.close()

    async def handle(self, event, record):
        match event:
            case PolicyVersion() if (trigger := eval_trigger(self.cfg, event)):
                return [await self._evaluate(event, self.cfg.evaluator.greedy, trigger,
                                             event.event_id)]
            case EvalRequest():
                version = await self._find_version(event.policy_version)
                if version is None:
                    self.runner.log.warning("eval-request.unknown-version",
                                            version=event.policy_version)
                    return []
                greedy = self.cfg.evaluator.greedy if event.greedy is None else event.greedy
                return [await self._evaluate(version, greedy, "request", event.event_id)]
        return []

    async def _find_version(self, wanted: int) -> PolicyVersion | None:
        """The last publication of version ``wanted`` (-1: the newest publication)."""
        found = None
        async for _, event in read_events(self.runner.bus, [POLICY_VERSION], on_bad="skip",
                                              run_id=self.runner.run_id):
            if isinstance(event, PolicyVersion) and (wanted < 0 or event.version == wanted):
                found = event
        return found

    async def _evaluate(self, version: PolicyVersion, greedy: bool, trigger: str,
                        cause: str) -> Emit:
        return Emit(EVAL, await self.evaluation.run(version, greedy=greedy, trigger=trigger,
                                                    cause=cause, producer=self.runner.name))

    def stats(self):
        return {"evaluated": float(self.evaluation.evaluated)}
