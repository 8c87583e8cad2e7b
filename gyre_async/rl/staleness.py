"""Staleness admission: how far sampling may run ahead of the learner (AReaL-style).

Every step carries the policy version that produced it. The learner consumes
``steps_per_version`` steps per update, so with the learner at version ``v`` the steps it
will still train on before version ``v + max_staleness + 1`` number
``(v + max_staleness + 1) * steps_per_version`` in total since the start. But the learner
also *consumes* steps it never trains on: segments dropped as stale or rolled back, and
batches larger than ``steps_per_version``. Counting only versions, those steps were lost to
the gate: once enough were dropped, the sampler stopped at its cap while the learner waited
for a batch that could no longer fill (a deadlock, seen in a long run without milestones).
So the cap also counts from ``consumed`` (steps trained on or dropped, announced in each
``policy-version``) and the larger of the two applies. Steps also sit in segments that are
still open (an episode's current segment closes at a boundary or at its end), out of the
learner's reach; ``in_flight`` (at most one open segment per environment slot: ``num_envs *
segmenter.max_segment_steps``) is allowed on top, or a small ``max_staleness`` could leave
the learner short of a batch with the sampler at its cap::

    capacity(v, c)           =   max(v * steps_per_version, c)
                                 + (max_staleness + 1) * steps_per_version + in_flight
    may_sample(n, v, c)      <=>  n < capacity(v, c)
    is_stale(s, v)           <=>  v - s > max_staleness        (sample made by version s)
    sampler_must_pause(s, v) <=>  v - s > max_staleness        (sampler acting with version s)

Known limit: the sampler learns the consumed count only from the next ``policy-version``,
so drops since the last version do not reopen the gate until then. With ``max_staleness``
>= 1 the ``(max_staleness + 1)`` batches of headroom cover that; an *async* run with
``max_staleness = 0`` can still stall under load (use sync mode for on-policy training).

Staleness itself stays bounded by ``is_stale`` (the learner drops what is too old) and
``sampler_must_pause``. ``max_staleness = 0`` is synchronous on-policy RL: one version's
worth of steps, then wait. The class is pure (no clocks, no I/O), so the sampler and learner
share one rule.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StalenessGate:
    """The admission rule above; ``max_staleness >= 0``, ``steps_per_version >= 1``."""

    max_staleness: int
    steps_per_version: int
    in_flight: int = 0

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.steps_per_version < 1:
            raise ValueError(f"steps_per_version must be >= 1, got {self.steps_per_version}")

    def capacity(self, learner_version: int, consumed: int = 0) -> int:
        """Total steps that may have been emitted while the learner is at this version,
        having consumed (trained on or dropped) ``consumed`` steps."""
        ahead = (self.max_staleness + 1) * self.steps_per_version + self.in_flight
        return max(learner_version * self.steps_per_version, consumed) + ahead

    def may_sample(self, steps_emitted: int, learner_version: int, consumed: int = 0) -> bool:
        """True iff one more step may be emitted: ``steps_emitted < capacity(v, c)``."""
        return steps_emitted < self.capacity(learner_version, consumed)

    def is_stale(self, sample_version: int, learner_version: int) -> bool:
        """True iff a sample made by ``sample_version`` is too old to train on now."""
        return learner_version - sample_version > self.max_staleness

    def sampler_must_pause(self, sampler_version: int, learner_version: int) -> bool:
        """True iff a sampler still acting with ``sampler_version`` must wait for new weights."""
        return learner_version - sampler_version > self.max_staleness
