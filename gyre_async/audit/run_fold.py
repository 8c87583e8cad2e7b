"""Moved to :mod:`gyre_async.folds.run_fold`: this name stays only until its last caller moves."""

from gyre_async.folds.run_fold import STEP_WINDOW_S, RunFold  # noqa: F401
