"""``gyre run``'s progress display: one line of live numbers from the run's fold.

The runtime folds the bus (:class:`~gyre_async.folds.run_fold.RunFold`) and hands the fold
to :meth:`Progress.show` as it grows; this module only draws it. On a terminal the line is
rich's live line, redrawn in place; written to a file or a pipe (``gyre run > run.log``) it
is a plain line every :data:`PLAIN_EVERY_S` seconds, flushed, so the log shows the run as it
goes instead of nothing until its end.
"""

from __future__ import annotations

import sys
import time
from typing import TYPE_CHECKING, TextIO

from gyre_async.folds.run_fold import RunFold

if TYPE_CHECKING:
    from rich.live import Live

#: seconds between two plain progress lines (output that is not a terminal)
PLAIN_EVERY_S = 5.0


def steps_per_s(rate: float) -> str:
    """A rate as the progress line shows it: whole steps from 10/s up, else two decimals (a
    language model's run makes less than one step per second, which read "0" before)."""
    return f"{rate:6.0f}" if rate >= 10 else f"{rate:6.2f}"


def progress_line(run: RunFold, elapsed: float) -> str:
    """Episodes, training success, env steps and their rate, staleness, the newest
    validation."""
    ev = run.newest_eval
    recent = run.train_success or 0.0
    steps = run.segment_env_steps
    return (f"[{elapsed:6.0f}s] v{run.max_version:<3d} episodes {run.counts.episodes:<5d} "
            f"train success(100) {recent:5.1%}  steps {steps:<7d} "
            f"{steps_per_s(steps / max(elapsed, 1e-9))} steps/s  staleness "
            f"{run.learner_staleness:.0f}  "
            + (f"val success {ev.success_rate:5.1%} (v{ev.policy_version})" if ev else ""))


class Progress:
    """The progress line on ``out`` (default stdout): live on a terminal, else plain lines."""

    def __init__(self, run_id: str | None = None, *, out: TextIO | None = None,
                 every_s: float = PLAIN_EVERY_S):
        self.out = out if out is not None else sys.stdout
        self.every_s = every_s
        self.started = time.monotonic()
        self.run = RunFold(run_id, keep_records=False)  # shown until the first fold arrives
        self._live: Live | None = None
        self._printed = float("-inf")

    def line(self) -> str:
        return progress_line(self.run, time.monotonic() - self.started)

    def start(self) -> None:
        self.started = time.monotonic()
        if self.out.isatty():
            from rich.console import Console
            from rich.live import Live

            self._live = Live(self.line(), console=Console(file=self.out), refresh_per_second=2)
            self._live.start()

    def show(self, run: RunFold) -> None:
        """The fold as it stands now: redraw the live line, or print a plain line when
        :attr:`every_s` has passed since the last."""
        self.run = run
        if self._live is not None:
            self._live.update(self.line())
            return
        now = time.monotonic()
        if now - self._printed >= self.every_s:
            self._printed = now
            self._print()

    def stop(self) -> None:
        """The last line, as the run ended."""
        if self._live is not None:
            self._live.update(self.line())
            self._live.stop()
            self._live = None
        else:
            self._print()

    def _print(self) -> None:
        self.out.write(self.line() + "\n")
        self.out.flush()
