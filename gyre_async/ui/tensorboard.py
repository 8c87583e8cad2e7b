"""TensorBoard event files for a run, beside ``metrics.jsonl`` and folded from the same rows.

RL users open TensorBoard first, so a run directory is also a TensorBoard log directory:
``tensorboard --logdir runs`` lists each run by its directory name. The scalars are exactly
the numeric fields of ``metrics.jsonl`` (``gyre_async.folds.runlog.metrics_rows``), under the
same namespaced names (``charts/…``, ``losses/…``, ``eval/…``), so the two never disagree.

Choices and why:

- **step = policy version.** Every row of ``metrics.jsonl`` has one (an evaluation carries
  the version it evaluated), and it is the axis the learner, evaluator and keeper talk in.
  Trained env steps are a scalar of their own (``charts/env_steps_trained``); wall time is
  the event's own timestamp, so TensorBoard's "relative"/"wall" axes show real time. A
  rollback publishes a lower version again, which TensorBoard draws as a step back.
- **Rewritten whole, like ``metrics.jsonl``.** Both are derived from the event log at the end
  of ``gyre run``; a resumed run rewrites them from the whole log, so the previous file this
  module wrote (suffix ``.gyre``) is removed first rather than appended to (no duplicates).
- **The ``tensorboard`` package's own writer**, not torch's ``SummaryWriter``: the same file
  format without importing torch's wrapper; closed before returning, so the file is complete.
"""

from __future__ import annotations

import glob
import os
import time

FILE_SUFFIX = ".gyre"
"""Marks the event files this module writes (so a rewrite removes only its own)."""

ROW_FIELDS = frozenset({"kind", "version", "ts", "reason"})
"""Bookkeeping fields of a metrics row: the step, the wall time and labels, not scalars."""


def scalars_of(row: dict) -> dict[str, float]:
    """The row's scalars: every number except the bookkeeping fields (NaN stays NaN, as in
    metrics.jsonl: a diverged loss should show, not vanish)."""
    return {name: float(value) for name, value in row.items()
            if name not in ROW_FIELDS and isinstance(value, (int, float))
            and not isinstance(value, bool)}


def write_tensorboard(rows: list[dict], log_dir: str) -> str:
    """Write ``rows`` (metrics.jsonl's) as one TensorBoard event file in ``log_dir``; its path."""
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.summary.writer.event_file_writer import EventFileWriter

    os.makedirs(log_dir, exist_ok=True)
    for old in _own_event_files(log_dir):
        os.remove(old)
    writer = EventFileWriter(log_dir, filename_suffix=FILE_SUFFIX)
    try:
        for row in rows:
            values = [Summary.Value(tag=name, simple_value=value)
                      for name, value in scalars_of(row).items()]
            if values:
                writer.add_event(Event(wall_time=row.get("ts") or time.time(),
                                       step=int(row["version"]), summary=Summary(value=values)))
    finally:
        writer.close()
    (written,) = _own_event_files(log_dir)  # the old ones were removed above
    return written


def _own_event_files(log_dir: str) -> list[str]:
    return glob.glob(os.path.join(glob.escape(log_dir), f"events.out.tfevents.*{FILE_SUFFIX}"))
