"""Moved to :mod:`gyre_async.folds.final_lag`: this name stays only until its last caller moves."""

from gyre_async.folds.final_lag import final_lag, within_bound  # noqa: F401
