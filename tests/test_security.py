"""Security checks: no unsafe deserialization in the code, no secrets in logs, size limits.

- A source scan (``ast``) over every package that runs in an actor or an ops script: nothing
  imports a pickle-family module, calls ``torch.load`` without ``weights_only=True``,
  ``numpy.load`` with ``allow_pickle``, an unsafe ``yaml`` loader, or ``eval``/``exec``.
  A self-check proves the scanner can fail.
- A Kafka bus built from a URL that carries a SASL password never shows the password: not in
  its repr or url, not in the error raised when the broker is unreachable, not in the logs.
- The embedded bus refuses an oversized event with ``MessageTooLarge``.
"""

from __future__ import annotations

import ast
import asyncio
import io
import logging
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("gyre_async", "actors", "schemas", "ops")

#: Modules whose import alone is a finding: they deserialize arbitrary objects.
BANNED_MODULES = frozenset({
    "pickle", "cPickle", "_pickle", "cloudpickle", "dill", "marshal", "shelve", "joblib",
    "jsonpickle",
})
#: Calls that are unsafe whatever their arguments.
BANNED_CALLS = frozenset({
    "eval", "exec", "builtins.eval", "builtins.exec",
    "yaml.unsafe_load", "yaml.unsafe_load_all", "yaml.full_load", "yaml.full_load_all",
    "pandas.read_pickle", "torch.serialization._legacy_load",
})
_SAFE_YAML_LOADERS = ("SafeLoader", "CSafeLoader", "BaseLoader", "CBaseLoader")


@dataclass(frozen=True)
class Finding:
    path: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.what}"


def _dotted(node: ast.AST) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


def _kw(call: ast.Call, name: str) -> ast.expr | None:
    for kw in call.keywords:
        if kw.arg == name:
            return kw.value
    return None


def _is_const(node: ast.expr | None, value: object) -> bool:
    return isinstance(node, ast.Constant) and node.value is value


def scan_source(source: str, path: str = "<string>") -> list[Finding]:
    """Unsafe-deserialization findings in one module's source (aliases resolved)."""
    tree = ast.parse(source, filename=path)
    aliases: dict[str, str] = {}  # local name -> fully qualified name
    found: list[Finding] = []

    def report(node: ast.AST, what: str) -> None:
        found.append(Finding(path, getattr(node, "lineno", 0), what))

    for node in ast.walk(tree):  # imports first, so aliases are known for every call
        if isinstance(node, ast.Import):
            for a in node.names:
                aliases[(a.asname or a.name).split(".")[0]] = (
                    a.name if a.asname else a.name.split(".")[0])
                if a.name.split(".")[0] in BANNED_MODULES:
                    report(node, f"import {a.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            root = node.module.split(".")[0]
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
                if root in BANNED_MODULES or a.name in BANNED_MODULES:
                    report(node, f"from {node.module} import {a.name}")

    def qualify(func: ast.expr) -> str | None:
        name = _dotted(func)
        if name is None:
            return None
        head, _, rest = name.partition(".")
        full = aliases.get(head, head)
        return f"{full}.{rest}" if rest else full

    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = qualify(node.func)
        if name is None:
            continue
        root = name.split(".")[0]
        if name in BANNED_CALLS:
            report(node, f"call {name}(...)")
        elif root in BANNED_MODULES:
            report(node, f"call {name}(...)")
        elif name in ("__import__", "importlib.import_module") and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and str(arg.value).split(".")[0] in BANNED_MODULES:
                report(node, f"dynamic import of {arg.value}")
        elif name in ("torch.load", "torch.serialization.load"):
            if not _is_const(_kw(node, "weights_only"), True):
                report(node, f"{name}(...) without weights_only=True")
        elif name in ("numpy.load", "numpy.lib.npyio.load"):
            allow = _kw(node, "allow_pickle")
            if allow is not None and not _is_const(allow, False):
                report(node, f"{name}(..., allow_pickle=...)")
        elif name in ("yaml.load", "yaml.load_all"):
            loader = _kw(node, "Loader")
            if loader is None and len(node.args) >= 2:
                loader = node.args[1]
            loader_name = _dotted(loader) if loader is not None else None
            if loader_name is None or loader_name.split(".")[-1] not in _SAFE_YAML_LOADERS:
                report(node, f"{name}(...) without a safe Loader")
    return found


def scan_tree(root: Path = ROOT, packages: tuple[str, ...] = SCANNED) -> list[Finding]:
    found: list[Finding] = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            if any(part in (".venv", "__pycache__") for part in path.parts):
                continue
            found += scan_source(path.read_text(), str(path.relative_to(root)))
    return found


def test_scanner_reports_unsafe_snippets():
    snippet = (
        "import pickle\n"
        "import torch\n"
        "import numpy as np\n"
        "import yaml\n"
        "from dill import loads as dl\n"
        "def f(path, data):\n"
        "    torch.load(path)\n"
        "    torch.load(path, weights_only=False)\n"
        "    torch.load(path, weights_only=True)\n"
        "    np.load(path, allow_pickle=True)\n"
        "    np.load(path)\n"
        "    yaml.load(data)\n"
        "    yaml.load(data, Loader=yaml.SafeLoader)\n"
        "    eval(data)\n"
        "    pickle.loads(data)\n"
        "    __import__('marshal')\n"
    )
    found = scan_source(snippet, "snippet.py")
    lines = {f.line for f in found}
    text = "\n".join(map(str, found))
    assert "snippet.py:1: import pickle" in text
    assert 7 in lines and 8 in lines and 9 not in lines  # torch.load w/o weights_only
    assert 10 in lines and 11 not in lines  # np.load(allow_pickle=True)
    assert 12 in lines and 13 not in lines  # yaml.load without SafeLoader
    assert {5, 14, 15, 16} <= lines  # dill import, eval, pickle.loads, __import__


def test_no_unsafe_deserialization_in_gyre():
    found = scan_tree()
    for f in found:
        print(f)
    assert not found, "unsafe deserialization:\n" + "\n".join(map(str, found))


# -- secrets --------------------------------------------------------------------------------

SECRET = "S3CRET-xyz"
SASL_URL = ("kafka://127.0.0.1:1?security_protocol=SASL_PLAINTEXT&sasl_mechanism=PLAIN"
            "&sasl_plain_username=u&sasl_plain_password=" + SECRET)


async def test_kafka_password_never_in_repr_errors_or_logs():
    import structlog

    from gyre_async.bus import BusError, open_bus
    from gyre_async.runtime.logs import configure_logging

    stream = io.StringIO()
    configure_logging("DEBUG", stream=stream)
    # pytest owns the root handlers (so basicConfig is a no-op): capture stdlib logs too,
    # aiokafka's included, at DEBUG.
    handler = logging.StreamHandler(stream)
    handler.setLevel(logging.DEBUG)
    root = logging.getLogger()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    try:
        bus = open_bus(SASL_URL, join_timeout=2)
        structlog.get_logger("test").info("bus.built", bus=repr(bus), url=bus.url)
        assert SECRET not in repr(bus)
        assert SECRET not in str(bus)
        assert SECRET not in bus.url
        with pytest.raises(BusError) as info:
            await asyncio.wait_for(bus.start(), timeout=30)
        exc = info.value
        structlog.get_logger("test").error("bus.failed", error=str(exc), exc_info=exc)
        chain = [exc]
        while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
            chain.append(chain[-1].__cause__ or chain[-1].__context__)
            if len(chain) > 10:
                break
        for e in chain:
            assert SECRET not in str(e), e
            assert SECRET not in repr(e), e
        await bus.close()
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
        structlog.reset_defaults()
    logs = stream.getvalue()
    assert logs, "nothing was logged: the capture is not wired"
    assert SECRET not in logs, [line for line in logs.splitlines() if SECRET in line]


# -- size limits ----------------------------------------------------------------------------

async def test_oversized_publish_raises_message_too_large(tmp_path):
    from gyre_async.bus import MessageTooLarge, open_bus
    from schemas import encode, event_id
    from schemas.events import Probe
    from schemas.topics import PROBE_IN

    async with open_bus(f"sqlite:///{tmp_path}/events.db", max_message_bytes=4096) as bus:
        await bus.create_topics([PROBE_IN], 1)
        small = Probe(event_id=event_id("p", 0), run_id="t", producer="test", seq=0)
        big = Probe(event_id=event_id("p", 1), run_id="t", producer="test", seq=1,
                    payload="x" * 5000)
        await bus.publish(PROBE_IN, [(b"k", encode(small))])
        with pytest.raises(MessageTooLarge):
            await bus.publish(PROBE_IN, [(b"k", encode(big))])
        with pytest.raises(MessageTooLarge):  # a batch with one oversized event fails whole
            await bus.publish(PROBE_IN, [(b"k", encode(small)), (b"k", encode(big))])
        total = sum(sum(t.end_offsets.values()) for t in await bus.topics())
    assert total == 1


def test_credentials_in_kafka_url_authority_are_refused_without_echo():
    import pytest

    from gyre_async.bus import open_bus

    with pytest.raises(ValueError) as info:
        open_bus("kafka://user:S3CRET-xyz@127.0.0.1:9092")
    assert "S3CRET-xyz" not in str(info.value) and "sasl_plain_password" in str(info.value)
