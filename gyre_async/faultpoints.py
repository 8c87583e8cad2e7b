"""Named pause points inside multi-step writes, for fault injection (``ops/chaos.py``).

A SIGKILL at a random moment rarely lands inside a write that takes a millisecond, so the
chaos run could not show that a process killed *mid-write* leaves nothing half-written
visible. These points make that moment wide enough to hit, honestly: the process really
is inside the write (Zarr rows written, index page not yet; checkpoint temp file written,
not yet renamed into place) when the kill arrives.

Off unless ``GYRE_FAULT_POINTS`` names the point (comma-separated). When on, with
probability ``GYRE_FAULT_PROB`` (default 1) the writer creates the marker file
``$GYRE_FAULT_DIR/<point>.<pid>``, sleeps ``GYRE_FAULT_PAUSE_S`` (default 0.5 s) and removes
the marker. ``ops/chaos.py`` waits for a marker with the target's PID and SIGKILLs it then.
Points: ``segment-write`` (``SegmentStore.write_many``), ``checkpoint-save``
(``CheckpointStore.save``). The cost when off: one dictionary lookup.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

ENV_POINTS = "GYRE_FAULT_POINTS"
ENV_DIR = "GYRE_FAULT_DIR"
ENV_PAUSE = "GYRE_FAULT_PAUSE_S"
ENV_PROB = "GYRE_FAULT_PROB"


def pause_point(name: str) -> None:
    """Pause here (marker file up) if fault injection is on for ``name``; else return."""
    points = os.environ.get(ENV_POINTS)
    if not points or name not in points.split(","):
        return
    if random.random() >= float(os.environ.get(ENV_PROB, "1")):
        return
    marker = Path(os.environ.get(ENV_DIR, ".")) / f"{name}.{os.getpid()}"
    marker.write_text(f"{time.time()}\n")
    try:
        time.sleep(float(os.environ.get(ENV_PAUSE, "0.5")))
    finally:
        marker.unlink(missing_ok=True)
