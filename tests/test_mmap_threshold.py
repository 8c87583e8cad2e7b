"""Role processes pin glibc's mmap threshold, so freed batch-sized blocks go back to the OS.

Without it, glibc raises the threshold each time a large block is freed. Later blocks of
that size come from the heap, where a small long-lived allocation pins them. This is how
the learner's RSS climbed from update to update (``ops/bench/memory.py``). The pattern below
(batch-sized arrays freed every round, one small object kept per round) is run in a fresh
interpreter with and without the pin.
"""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

PATTERN = """
import sys
import numpy as np
from gyre_async.runtime.process import pin_mmap_threshold
pinned = pin_mmap_threshold() if sys.argv[1] == "pin" else False

def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) // 1024 for l in f if l.startswith("VmRSS"))

rng = np.random.default_rng(0)
keep = []
before = rss_mb()
for _ in range(40):
    arrays = [np.ones(int(n) // 8) for n in rng.integers(5 << 20, 30 << 20, 4)]
    keep.append(np.ones(2000))  # small and long-lived: sits above the freed blocks
    del arrays
print(pinned, rss_mb() - before)
"""

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc" or sys.platform != "linux",
                                reason="glibc's malloc on Linux")


def retained_mb(mode: str) -> tuple[bool, int]:
    out = subprocess.run([sys.executable, "-c", PATTERN, mode], capture_output=True, text=True,
                         check=True, env={"PYTHONPATH": ".", "PATH": ""}, timeout=120)
    pinned, grown = out.stdout.split()
    return pinned == "True", int(grown)


def test_pinned_threshold_returns_freed_batch_blocks_and_the_default_does_not():
    pinned, grown_pinned = retained_mb("pin")
    _, grown_default = retained_mb("default")
    assert pinned
    assert grown_pinned < 8, grown_pinned
    assert grown_default > 20, grown_default  # the pattern does show the problem (~31 MB)
