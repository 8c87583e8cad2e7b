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

Pacing: a segment must arrive within the bound. Say a segment's first step was made by
version ``s`` while the learner is at version ``v`` (``s <= v``) having consumed ``c``.
The learner publishes a version per ``B`` steps it consumes, so the segment is within the
bound if fewer than ``reach(v, s) = (max_staleness + 1 - (v - s)) * B`` steps reach the
learner ahead of it. Ahead of it are the steps emitted outside it and not yet consumed,
and what the slots emit while it is open and close before it does. The sampler knows its
open segments (:class:`OpenSegment`: first version, length, the steps it may still take,
``max_segment_steps`` minus its length and no more than its episode's step cap leaves, and
the order it opened in), so it keeps every one of them fresh, the older first::

    reach(v, s)              =   (max_staleness + 1 - (v - s)) * B
    room(n, v, c, seg)       =   base(v, c) + reach(v, s_seg) - (n - len_seg) - 1
    reserve(seg)             =   sum of remaining steps of the open segments older than seg
    may_step(own)            <=>  for every open seg older than own (all of them when
                                  own opens a new segment), room(seg) - reserve(seg) >= 1,
                                  or room(seg) < 0 (beyond saving: it holds nobody back);
                                  and a new segment opens only if room(new) >= the
                                  remaining steps of every open segment
    capacity(v, c)           =   base(v, c) + (max_staleness + 1) * B + H
    may_sample(n, v, c)      <=>  n < capacity(v, c)      (the hard cap on every step)
    is_stale(s, v)           <=>  v - s > max_staleness   (sample made by version s)
    sampler_must_pause(s, v) <=>  v - s > max_staleness   (sampler acting with version s)

Why it holds: a segment's free room, ``room - reserve``, shrinks only by steps of younger
slots (each checked to leave it >= 0); steps of older segments are in its reserve (room and
reserve shrink together), and the learner's progress leaves room unchanged (``B`` more
consumed, one version more). So a segment that opens with ``room >= reserve`` arrives within
the bound, whatever the learner's speed. The oldest open segment has nothing older to wait
for: some slot always acts, and with nothing open a segment may open while fewer than
``reach >= B`` steps are out, so when every slot waits, at least a batch sits in closed
segments and the learner can make its next version (the loop stays live). ``H = num_envs *
max_segment_steps`` (``in_flight``) now only sizes the hard cap. Before this rule, pacing
reserved a fixed ``H`` when a segment opened and nothing afterwards; in an LLM-shaped loop
(8 slots, segments of 20 steps, batches of 32, ``max_staleness`` 2, a learner slower than
the sampler) ``H`` exceeds the whole reach and about half of what was sampled was dropped
(tests/test_staleness.py simulates both). The price: the reserve counts each open
segment's worst case, so with segments much longer than a batch and a learner as fast as
the sampler, fewer slots act at once.

Many samplers (``replicas`` processes, each with its own ``H`` of open segments): each
counts only the steps *it* emitted (counting the others' would need a live read of every
sampler's output), so each takes a fixed share, ``H`` counts once per replica, and
``sum_i n_i <= replicas * share <= total``::

    room(n_i, .., seg)       =   (base(v, c) + reach(v, s_seg)) // replicas
                                     - (n_i - len_seg) - 1
    share(v, c)              =   capacity(v, c) // replicas,  capacity with replicas * H
    may_sample(n_i, ..)      <=>  n_i < share

With ``replicas = 1`` the share is the whole. The price of a fixed share: a replica that
is slower than the others, or down, leaves its share unused, and the others wait at theirs
for the learner (which still consumes whatever the slow one delivers); a replica that
stays down for good stalls the rest once the learner has consumed the headroom. Run
exactly ``replicas`` sampler processes (``gyre launch --replicas sampler=N`` does; the
launcher restarts a dead one).

Pacing is exact only for what the sampler knows; the bound itself stays hard either way:
the learner drops what is too old (``is_stale``), and the audit checks that nothing beyond
it was trained. Known limit: a segment the arbiter withholds (``reward-failed``) is never
trained nor dropped, so its steps never count as consumed; they stay ahead of every later
segment in the sampler's count, and more than ``max_staleness * B`` of them would leave the
learner short of a batch while the sampler waits for room.
``max_staleness = 0`` is synchronous on-policy RL when ``run.mode = "sync"``. The class is
pure (no clocks, no I/O), so the sampler and learner share one rule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

_NEWEST = 1 << 62  # the order of a segment about to open: after every open one


@dataclass(frozen=True)
class OpenSegment:
    """One of this sampler's open segments, as pacing sees it: the version of its first
    step, its steps so far, how many more it may take at most (``max_segment_steps`` minus
    its length, and no more than its episode's cap leaves), and the order it opened in
    (older segments go first)."""

    first_version: int
    length: int
    remaining: int
    order: int


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

    def reach(self, learner_version: int, sampler_version: int) -> int:
        """Steps the learner may consume ahead of a segment whose first step was made by
        ``sampler_version``, for the segment to arrive within the bound (0 or less: it is
        stale already)."""
        versions_left = self.max_staleness + 1 - (learner_version - sampler_version)
        return versions_left * self.steps_per_version

    def room(self, steps_emitted: int, learner_version: int, consumed: int,
             segment: OpenSegment) -> int:
        """Steps this sampler may still emit outside an open ``segment`` before the segment
        could no longer reach the learner within the bound (below 0: it cannot already;
        the learner will drop it, whatever the sampler does)."""
        limit = (self.base(learner_version, consumed)
                 + self.reach(learner_version, segment.first_version)) // self.replicas
        return limit - (steps_emitted - segment.length) - 1

    def may_step(self, steps_emitted: int, learner_version: int, consumed: int,
                 sampler_version: int, own: OpenSegment | None,
                 open_segments: Sequence[OpenSegment]) -> bool:
        """True iff a slot may take one more step: in its open segment ``own``, or opening
        a new one (``own`` is None) with ``sampler_version``. ``open_segments``: all of
        this sampler's open segments (``own`` among them). See the module docstring."""
        if own is None:
            new = OpenSegment(sampler_version, 0, 0, order=_NEWEST)
            if self.room(steps_emitted, learner_version, consumed, new) < sum(
                    seg.remaining for seg in open_segments):
                return False
        reserve = 0  # what the segments older than ``seg`` may still take
        for seg in sorted(open_segments, key=lambda o: o.order):
            # a step of a younger slot (or a new segment) eats into an older segment's
            # room; steps of older slots are in its reserve already
            if own is None or seg.order < own.order:
                room = self.room(steps_emitted, learner_version, consumed, seg)
                if 0 <= room < reserve + 1:  # room < 0: beyond saving, holds nobody back
                    return False
            reserve += seg.remaining
        return True

    def is_stale(self, sample_version: int, learner_version: int) -> bool:
        """True iff a sample made by ``sample_version`` is too old to train on now."""
        return learner_version - sample_version > self.max_staleness

    def sampler_must_pause(self, sampler_version: int, learner_version: int) -> bool:
        """True iff a sampler still acting with ``sampler_version`` must wait for new weights."""
        return learner_version - sampler_version > self.max_staleness
