"""The chaos run, short: every core role SIGKILLed once (the segmenter inside a Zarr write,
the learner inside a checkpoint save), restarted by ``gyre launch``, then audited.

The full run (>= 20 kills, embedded and Kafka) is ``python ops/chaos.py``; see
docs/RELIABILITY.md for its figures. This variant also stands in for a plain
one-process-per-role run on the embedded bus: it checks the same invariants, and more.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # minutes, not seconds: the full tier only

ROOT = Path(__file__).resolve().parents[1]


def test_chaos_short_embedded(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "ops" / "chaos.py"), "--bus", "embedded", "--kills", "4",
         "--min-gap", "0.3", "--max-gap", "1", "--settle-versions", "1", "--pause", "0.2",
         "--pause-prob", "1", "--batch-steps", "96", "--seed", "3",
         # a restarted sampler continues its open episodes instead of ending them: when it
         # restarts at the staleness gate it publishes nothing until the learner moves on,
         # so the segmenter's next write (where its kill is aimed) can take longer than 30 s
         "--aim-timeout", "120", "--work-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=500, check=False)
    assert out.stdout.strip(), out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert out.returncode == 0, (result, out.stderr[-4000:])
    assert result["bench"] == "chaos" and result["error"] is None
    assert result["kills"] == 4 and all(n == 1 for n in result["kills_by_role"].values())
    assert result["kills_mid_segment_write"] == 1 and result["kills_mid_checkpoint"] == 1
    assert (result["lost"], result["duplicated"], result["corrupt"], result["order"]) == (0, 0, 0, 0)
    assert result["progress"] >= 1 and result["trained_segments"] > 0
    assert 0.0 <= result["stale_dropped_fraction"] < 1.0  # reported (ops/chaos.py, pacing)
    assert result["restarts"] == {"sampler": 1, "segmenter": 1, "arbiter": 1, "learner": 1}
