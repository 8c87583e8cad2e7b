"""Staleness admission: how far sampling may run ahead of the learner (AReaL-style).

Every step carries the policy version that produced it, and a segment is as old as its
*first* step (``min_policy_version``): the learner refuses a segment whose first step is
more than ``max_staleness`` versions behind it when the segment arrives (``is_stale``).

Consumption, not versions, is the clock. The learner publishes a version once it has
buffered ``steps_per_version`` (``B``) steps, so each new version consumes at least ``B``
steps; ``consumed`` counts steps trained on *or dropped* (drops make no version), announced
in every ``policy-version`` and, promptly, in every ``segment-dropped``. The base of the
rule is ``base(v, c) = max(v * B, c)`` (``v * B``: events from before ``consumed``
existed); counting versions only, dropped steps were lost to the gate and the sampler
stopped at its cap while the learner waited for a batch that could no longer fill.

Pacing: a segment must arrive within the bound. Say a segment's first step is emitted as
the run's ``n``-th step, stamped with version ``s``, while the learner is at version ``v``
(``s <= v``) having consumed ``c``. Before the segment reaches the learner, the learner adds
at most ``A`` steps of other segments: those emitted before it and not yet consumed
(``n - c``), plus what the other slots emit while it is open and close before it does.
An open segment lasts at most ``max_segment_steps`` of its slot's steps, during which the
slots, acting in one batch, each emit about as many: ``in_flight = num_envs *
max_segment_steps`` per sampler (``H``) bounds that second part. So ``A <= n - c + H``, the
learner is at most ``A // B`` versions past ``v`` when it arrives, and the segment is
within the bound if ``v - s + A // B <= max_staleness``, which holds when
``n - c + H < (max_staleness + 1 - (v - s)) * B``. A segment may therefore only *open*
while the steps emitted stay under ``base + lead``; the steps of a segment already open
only need the looser ``capacity`` (stopping them mid-segment would only age it)::

    lead(v, s)               =   max((max_staleness + 1 - (v - s)) * B - H,  B + H)
    may_open_segment(n, v, c, s)  <=>  n < base(v, c) + lead(v, s)
    capacity(v, c)           =   base(v, c) + (max_staleness + 1) * B + H
    may_sample(n, v, c)      <=>  n < capacity(v, c)      (a step of an open segment)
    is_stale(s, v)           <=>  v - s > max_staleness   (sample made by version s)
    sampler_must_pause(s, v) <=>  v - s > max_staleness   (sampler acting with version s)

The floor ``B + H`` keeps the loop live: when every slot waits to open a segment, nothing
is open, so ``n - c >= B`` steps sit in closed segments and the learner can make its next
version (``B`` alone would leave no room for rounding or a withheld segment). Where the
floor decides (``max_staleness * B < 2 * H``, e.g. ``max_staleness = 0`` in async mode),
pacing cannot promise the bound and some segments are still dropped. ``capacity`` is at
least ``base + lead`` (so an open segment never waits for it while new ones may open) and
stays the hard cap on everything one sampler has emitted.

Many samplers (``replicas`` processes, each with its own ``H`` of open segments): each
counts only the steps *it* emitted (counting the others' would need a live read of every
sampler's output), so each takes a fixed share, ``H`` counts once per replica, and
``sum_i n_i <= replicas * share <= total``::

    lead(v, s)               =   max((max_staleness + 1 - (v - s)) * B - replicas * H,
                                     B + replicas * H)
    open_share(v, c, s)      =   (base(v, c) + lead(v, s)) // replicas
    share(v, c)              =   capacity(v, c) // replicas,  capacity with replicas * H
    may_open_segment(n_i, ..) <=> n_i < open_share;  may_sample(n_i, ..) <=> n_i < share

With ``replicas = 1`` the share is the whole. The price of a fixed share: a replica that
is slower than the others, or down, leaves its share unused, and the others wait at theirs
for the learner (which still consumes whatever the slow one delivers); a replica that
stays down for good stalls the rest once the learner has consumed the headroom. Run
exactly ``replicas`` sampler processes (``gyre launch --replicas sampler=N`` does; the
launcher restarts a dead one).

``H`` is an estimate, not a bound: a slot whose environment is much slower than the others'
keeps its segment open longer. The bound itself stays hard: the learner drops what is too
old (``is_stale``), and the audit checks that nothing beyond it was trained. Known limit:
a segment the arbiter withholds (``reward-failed``) is never trained nor dropped, so its
steps never count as consumed; the floor's ``H`` of slack absorbs a few.
``max_staleness = 0`` is synchronous on-policy RL when ``run.mode = "sync"``. The class is
pure (no clocks, no I/O), so the sampler and learner share one rule.
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

    def base(self, learner_version: int, consumed: int = 0) -> int:
        """Steps the learner has consumed (trained on or dropped), as far as the sampler
        knows: ``max(v * steps_per_version, consumed)``."""
        return max(learner_version * self.steps_per_version, consumed)

    def capacity(self, learner_version: int, consumed: int = 0) -> int:
        """Total steps that all samplers together may have emitted while the learner is at
        this version, having consumed (trained on or dropped) ``consumed`` steps."""
        ahead = ((self.max_staleness + 1) * self.steps_per_version
                 + self.replicas * self.in_flight)
        return self.base(learner_version, consumed) + ahead

    def share(self, learner_version: int, consumed: int = 0) -> int:
        """Steps one of the ``replicas`` samplers may have emitted: ``capacity // replicas``."""
        return self.capacity(learner_version, consumed) // self.replicas

    def may_sample(self, steps_emitted: int, learner_version: int, consumed: int = 0) -> bool:
        """True iff this sampler may emit one more step of a segment already open:
        ``steps_emitted < share(v, c)`` (``steps_emitted``: this sampler's own count)."""
        return steps_emitted < self.share(learner_version, consumed)

    def lead(self, learner_version: int, sampler_version: int) -> int:
        """How far past ``base`` all samplers together may be when a segment opens, for
        that segment to reach the learner within the bound."""
        in_flight = self.replicas * self.in_flight
        versions_left = self.max_staleness + 1 - (learner_version - sampler_version)
        return max(versions_left * self.steps_per_version - in_flight,
                   self.steps_per_version + in_flight)

    def open_share(self, learner_version: int, consumed: int, sampler_version: int) -> int:
        """Steps one sampler may have emitted when it opens a segment."""
        return (self.base(learner_version, consumed)
                + self.lead(learner_version, sampler_version)) // self.replicas

    def may_open_segment(self, steps_emitted: int, learner_version: int, consumed: int,
                         sampler_version: int) -> bool:
        """True iff this sampler may emit the first step of a new segment, acting with
        ``sampler_version``: ``steps_emitted < open_share(v, c, s)``."""
        return steps_emitted < self.open_share(learner_version, consumed, sampler_version)

    def is_stale(self, sample_version: int, learner_version: int) -> bool:
        """True iff a sample made by ``sample_version`` is too old to train on now."""
        return learner_version - sample_version > self.max_staleness

    def sampler_must_pause(self, sampler_version: int, learner_version: int) -> bool:
        """True iff a sampler still acting with ``sampler_version`` must wait for new weights."""
        return learner_version - sampler_version > self.max_staleness
