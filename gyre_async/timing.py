"""Where time goes: busy seconds per category (bus, codec, storage, policy, env, learner).

The runtime and the actors add to these counters around the work itself (SQLite calls,
encode/decode, store I/O, policy forward passes, env steps, PPO updates), never around
idle waits, so ``framework_share`` = (bus + codec + storage) / all busy time says how much
of the work is the framework's own overhead. Read by heartbeats and ``ops/bench/overhead.py``.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import contextmanager

FRAMEWORK = ("bus", "codec", "storage")
WORK = ("policy", "env", "learner")

_lock = threading.Lock()
_seconds: defaultdict[str, float] = defaultdict(float)


def add(category: str, seconds: float) -> None:
    with _lock:
        _seconds[category] += seconds


@contextmanager
def timed(category: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        add(category, time.perf_counter() - start)


def snapshot() -> dict[str, float]:
    with _lock:
        return dict(_seconds)


def reset() -> None:
    with _lock:
        _seconds.clear()


def framework_share(seconds: dict[str, float] | None = None) -> float:
    s = seconds if seconds is not None else snapshot()
    framework = sum(s.get(k, 0.0) for k in FRAMEWORK)
    total = framework + sum(s.get(k, 0.0) for k in WORK)
    return framework / total if total else 0.0
