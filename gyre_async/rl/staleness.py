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

Many samplers (``replicas`` processes, each with its own ``in_flight`` of open segments):
the budget above is for the whole run, but each sampler counts only the steps *it* emitted
(counting the others' would need a read of every sampler's output, live). So each takes a
fixed share, and ``in_flight`` counts once per replica::

    capacity(v, c)           =   max(v * steps_per_version, c)
                                 + (max_staleness + 1) * steps_per_version
                                 + replicas * in_flight
    share(v, c)              =   capacity(v, c) // replicas
    may_sample(n_i, v, c)    <=>  n_i < share(v, c)            (n_i: steps of sampler i)

so ``sum_i n_i <= replicas * share <= capacity``: the run as a whole stays inside the
single-sampler bound, and with ``replicas = 1`` nothing changes. The price of a fixed share:
a replica that is slower than the others, or down, leaves its share unused, and the others
wait at theirs for the learner (which still consumes whatever the slow one delivers); a
replica that stays down for good stalls the rest once the learner has consumed the
headroom. Run exactly ``replicas`` sampler processes (``gyre launch --replicas
sampler=N`` does; the launcher restarts a dead one).

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
    """The admission rule above; ``max_staleness >= 0``, ``steps_per_version >= 1``,
    ``replicas >= 1``; ``in_flight`` is per replica."""

    max_staleness: int
    steps_per_version: int
    in_flight: int = 0
    replicas: int = 1

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {self.max_staleness}")
        if self.steps_per_version < 1:
            raise ValueError(f"steps_per_version must be >= 1, got {self.steps_per_version}")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")

    def capacity(self, learner_version: int, consumed: int = 0) -> int:
        """Total steps that all samplers together may have emitted while the learner is at
        this version, having consumed (trained on or dropped) ``consumed`` steps."""
        ahead = ((self.max_staleness + 1) * self.steps_per_version
                 + self.replicas * self.in_flight)
        return max(learner_version * self.steps_per_version, consumed) + ahead

    def share(self, learner_version: int, consumed: int = 0) -> int:
        """Steps one of the ``replicas`` samplers may have emitted: ``capacity // replicas``."""
        return self.capacity(learner_version, consumed) // self.replicas

    def may_sample(self, steps_emitted: int, learner_version: int, consumed: int = 0) -> bool:
        """True iff this sampler may emit one more step: ``steps_emitted < share(v, c)``
        (``steps_emitted``: this sampler's own count)."""
        return steps_emitted < self.share(learner_version, consumed)

    def is_stale(self, sample_version: int, learner_version: int) -> bool:
        """True iff a sample made by ``sample_version`` is too old to train on now."""
        return learner_version - sample_version > self.max_staleness

    def sampler_must_pause(self, sampler_version: int, learner_version: int) -> bool:
        """True iff a sampler still acting with ``sampler_version`` must wait for new weights."""
        return learner_version - sampler_version > self.max_staleness
