"""``gyre run > run.log``: the progress display writes plain lines to a file while the run
goes (rich's live line only on a terminal), and the run ends without a traceback."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gyre_async.folds.run_fold import RunFold
from gyre_async.ui.progress import Progress

ROOT = Path(__file__).resolve().parents[1]
LINE = re.compile(r"^\[\s*\d+s\] v-?\d+\s+episodes \d+.* steps (\d+)\s", re.M)


@pytest.mark.slow  # an end-to-end run: the full tier (the fast tier stays under 3 minutes)
def test_gyre_run_redirected_to_a_file_prints_progress_lines_while_it_runs(tiny, tmp_path):
    cfg = tiny.write(learner={"max_versions": 6})
    log_path = tmp_path / "run.log"
    with open(log_path, "w") as log, open(tmp_path / "err.log", "w") as err:
        run = subprocess.Popen([sys.executable, "-m", "gyre_async.cli", "run", str(cfg)],
                               cwd=ROOT, stdout=log, stderr=err)
        seen_while_running: list[str] = []
        deadline = time.monotonic() + 240
        while run.poll() is None and time.monotonic() < deadline:
            seen_while_running = LINE.findall(log_path.read_text())
            time.sleep(0.5)
        assert run.wait(timeout=30) == 0, (tmp_path / "err.log").read_text()[-3000:]
    assert seen_while_running, "no progress line while the run went"
    text = log_path.read_text()
    steps = [int(s) for s in LINE.findall(text)]
    assert len(steps) >= 2 and steps == sorted(steps) and steps[-1] > 0, text
    assert "\x1b[" not in text  # no terminal control codes in a file
    summary = json.loads(text[text.index("\n{") + 1:])  # the summary follows the lines
    assert summary["final"] is not None
    assert "Traceback" not in (tmp_path / "err.log").read_text()
    assert (tiny.tmp_path / "run" / "summary.json").exists()


def test_plain_lines_come_every_few_seconds_and_once_at_the_end():
    out = io.StringIO()
    progress = Progress("r", out=out, every_s=3600.0)
    progress.start()
    fold = RunFold("r", keep_records=False)
    for _ in range(5):
        progress.show(fold)  # the first at once, the others within the interval: skipped
    progress.stop()
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and all(LINE.match(line + " ") for line in lines), lines
