"""The direction of imports between subpackages (DESIGN.md, "Layout"), read with ``ast``.

schemas <- bus, storage, envs, policy, rl <- folds, core <- actors, runtime <- audit, ui,
offline <- cli; no cycle between subpackages; nothing in ``gyre_async/`` imports ``actors/``;
``policy/`` never imports ``envs/``. Every import counts, those inside functions and under
``TYPE_CHECKING`` included.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The rank of each unit (a subpackage of gyre_async, a top-level module of it, or one of the
# packages beside it); an arrow may point to a lower rank, or within a rank, never upward.
# The foundations DESIGN.md names beside the subpackages (config, errors, imports, timing,
# the composition root) sit with the lowest layer they need; rewards/ and experience/ with
# the subpackages below core/, which uses them.
RANK = {
    "schemas": 0,
    "errors": 1, "timing": 1, "faultpoints": 1, "imports": 1, "config_fields": 1,
    "bus": 2, "storage": 2, "envs": 2, "policy": 2, "rl": 2, "rewards": 2, "experience": 2,
    "config": 2, "compose": 2,
    "folds": 3, "core": 3,
    "actors": 4, "runtime": 4,
    "audit": 5, "ui": 5, "offline": 5,
    "cli": 6,
    "__init__": 7,
}

# Arrows forbidden even within a rank or from above; nothing imports ``actors/`` (the
# topology and the launcher name actor classes by dotted path).
FORBIDDEN = {("policy", "envs")} | {(unit, "actors") for unit in RANK}

# Known arrows against the layering, each with why it still stands. Remove an entry when its
# arrow goes; the test fails on any arrow not listed here.
KNOWN: dict[tuple[str, str], str] = {}


def _unit(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "gyre_async":
        return parts[1] if len(parts) > 1 else "__init__"
    if parts[0] in ("schemas", "actors"):
        return parts[0]
    return None


def _module_of(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """The modules ``path`` imports, relative imports resolved."""
    module = _module_of(path)
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[:len(package) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)  # from pkg import mod
    return found


def arrows() -> dict[tuple[str, str], set[str]]:
    """Each arrow between units, with the files that draw it."""
    files = sorted(ROOT.glob("gyre_async/**/*.py")) + sorted(ROOT.glob("actors/*.py")) \
        + sorted(ROOT.glob("schemas/**/*.py"))
    found: dict[tuple[str, str], set[str]] = {}
    for path in files:
        me = _unit(_module_of(path))
        assert me is not None
        for module in _imports(path):
            other = _unit(module)
            if other is not None and other != me and (other != "__init__" or module == "gyre_async"):
                found.setdefault((me, other), set()).add(str(path.relative_to(ROOT)))
    # ``from gyre_async import x`` names a subpackage, not the package's __init__
    return {arrow: where for arrow, where in found.items() if arrow[1] != "__init__"}


def _violations(edges: dict[tuple[str, str], set[str]]) -> list[str]:
    bad = []
    for (src, dst), where in sorted(edges.items()):
        assert src in RANK and dst in RANK, f"unit {src or dst} has no rank: add it to RANK"
        if (RANK[dst] > RANK[src] or (src, dst) in FORBIDDEN) and (src, dst) not in KNOWN:
            bad.append(f"{src} -> {dst} ({', '.join(sorted(where))})")
    return bad


def _cycle(edges: set[tuple[str, str]]) -> list[str] | None:
    graph: dict[str, set[str]] = {}
    for src, dst in edges:
        graph.setdefault(src, set()).add(dst)
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_arrow_against_the_layering():
    assert _violations(arrows()) == []


def test_no_cycle_between_subpackages():
    cycle = _cycle(set(arrows()) - set(KNOWN))  # a known exception closes its own cycle
    assert cycle is None, " -> ".join(cycle or [])


def test_the_check_sees_what_it_should():
    """The checker reports an upward arrow, a forbidden one and a cycle."""
    assert _violations({("folds", "runtime"): {"x.py"}}) == ["folds -> runtime (x.py)"]
    assert _violations({("policy", "envs"): {"p.py"}}) == ["policy -> envs (p.py)"]
    assert _violations({("runtime", "actors"): {"r.py"}}) == ["runtime -> actors (r.py)"]
    assert _violations({("actors", "runtime"): {"a.py"}}) == []
    assert _cycle({("audit", "runtime"), ("runtime", "audit")}) in (
        ["audit", "runtime", "audit"], ["runtime", "audit", "runtime"])
    assert _violations({("cli", "actors"): {"c.py"}}) == ["cli -> actors (c.py)"]
