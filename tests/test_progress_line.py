"""``gyre run``'s progress line: a language model's run makes less than a step per second,
which the line must show (it read "0 steps/s")."""

from __future__ import annotations

from gyre_async.ui.progress import steps_per_s


def test_the_progress_line_shows_slow_rates_with_decimals():
    assert steps_per_s(0.7).strip() == "0.70" and steps_per_s(9.994).strip() == "9.99"
    assert steps_per_s(1234.4).strip() == "1234"
