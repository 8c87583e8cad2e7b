"""What a new user meets on a fresh clone: the README's commands, a run's recorded config,
TensorBoard files, and the install scripts' own checks.

One tiny run (module fixture) at ``<tmp>/runs/q`` stands in for the README's ``runs/q``; the
README's replay commands are read out of README.md and run as written from ``<tmp>``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TinyConfig

from gyre_async.config import load_config
from gyre_async.errors import ConfigError
from gyre_async.runtime.loop import run_loop
from gyre_async.ui.run_outputs import write_run_outputs
from gyre_async.ui.tensorboard import write_tensorboard

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def readme_run(tmp_path_factory):
    """A finished tiny run at <home>/runs/q; returns (home, run_dir, the config it ran with)."""
    home = tmp_path_factory.mktemp("home")
    run_dir = home / "runs" / "q"
    cfg = TinyConfig(home).config(run={"run_dir": str(run_dir)}, learner={"max_versions": 2})
    write_run_outputs(cfg, asyncio.run(run_loop(cfg)))
    return home, run_dir, cfg


def readme_commands(prefix: str) -> list[list[str]]:
    """The README's shell examples that start with ``prefix``, continuations joined,
    trailing comments dropped, split into argv."""
    text = ROOT.joinpath("README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.S)
    joined = "\n".join(blocks).replace("\\\n", " ")
    return [shlex.split(line, comments=True) for line in joined.splitlines()
            if line.startswith(prefix)]


# --- a run's config.json is a config -------------------------------------------------------

@pytest.mark.slow  # an end-to-end run: the full tier (the fast tier stays under 3 minutes)
def test_recorded_config_json_loads_back_to_the_config_the_run_used(readme_run):
    _, run_dir, cfg = readme_run
    assert load_config(run_dir / "config.json") == cfg


@pytest.mark.parametrize("toml_text, json_value, expected", [
    ('[learner]\nbatch_stepz = 3\n', {"learner": {"batch_stepz": 3}}, "batch_stepz"),
    ('[learner]\nbatch_steps = "many"\n', {"learner": {"batch_steps": "many"}},
     "learner.batch_steps"),
    ('[bus]\npartitions = 0\n', {"bus": {"partitions": 0}},
     "bus.partitions = 0 is out of bounds: it must be >= 1"),
])
def test_json_and_toml_configs_fail_with_the_same_message(tmp_path, toml_text, json_value,
                                                          expected):
    messages = []
    for name, content in (("c.toml", toml_text), ("c.json", json.dumps(json_value))):
        path = tmp_path / name
        path.write_text(content)
        with pytest.raises(ConfigError) as err:
            load_config(path)
        messages.append(str(err.value).replace(str(path), "FILE"))
    assert messages[0] == messages[1]
    assert expected in messages[0] and messages[0].startswith("FILE")


def test_undecodable_json_config_is_named_as_json(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"learner": ')
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(path)


# --- the README's replay examples, as written ----------------------------------------------

@pytest.mark.slow  # an end-to-end run: the full tier (the fast tier stays under 3 minutes)
def test_readme_replay_examples_run_as_written_with_zero_differences(readme_run):
    home, _, _ = readme_run
    commands = readme_commands("gyre replay ")
    assert {argv[2] for argv in commands} >= {"arbiter", "learner"}, commands
    for argv in commands:
        assert "..." not in argv, f"placeholder in the README: {argv}"
        out = subprocess.run([sys.executable, "-m", "gyre_async.cli", *argv[1:], "--json"],
                             cwd=home, capture_output=True, text=True, timeout=300,
                             env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert out.returncode == 0, f"{shlex.join(argv)}\n{out.stdout}{out.stderr}"
        report = json.loads(out.stdout)
        assert report["differences"] == 0 and report["recorded_outputs"] > 0, report


def test_readme_config_files_exist():
    """Every config file a README example names is in the repository or written by a run."""
    text = ROOT.joinpath("README.md").read_text()
    blocks = "\n".join(re.findall(r"```bash\n(.*?)```", text, flags=re.S))
    named = set(re.findall(r"(\S+\.(?:toml|json))\b", blocks))
    assert named, "no config named in the README's examples"
    for name in named:
        assert (ROOT / name).exists() or re.fullmatch(r"runs/\w+/config\.json", name), name


# --- TensorBoard ---------------------------------------------------------------------------

def test_tensorboard_scalars_match_metrics_jsonl(readme_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run_dir, _ = readme_run
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    expected: dict[str, list[tuple[int, float, float]]] = {}
    for row in rows:
        for name, value in row.items():
            if name not in ("kind", "version", "ts", "reason") and isinstance(value, (int, float)):
                expected.setdefault(name, []).append((row["version"], float(value), row["ts"]))
    assert {"eval/success_rate", "charts/env_steps_trained"} <= set(expected)
    assert any(name.startswith("losses/") for name in expected)

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(expected)
    for name, points in expected.items():
        got = [(s.step, s.value, s.wall_time) for s in events.Scalars(name)]
        assert [step for step, _, _ in got] == [step for step, _, _ in points], name
        for (_, value, wall), (_, want, ts) in zip(got, points):
            assert value == pytest.approx(want, rel=1e-6) or (math.isnan(value) and math.isnan(want)), name
            assert wall == pytest.approx(ts, abs=1e-3), name


def test_tensorboard_rewrite_replaces_its_own_file_only(tmp_path):
    other = tmp_path / "events.out.tfevents.1.someone-else"
    other.write_bytes(b"")
    rows = [{"kind": "eval", "version": 3, "ts": 1.0e9, "eval/success_rate": 0.5}]
    first = write_tensorboard(rows, str(tmp_path))
    second = write_tensorboard(rows, str(tmp_path))
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == sorted([other.name, Path(second).name]), files
    assert not Path(first).exists() or first == second


# --- install scripts -----------------------------------------------------------------------

SCRIPTS = ["ops/install.sh", "ops/test.sh", "ops/quickstart.sh", "ops/install_chromium.sh",
           ".ci/run"]


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_parses(script):
    out = subprocess.run(["bash", "-n", str(ROOT / script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_install_chromium_is_a_no_op_when_the_browser_is_there():
    out = subprocess.run(["bash", str(ROOT / "ops/install_chromium.sh")], capture_output=True,
                         text=True, timeout=10, env={**os.environ, "GYRE_CHROMIUM": "/bin/true"})
    assert out.returncode == 0 and out.stdout == "", out.stdout + out.stderr


def test_install_chromium_refuses_a_custom_path_it_cannot_install():
    out = subprocess.run(["bash", str(ROOT / "ops/install_chromium.sh")], capture_output=True,
                         text=True, timeout=10,
                         env={**os.environ, "GYRE_CHROMIUM": "/nonexistent/chromium"})
    assert out.returncode == 1 and "GYRE_CHROMIUM" in out.stderr


def test_install_refuses_unknown_options_before_installing(tmp_path):
    out = subprocess.run(["bash", str(ROOT / "ops/install.sh"), "--tests"], capture_output=True,
                         text=True, timeout=10, env={**os.environ, "GYRE_VENV": str(tmp_path / "v")})
    assert out.returncode == 2 and "usage" in out.stderr
    assert not (tmp_path / "v").exists()
