"""The guides under docs/ run as written: their code blocks, in order, in a fresh directory.

Conventions (what a reader would do by hand):

- a fenced block (```python or ```toml) whose first line is ``# file: NAME`` is saved as
  ``NAME`` in the working directory (a module to import, a config to load); a TOML file
  must also load as a Gyre config;
- every other ```python block runs in order, in one namespace per guide (as in a
  notebook), with the working directory importable;
- ```bash blocks are shown, not run (their Python equivalents are in the guide).
"""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest

from gyre_async.config import load_config

ROOT = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^```(python|toml)\n(.*?)^```", re.DOTALL | re.MULTILINE)
FILE = re.compile(r"#\s*file:\s*(\S+)")


def blocks(guide: str) -> list[tuple[str, str, str | None]]:
    """(language, code, file name or None) of every python/toml block of ``guide``."""
    out = []
    for language, code in BLOCK.findall((ROOT / "docs" / guide).read_text()):
        first = code.splitlines()[0] if code.strip() else ""
        named = FILE.fullmatch(first.strip())
        out.append((language, code, named.group(1) if named else None))
    return out


def run_guide(guide: str, workdir: Path, monkeypatch) -> dict:
    """Save and run ``guide``'s blocks in ``workdir``; returns the namespace it ran in."""
    monkeypatch.chdir(workdir)
    monkeypatch.syspath_prepend(str(workdir))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(workdir)]))
    (workdir / "ops").symlink_to(ROOT / "ops")  # guides call ops/ scripts from the checkout root
    namespace: dict = {"__name__": f"guide_{guide.removesuffix('.md').replace('-', '_')}"}
    ran = 0
    for language, code, name in blocks(guide):
        if name is not None:
            (workdir / name).write_text(code)
            if language == "toml":
                load_config(workdir / name)
            continue
        assert language == "python", f"{guide}: a toml block needs a '# file:' line"
        exec(compile(code, f"{guide}:block{ran}", "exec"), namespace)
        ran += 1
    assert ran, f"{guide} has no code to run"
    return namespace


@pytest.fixture
def fresh_modules(tmp_path):
    """Modules a guide writes (my_env, my_rewards) are forgotten after its test."""
    yield
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


@pytest.mark.slow  # an end-to-end run: the full tier (the fast tier stays under 3 minutes)
def test_guide_environment(tmp_path, monkeypatch, fresh_modules):
    ns = run_guide("guide-environment.md", tmp_path, monkeypatch)
    assert ns["summary"]["policy_versions"] >= 3
    assert (tmp_path / "runs" / "buttons" / "summary.json").exists()


def test_guide_reward(tmp_path, monkeypatch, fresh_modules):
    ns = run_guide("guide-reward.md", tmp_path, monkeypatch)
    assert ns["good"].decided_by != "guard" and ns["good"].total > 0
    assert any("violet" in reason for reason in ns["bad"].guard_reasons)


@pytest.mark.slow
def test_guide_hf_model(tmp_path, monkeypatch, fresh_modules):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # nothing may be downloaded
    ns = run_guide("guide-hf-model.md", tmp_path, monkeypatch)
    assert ns["action"].tokens and ns["out"].values.shape == (1,)


@pytest.mark.slow
@pytest.mark.kafka
def test_guide_kafka(tmp_path, monkeypatch, fresh_modules, noida):
    monkeypatch.setenv("GYRE_BUS", f"kafka://{noida}")
    ns = run_guide("guide-kafka.md", tmp_path, monkeypatch)
    assert ns["summary"]["policy_versions"] >= 2
