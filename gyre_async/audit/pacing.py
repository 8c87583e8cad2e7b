"""Moved to :mod:`gyre_async.folds.pacing`: this name stays only until its last caller moves."""

from gyre_async.folds.pacing import stale_dropped_fraction, stale_dropped_steps  # noqa: F401
