"""Staleness admission: how far sampling may run ahead of the learner (AReaL-style).

Every step carries the policy version that produced it. The learner consumes
``steps_per_version`` steps per update, so with the learner at version ``v`` the steps it
will still train on before version ``v + max_staleness + 1`` number
``(v + max_staleness + 1) * steps_per_version`` in total since the start. The sampler may
emit a step only while its running total stays below that::

    may_sample(n, v)         <=>  n < (v + max_staleness + 1) * steps_per_version
    is_stale(s, v)           <=>  v - s > max_staleness        (sample made by version s)
    sampler_must_pause(s, v) <=>  v - s > max_staleness        (sampler acting with version s)

``max_staleness = 0`` is synchronous on-policy RL: one version's worth of steps, then wait.
The class is pure (no clocks, no I/O), so the sampler and learner share one rule.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StalenessGate:
    """The admission rule above; ``max_staleness >= 0``, ``steps_per_version >= 1``."""

    max_staleness: int
    steps_per_version: int

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.steps_per_version < 1:
            raise ValueError(f"steps_per_version must be >= 1, got {self.steps_per_version}")

    def capacity(self, learner_version: int) -> int:
        """Total steps that may have been emitted while the learner is at this version."""
        return (learner_version + self.max_staleness + 1) * self.steps_per_version

    def may_sample(self, steps_emitted: int, learner_version: int) -> bool:
        """True iff one more step may be emitted: ``steps_emitted < capacity(v)``."""
        return steps_emitted < self.capacity(learner_version)

    def is_stale(self, sample_version: int, learner_version: int) -> bool:
        """True iff a sample made by ``sample_version`` is too old to train on now."""
        return learner_version - sample_version > self.max_staleness

    def sampler_must_pause(self, sampler_version: int, learner_version: int) -> bool:
        """True iff a sampler still acting with ``sampler_version`` must wait for new weights."""
        return learner_version - sampler_version > self.max_staleness
