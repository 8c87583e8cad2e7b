"""The whole loop on one screen: roles, what each consumes and emits, and backpressure.

    sampler ──trajectory-step──▶ segmenter ──segment-closed──▶ arbiter ──scored──▶ learner
       ▲                                                                              │
       └──────────────────────────────── policy-version ◀─────────────────────────────┘

Edges (topic: producer -> consumers; what pushes back):
- trajectory-step: sampler -> segmenter. Keyed by trajectory id (one trajectory, one
  partition, in order). Backpressure: the sampler's staleness gate paces it by the
  learner's consumed steps, opening a segment only while it can reach the learner within
  max_staleness versions (gyre_async.rl.staleness).
- segment-closed: segmenter -> arbiter. Arrays live in the Zarr segment store; the event
  carries the address and content hash.
- scored: arbiter -> learner. The learner holds consumption (``ready``) while it trains, so
  unscored work queues on the bus, durably, instead of in memory.
- policy-version: learner (and keeper) -> sampler, evaluator. The sampler pauses when it is
  more than max_staleness versions behind; the learner drops segments beyond that bound.
- eval: evaluator -> monitor/keeper.
- keeper: keeper -> learner (rollback orders; the learner publishes the rollback version).
- telemetry: every actor -> monitor (heartbeats with lag); learner -> sampler too
  (``segment-dropped`` carries the learner's consumed count: drops reopen the gate at once).
- dead-letter: every actor -> operators (input it could not use, with the reason).

Read back outside the consumer groups (each role's ``reads``; :func:`inputs` has them all):
- sampler: its own earlier trajectory-step (episodes to resume), policy-version (the
  version in force) on a restart.
- segmenter: segment-closed (what any segmenter closed) on each partition assignment;
  policy-version and telemetry followed, for retention (what the learner is done with).
- arbiter: scored and telemetry (verdicts and drift reports) on each assignment.
- learner: policy-version and scored (versions in force, credit log, last batches).
- keeper: keeper, policy-version and eval (its slots and decisions) on a restart.
"""

from __future__ import annotations

import importlib

from schemas.config import Config

#: role -> "module:Class". Each class declares ``consumes`` and ``emits``.
ROLES: dict[str, str] = {
    "sampler": "actors.sampler:Sampler",
    "segmenter": "actors.segmenter:Segmenter",
    "arbiter": "actors.arbiter:Arbiter",
    "learner": "actors.learner:Learner",
    "evaluator": "actors.evaluator:Evaluator",
    "keeper": "actors.keeper:Keeper",
    "echo": "actors.echo:EchoActor",
}

#: The core loop's roles, in data-flow order.
CORE_ROLES = ("sampler", "segmenter", "arbiter", "learner")

#: What ``gyre run`` starts in one process.
RUN_ROLES = (*CORE_ROLES, "evaluator", "keeper")


def actor_class(role: str):
    try:
        target = ROLES[role]
    except KeyError:
        raise SystemExit(
            f"unknown role {role!r}; available roles: {', '.join(sorted(ROLES))}"
        ) from None
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)


def inputs(role: str) -> dict[str, tuple[str, ...]]:
    """Every topic ``role`` reads: ``consumes`` (its consumer group) and ``reads`` (read
    back: its restart folds, its followers)."""
    cls = actor_class(role)
    return {"consumes": tuple(cls.consumes), "reads": tuple(cls.reads)}


def build_actor(role: str, cfg: Config):
    """Instantiate a role from its config section (``cfg.<role>``)."""
    cls = actor_class(role)
    if hasattr(cls, "from_config"):
        return cls.from_config(cfg)
    return cls(getattr(cfg, role))
