"""The staleness admission rule, every expected number worked out in a comment."""

from __future__ import annotations

import random

import pytest

from gyre_async.rl.staleness import OpenSegment, StalenessGate


def test_capacity_and_may_sample_with_staleness_2():
    gate = StalenessGate(max_staleness=2, steps_per_version=100)
    # capacity(v) = (v + 2 + 1) * 100
    # v = 0: (0 + 3) * 100 = 300 -> steps 0..299 may be emitted, the 301st (n = 300) may not.
    assert gate.capacity(0) == 300
    assert gate.may_sample(0, 0)
    assert gate.may_sample(299, 0)
    assert not gate.may_sample(300, 0)
    assert not gate.may_sample(1000, 0)
    # v = 4: (4 + 3) * 100 = 700 -> 699 yes, 700 no.
    assert gate.capacity(4) == 700
    assert gate.may_sample(699, 4)
    assert not gate.may_sample(700, 4)


def test_synchronous_when_max_staleness_is_zero():
    gate = StalenessGate(max_staleness=0, steps_per_version=8)
    # capacity(v) = (v + 0 + 1) * 8: v = 0 -> 8 steps (n = 0..7), then wait for version 1.
    assert gate.may_sample(7, 0)
    assert not gate.may_sample(8, 0)
    # v = 1: (1 + 1) * 8 = 16 -> n = 8..15 now allowed, 16 not.
    assert gate.may_sample(8, 1)
    assert gate.may_sample(15, 1)
    assert not gate.may_sample(16, 1)
    # Samples must come from the learner's own version: 3 - 3 = 0 not > 0 fresh; 3 - 2 = 1 > 0 stale.
    assert not gate.is_stale(3, 3)
    assert gate.is_stale(2, 3)


def test_is_stale():
    gate = StalenessGate(max_staleness=2, steps_per_version=1)
    # learner 10: sample from 8 -> 10 - 8 = 2, not > 2: usable; from 7 -> 3 > 2: stale.
    assert not gate.is_stale(8, 10)
    assert gate.is_stale(7, 10)
    # A sample from the future (11, after a rollback of the learner to 10): 10 - 11 = -1, usable.
    assert not gate.is_stale(11, 10)


def test_sampler_must_pause():
    gate = StalenessGate(max_staleness=1, steps_per_version=64)
    # learner 5, sampler 4: 5 - 4 = 1, not > 1: keep going; sampler 3: 2 > 1: pause.
    assert not gate.sampler_must_pause(4, 5)
    assert gate.sampler_must_pause(3, 5)
    assert not gate.sampler_must_pause(5, 5)


@pytest.mark.parametrize("kwargs", [{"max_staleness": -1, "steps_per_version": 1},
                                    {"max_staleness": 0, "steps_per_version": 0}])
def test_rejects_bad_config(kwargs):
    with pytest.raises(ValueError):
        StalenessGate(**kwargs)


def test_dropped_steps_reopen_the_gate():
    """The deadlock this prevents: the learner at v54 had consumed 56,080 trained + ~600
    dropped steps; counting versions only, the cap was (54 + 3) * 1024 = 58,368 steps, all
    emitted, while fewer than 1,024 closed steps were left to make v55."""
    gate = StalenessGate(max_staleness=2, steps_per_version=1024)
    assert gate.capacity(54) == 58_368          # (54 + 3) * 1024: versions alone
    assert not gate.may_sample(58_368, 54)
    # consumed 56,080 + 600 = 56,680 -> 56,680 + 3 * 1024 = 59,752: sampling goes on
    assert gate.capacity(54, 56_680) == 59_752
    assert gate.may_sample(58_368, 54, 56_680)
    # consumption behind the version count (old events: consumed 0) never lowers the cap
    assert gate.capacity(54, 0) == gate.capacity(54) == gate.capacity(54, 50_000)


def test_open_segments_are_allowed_on_top():
    """8 slots with segments of up to 16 steps can hold 128 steps the learner cannot have
    yet; with max_staleness 0 and batches of 256 the cap must leave room for them."""
    gate = StalenessGate(max_staleness=0, steps_per_version=256, in_flight=8 * 16)
    assert gate.capacity(0) == 256 + 128
    assert gate.capacity(3, 1000) == 1000 + 256 + 128


def test_many_samplers_each_admit_their_share():
    """4 samplers of 8 slots, segments of up to 16 steps, batches of 256, max_staleness 2."""
    gate = StalenessGate(max_staleness=2, steps_per_version=256, in_flight=8 * 16, replicas=4)
    # capacity(0) = 0 + (2 + 1) * 256 + 4 * 128 = 768 + 512 = 1280; share = 1280 // 4 = 320
    assert gate.capacity(0) == 1280
    assert gate.share(0) == 320
    assert gate.may_sample(319, 0) and not gate.may_sample(320, 0)
    # all four at their share: 4 * 320 = 1280 steps, the single-sampler bound for 4 * 8 slots
    one_big = StalenessGate(max_staleness=2, steps_per_version=256, in_flight=4 * 8 * 16)
    assert 4 * gate.share(0) == one_big.capacity(0) == 1280
    # learner at v5 having consumed 1000: max(5 * 256, 1000) = 1280; + 1280 = 2560; / 4 = 640
    assert gate.share(5, 1000) == 640
    # v3, consumed 1000: max(768, 1000) = 1000; + 1280 = 2280; // 4 = 570
    assert gate.share(3, 1000) == 570
    assert gate.may_sample(569, 3, 1000) and not gate.may_sample(570, 3, 1000)


def test_shares_never_add_up_past_the_capacity():
    # 3 samplers, max_staleness 1, batches of 100, 10 in flight each:
    # capacity(0) = 2 * 100 + 3 * 10 = 230; share = 230 // 3 = 76 (76.7 rounded down)
    gate = StalenessGate(max_staleness=1, steps_per_version=100, in_flight=10, replicas=3)
    assert gate.capacity(0) == 230 and gate.share(0) == 76
    assert gate.may_sample(75, 0) and not gate.may_sample(76, 0)
    assert 3 * gate.share(0) == 228 <= gate.capacity(0)
    # one sampler: the share is the whole capacity (the rule as it always was)
    single = StalenessGate(max_staleness=1, steps_per_version=100, in_flight=10)
    assert single.share(0) == single.capacity(0) == 210


def test_rejects_zero_replicas():
    with pytest.raises(ValueError):
        StalenessGate(max_staleness=1, steps_per_version=1, replicas=0)


# -- pacing: a segment opens only while it can reach the learner within the bound -------------

def _opens(gate: StalenessGate, n: int, v: int, c: int, s: int,
           open_remaining: tuple[int, ...] = ()) -> bool:
    """May a segment open (made by version ``s``) beside open segments that may still take
    ``open_remaining`` steps each?"""
    segments = [OpenSegment(s, 1, left, order) for order, left in enumerate(open_remaining)]
    return gate.may_step(n, v, c, s, None, segments)


def test_pacing_with_the_quickstart_numbers():
    """ops/configs/quickstart.toml: max_staleness 2, batches of 1024, 32 slots, segments of
    up to 32 steps (the hard cap's H = 32 * 32)."""
    gate = StalenessGate(max_staleness=2, steps_per_version=1024, in_flight=32 * 32)
    # a segment made by the learner's own version arrives within the bound if fewer than
    # reach = (2 + 1) * 1024 = 3,072 steps reach the learner ahead of it
    assert gate.reach(0, 0) == 3072
    # nothing open, learner at v0, nothing consumed: it may open at n = 0..3,071
    assert _opens(gate, 3071, 0, 0, 0) and not _opens(gate, 3072, 0, 0, 0)
    # 31 segments open that may take 16 more steps each (496 in all, which may close before
    # the new one): it opens only while 3,071 - n >= 496, n <= 2,575
    assert _opens(gate, 2575, 0, 0, 0, (16,) * 31) and not _opens(gate, 2576, 0, 0, 0, (16,) * 31)
    # A step of a segment already open needs the cap: base + 3 * 1024 + 1024 = 4096.
    assert gate.capacity(0) == 4096
    assert gate.may_sample(4095, 0) and not gate.may_sample(4096, 0)
    # learner at v7, consumed 7,500 (trained + dropped; > 7 * 1024 = 7,168): base 7,500,
    # segments open below 7,500 + 3,072 = 10,572
    assert _opens(gate, 10_571, 7, 7_500, 7) and not _opens(gate, 10_572, 7, 7_500, 7)
    # a sampler still acting with v6 (one version spent already): reach 2 * 1024
    assert gate.reach(7, 6) == 2048 and not _opens(gate, 9_548, 7, 7_500, 6)


def test_room_counts_only_the_steps_outside_the_segment():
    """chaos numbers (max_staleness 2, batches of 256): an open segment of 10 steps made by
    v4, learner at v4 having consumed 1,100: 1,100 + 768 - (1,500 - 10) - 1 = 377 more steps
    may reach the learner before it; made by v3, 256 fewer; by v1, it is beyond saving."""
    gate = StalenessGate(max_staleness=2, steps_per_version=256, in_flight=8 * 16)
    assert gate.room(1_500, 4, 1_100, OpenSegment(4, 10, 6, 0)) == 377
    assert gate.room(1_500, 4, 1_100, OpenSegment(3, 10, 6, 0)) == 121
    assert gate.room(1_500, 4, 1_100, OpenSegment(1, 10, 6, 0)) < 0


def test_older_segments_go_first_and_a_lost_one_holds_nobody_back():
    """Three open segments (orders 0, 1, 2), max_staleness 0, batches of 100: a step of a
    younger slot may take only what an older segment's room leaves after the steps the
    segments older than it may still take (its reserve); older slots' steps are in that
    reserve already, so they go on."""
    gate = StalenessGate(max_staleness=0, steps_per_version=100)
    # reach(0, 0) = 100; steps out n = 95
    oldest = OpenSegment(0, 5, 3, 0)     # room 100 - 90 - 1 = 9
    middle = OpenSegment(0, 2, 6, 1)     # room 100 - 93 - 1 = 6; reserve 3 (oldest) -> 3
    youngest = OpenSegment(0, 1, 7, 2)   # room 100 - 94 - 1 = 5; reserve 9 -> -4
    segments = [oldest, middle, youngest]
    # the youngest's step eats the middle one's free room (room 6 - reserve 3 >= 1): allowed
    assert gate.may_step(95, 0, 0, 0, youngest, segments)
    # 3 more steps out elsewhere: the middle one's room 3 is all reserve: the youngest waits
    assert not gate.may_step(98, 0, 0, 0, youngest, segments)
    # ... while the oldest and the middle one go on (their steps are in the reserves)
    assert gate.may_step(98, 0, 0, 0, oldest, segments)
    assert gate.may_step(98, 0, 0, 0, middle, segments)
    # a segment beyond saving (made by a version the learner is past) holds nobody back
    lost = OpenSegment(-1, 1, 7, 0)
    assert gate.may_step(98, 0, 0, 0, youngest, [lost, youngest])


def test_the_loop_stays_live():
    """max_staleness 0 in async mode, batches of 256: with nothing open, a segment may open
    while fewer than 256 steps are out; so when every slot waits to open one, at least a
    batch sits in closed segments and the learner can publish its next version."""
    gate = StalenessGate(max_staleness=0, steps_per_version=256, in_flight=128)
    assert _opens(gate, 255, 0, 0, 0) and not _opens(gate, 256, 0, 0, 0)


def test_pacing_shares_between_replicas():
    """2 samplers, batches of 256, max_staleness 2: each opens below (base + reach) // 2."""
    gate = StalenessGate(max_staleness=2, steps_per_version=256, in_flight=128, replicas=2)
    assert _opens(gate, 383, 0, 0, 0) and not _opens(gate, 384, 0, 0, 0)
    # consumed 1,001: (1,001 + 768) // 2 = 884: both together stay below 1,769
    assert _opens(gate, 883, 3, 1_001, 3) and not _opens(gate, 884, 3, 1_001, 3)


@pytest.mark.parametrize("max_staleness,batch,slots,seg", [
    (0, 1, 1, 1), (2, 1024, 32, 32), (2, 256, 8, 16), (1, 100, 10, 20), (5, 64, 4, 8)])
def test_segments_open_inside_the_cap(max_staleness, batch, slots, seg):
    """Wherever a segment may open, every step is under the cap."""
    for replicas in (1, 3):
        gate = StalenessGate(max_staleness, batch, slots * seg, replicas)
        for v, c, s in [(0, 0, 0), (5, 4_000, 5), (5, 4_000, 5 - max_staleness)]:
            for n in range(0, 12_000, 7):
                if _opens(gate, n, v, c, s):
                    assert gate.may_sample(n, v, c)


def simulate(gate: StalenessGate, *, slots: int, segment_steps: int, lag_ticks: int,
             train_ticks: int, ticks: int, paced: bool = True, seed: int = 0) -> dict:
    """The loop in lockstep ticks, slow and plain: each tick every slot takes one step if
    the gate admits it (when ``paced``: ``may_step`` over the slots' open segments, as the
    sampler has it; else ``may_sample`` alone, the rule before pacing);
    segments close at ``segment_steps`` or at the episode's end (20..60 steps) and reach
    the learner ``lag_ticks`` later (segmenter + arbiter); the learner refuses a segment
    whose first step is more than max_staleness versions old, and an update of a batch
    of >= steps_per_version steps takes ``train_ticks`` (arrivals wait meanwhile). The
    sampler sees the learner's version and consumed count at once."""
    rng = random.Random(seed)
    n = version = consumed = 0
    open_len = [0] * slots  # steps in each slot's open segment
    first = [0] * slots  # version of its first step
    order = [0] * slots  # when it opened (ties between equally urgent segments)
    left = [rng.randint(20, 60) for _ in range(slots)]  # steps left in each episode
    arriving: list[tuple[int, int, int]] = []  # (tick, steps, first version)
    buffered = batch = dropped = 0
    busy_until = -1
    for t in range(ticks):
        for i in range(slots):
            opens = open_len[i] == 0
            admitted = gate.may_sample(n, version, consumed)
            if paced and admitted:
                segments = {j: OpenSegment(first[j], open_len[j], segment_steps - open_len[j],
                                           order[j]) for j in range(slots) if open_len[j]}
                admitted = gate.may_step(n, version, consumed, version, segments.get(i),
                                         list(segments.values()))
            if not admitted:
                continue
            n += 1
            if opens:
                first[i], order[i] = version, n
            open_len[i] += 1
            left[i] -= 1
            if open_len[i] == segment_steps or left[i] == 0:
                arriving.append((t + lag_ticks, open_len[i], first[i]))
                open_len[i] = 0
                left[i] = left[i] or rng.randint(20, 60)
        if busy_until == t:
            version, consumed, busy_until = version + 1, consumed + batch, -1
        while busy_until < 0 and arriving and arriving[0][0] <= t:
            _, steps, made_by = arriving.pop(0)
            if gate.is_stale(made_by, version):
                dropped += steps
                consumed += steps
            else:
                buffered += steps
                if buffered >= gate.steps_per_version:
                    batch, buffered, busy_until = buffered, 0, t + train_ticks
    return {"versions": version, "dropped": dropped, "sampled": n}


@pytest.mark.parametrize("lag_ticks", [0, 5, 20])
@pytest.mark.parametrize("train_ticks", [5, 40, 80])
def test_paced_segments_arrive_within_the_bound_without_slowing_the_learner(lag_ticks,
                                                                            train_ticks):
    """The chaos numbers (8 slots, segments of 16, batches of 256, max_staleness 2) with a
    learner as fast as the sampler (5 ticks per update of ~256 steps, 8 steps a tick) and
    slower (40, 80 ticks: the gate binds). Paced: nothing is dropped and the learner makes
    as many versions as without pacing (within one), so the work that used to be dropped
    was never needed. Unpaced, a slow learner drops a sixth of the work (checked below, so
    this test can tell the two rules apart)."""
    gate = StalenessGate(max_staleness=2, steps_per_version=256, in_flight=8 * 16)
    setting = dict(slots=8, segment_steps=16, lag_ticks=lag_ticks, train_ticks=train_ticks,
                   ticks=4000)
    paced = simulate(gate, **setting)
    unpaced = simulate(gate, **setting, paced=False)
    assert paced["dropped"] == 0
    assert paced["versions"] >= unpaced["versions"] - 1
    if train_ticks >= 40:  # the learner is the bottleneck: without pacing, work is wasted
        assert unpaced["dropped"] > 0.1 * unpaced["sampled"]
        assert paced["sampled"] < unpaced["sampled"]


@pytest.mark.parametrize("segment_steps", [8, 20, 64])
@pytest.mark.parametrize("train_ticks", [80, 200])
def test_an_llm_shaped_loop_keeps_what_it_samples(segment_steps, train_ticks):
    """An LLM run's numbers: 8 slots, batches of only 32 steps, max_staleness 2, segments
    as long as an episode (8-64 steps), and an update that takes minutes while a round of
    acting takes seconds (80-200 rounds). A segment then outlives several versions of a
    learner that keeps up, and the estimate H = 8 * segment_steps exceeds the whole reach
    (3 * 32), so pacing by H alone let a third to three quarters of the work be dropped
    (Run F's rerun: 44% of its segments). Paced by the open segments' own room, nothing is
    dropped and the learner makes as many versions. (With a learner as fast as the sampler
    and 64-step segments, the reserve for open segments' worst case holds slots back: the
    paced learner then makes about two thirds of the versions, all on fresh work.)"""
    gate = StalenessGate(max_staleness=2, steps_per_version=32, in_flight=8 * segment_steps)
    setting = dict(slots=8, segment_steps=segment_steps, lag_ticks=5, train_ticks=train_ticks,
                   ticks=3000)
    paced = simulate(gate, **setting)
    unpaced = simulate(gate, **setting, paced=False)
    assert paced["dropped"] == 0
    assert paced["versions"] >= unpaced["versions"] - 1
    assert unpaced["dropped"] > 0.25 * unpaced["sampled"]
