"""The overlap bound of ``ops/bench/async_vs_sync.py``, on made-up phase times.

The bench's figures are only as good as its arithmetic: per-round phases from the event
log's timestamps, the bound, and the ratio taken against sync's rate in the same rounds.
"""

from __future__ import annotations

import pytest
from conftest import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("ops/bench/async_vs_sync.py")


def rounds_log(sample: list[float], learn: list[float], slot_ends: list[list[float]]):
    """published / steps / counts as read back from a sync run: round v samples from the
    publication of v for ``sample[v]`` s (slot i ends at t0 + slot_ends[v][i]), then learns
    for ``learn[v]`` s."""
    published, steps, counts, t = {}, {}, {}, 100.0
    for v, (ts, tl, ends) in enumerate(zip(sample, learn, slot_ends)):
        published[v] = t
        assert max(ends) == ts
        steps[v] = {f"slot{i}": t + e for i, e in enumerate(ends)}
        counts[v] = 64 * len(ends)
        t += ts + tl
    published[len(sample)] = t
    return published, steps, counts


def test_phases_skip_round_zero_and_average_the_rest(bench):
    published, steps, counts = rounds_log(
        sample=[40.0, 30.0, 20.0], learn=[9.0, 6.0, 4.0],
        slot_ends=[[40.0, 10.0], [30.0, 20.0], [20.0, 10.0]])
    got = bench.phases(published, steps, counts)
    assert got["rounds"] == 2  # round 0 (it also pays the initial validation) left out
    assert got["T_sample_s"] == pytest.approx(25.0)
    assert got["T_learn_s"] == pytest.approx(5.0)
    assert got["T_sample_busy_s"] == pytest.approx((25.0 + 15.0) / 2)
    # the same rounds' steps over their whole periods: 256 steps in 36 + 24 s
    assert got["rounds_steps_per_s"] == pytest.approx(256 / 60.0)


def test_achieved_over_bound_is_async_rate_over_the_ideal_period(bench):
    published, steps, counts = rounds_log(
        sample=[30.0, 30.0, 30.0, 30.0], learn=[10.0, 10.0, 10.0, 10.0],
        slot_ends=[[30.0, 20.0]] * 4)
    sync = {"steps_per_s": 3.9, "versions": 5, "success": 0.0, "busy_s": {"learner": 30.0},
            "cpu_per_wall": 0.5, **bench.phases(published, steps, counts)}
    ideal = 128 / max(25.0, 10.0)  # steps per update over max(T_sample_busy, T_learn)
    asyn = {"steps_per_s": 0.9 * ideal, "versions": 9, "success": 0.0, "busy_s": {},
            "cpu_per_wall": 0.8}
    row = bench.compare(sync, asyn)
    assert row["bound"] == pytest.approx(40.0 / 25.0, abs=1e-3)
    assert row["bound_phases"] == pytest.approx(40.0 / 30.0, abs=1e-3)
    assert row["sync_rounds_steps_per_s"] == pytest.approx(128 / 40.0, abs=0.01)
    assert row["achieved_over_bound"] == pytest.approx(0.9, abs=1e-3)
    # the span-based ratio uses sync's whole-run rate instead (here a higher one)
    assert row["achieved_span_over_bound"] == pytest.approx(
        0.9 * ideal / 3.9 / (40.0 / 25.0), abs=1e-3)


def test_no_complete_round_gives_no_bound(bench):
    published, steps, counts = {0: 1.0}, {0: {"slot0": 2.0}}, {0: 64}
    sync = {"steps_per_s": 1.0, "versions": 1, "success": 0.0, "busy_s": {},
            "cpu_per_wall": 0.5, **bench.phases(published, steps, counts)}
    row = bench.compare(sync, {"steps_per_s": 2.0, "versions": 1, "success": 0.0,
                               "busy_s": {}, "cpu_per_wall": 0.5})
    assert row["bound"] is None and row["achieved_over_bound"] is None
