"""The staleness admission rule, every expected number worked out in a comment."""

from __future__ import annotations

import pytest

from gyre_async.rl.staleness import StalenessGate


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
