"""``gyre launch``: one OS process per role, restarted when it crashes.

Why processes and not tasks: a role that segfaults, leaks, deadlocks its event loop or is
OOM-killed takes only itself down, and the others keep working from the bus (the bus is
the only thing roles share). Why restart here and not only in systemd/Kubernetes: on one
machine, or in a container running the whole loop, nothing else supervises the roles, and
a crashed role that nobody restarts stalls the loop silently (its input queues up on the
bus, the learner stops publishing versions, the sampler pauses on staleness).

Restarting is safe because of the actor runtime's contract (see ``gyre_async.runtime.actor``): a
role commits input offsets only after its outputs are durable and never past state it still
holds in memory, so a restarted process resumes from its group's committed offsets and
rebuilds the rest from its own output topics.

Behaviour:

- a child that exits with status 0 is done (e.g. ``learner.max_versions`` reached) and is
  not restarted; the launcher exits 0 once every role is done;
- a child that exits non-zero or by a signal is restarted after an exponential backoff
  (0.5 s, 1 s, 2 s, ... capped at 10 s; the exponent resets once a child has run 60 s),
  with a structlog JSON line (``launcher.restart``) and a short human line on stderr;
- a role restarted more than ``--max-restarts`` times in total makes the launcher stop the
  others and exit 1: a crash loop needs a human, and a restart storm hides it;
- SIGTERM/SIGINT are forwarded as SIGTERM (each actor finishes its batch, commits, leaves
  its group); after ``--stop-timeout`` the stragglers get SIGKILL. A second signal kills
  at once. On Linux each child also gets SIGTERM if the launcher itself dies (PDEATHSIG),
  so a ``kill -9`` of the launcher leaves no orphans holding group memberships;
- the bus URL reaches the roles without its secrets on their command lines (which any
  user of the machine can read in ``ps``): a password in ``--bus`` travels in each child's
  environment and the child's ``--bus`` names it as ``${GYRE_BUS_SASL_PLAIN_PASSWORD}``
  (:func:`gyre_async.bus.secrets.externalize`); a URL that already names its secrets
  (``${GYRE_KAFKA_PASSWORD}``) is passed as it is, the variable inherited. A Kafka bus is
  tried once before any role starts: an unreachable one is one line and exit status 1,
  not N crash-looping roles;
- ``--status-file`` is rewritten atomically on every change: role -> pid, restarts, state,
  last exit (for scripts, probes and tests that need a role's PID);
- ``--replicas sampler=4`` runs N processes of a role, named ``ROLE-0`` .. ``ROLE-(N-1)``
  (``gyre actor ROLE --replica I/N``), each supervised on its own. Samplers scale by
  environments (each replica its own seeds, ids, policy-version group and share of the
  staleness budget); ``--replicas learner=2`` runs a data-parallel learner (replica I is
  rank I of ``world_size`` N; rank 0 alone is on the bus). ``--replicas segmenter=N`` and
  ``arbiter=N`` split their input topic's partitions in the role's consumer group (each
  segmenter writes a segment store of its own; each folds the run's log, whoever wrote it,
  when partitions come to it, so a hand-over neither loses nor repeats work). The keeper and
  the evaluator hold the run's judgement and run once.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import structlog

from gyre_async.bus.secrets import externalize
from gyre_async.runtime.topology import ROLES
from gyre_async.storage.atomic import atomic_write_text

log = structlog.get_logger(__name__)

BACKOFF_BASE_S = 0.5
BACKOFF_CAP_S = 10.0
STABLE_AFTER_S = 60.0
POLL_S = 0.2
#: roles that may run as several processes (``--replicas``); the others hold the run's state
REPLICABLE = ("sampler", "learner", "segmenter", "arbiter", "echo")


@dataclass
class Role:
    """One role's process and its restart bookkeeping."""

    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # added to the launcher's environment
    proc: subprocess.Popen | None = None
    restarts: int = 0
    streak: int = 0  # restarts since the last stable run (drives the backoff)
    started_at: float = 0.0
    restart_at: float | None = None
    done: bool = False
    last_exit: str | None = None
    pids: list[int] = field(default_factory=list)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def process(self) -> subprocess.Popen:
        """The running (or last) process; only asked for once the role was started."""
        if self.proc is None:
            raise RuntimeError(f"role {self.name} has not been started")
        return self.proc


def describe_exit(code: int) -> str:
    """``exit 3`` or ``SIGKILL`` (Popen reports death by signal N as -N)."""
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit {code}"


def backoff_s(streak: int) -> float:
    """0.5 s, 1 s, 2 s, 4 s, 8 s, then 10 s for every further consecutive crash."""
    return min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** max(0, streak - 1))


def parse_replicas(text: str, roles: list[str]) -> dict[str, int]:
    """``sampler=4,echo=2`` -> counts per role (1 for the rest); ValueError says why."""
    counts = dict.fromkeys(roles, 1)
    for item in filter(None, (part.strip() for part in text.split(","))):
        role, _, count = item.partition("=")
        if role not in roles:
            raise ValueError(f"{item!r}: {role!r} is not among --roles")
        if role not in REPLICABLE:
            raise ValueError(f"{item!r}: {role} runs once per run (replicable: "
                             f"{', '.join(REPLICABLE)})")
        if not count.isdigit() or int(count) < 1:
            raise ValueError(f"{item!r}: give ROLE=N with N >= 1")
        counts[role] = int(count)
    return counts


def role_argv(role: str, args, port: int | None,
              replica: tuple[int, int] | None = None) -> list[str]:
    """``gyre actor ROLE ...`` for one process; ``replica`` (I, N) adds ``--replica I/N``."""
    argv = [sys.executable, "-m", "gyre_async.cli"]
    if getattr(args, "log_level", None):
        argv += ["--log-level", args.log_level]
    argv += ["actor", role, "--config", args.config]
    if replica is not None:
        argv += ["--replica", f"{replica[0]}/{replica[1]}"]
    if args.bus:  # its secrets, if any, go by environment (see :func:`child_environment`)
        argv += ["--bus", externalize(args.bus)[0]]
    if getattr(args, "run_dir", None):
        argv += ["--run-dir", args.run_dir]
    if port:
        argv += ["--metrics-port", str(port)]
        if getattr(args, "metrics_host", None):
            argv += ["--metrics-host", args.metrics_host]
    return argv


def child_environment(args) -> dict[str, str]:
    """The variables that carry ``--bus``'s secrets to the roles (see :func:`role_argv`)."""
    return externalize(args.bus)[1] if args.bus else {}


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: deliver SIGTERM to this child when the launcher dies, even by SIGKILL."""
    if _LIBC is None:
        return
    _LIBC.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != _PARENT[0]:  # the launcher died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


try:  # loaded in the parent: the child between fork and exec should do as little as possible
    import ctypes

    _LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None
except OSError:  # pragma: no cover
    _LIBC = None
_PARENT = [os.getpid()]


class Launcher:
    """Supervises the role processes; ``run`` returns the launcher's exit status."""

    def __init__(self, roles: list[Role], *, max_restarts: int, stop_timeout: float,
                 status_file: str | None = None):
        self.roles = roles
        self.max_restarts = max_restarts
        self.stop_timeout = stop_timeout
        self.status_file = status_file
        self.stop_requested = 0  # signals received
        self.failed: str | None = None

    # -- signals -------------------------------------------------------------------------
    def _on_signal(self, signum, _frame) -> None:
        self.stop_requested += 1
        if self.stop_requested > 1:
            print(f"gyre launch: second {signal.Signals(signum).name}: killing roles",
                  file=sys.stderr)
            self._signal_all(signal.SIGKILL)

    def _signal_all(self, sig: int) -> None:
        for role in self.roles:
            if role.alive:
                try:
                    role.process.send_signal(sig)
                except ProcessLookupError:
                    pass

    # -- lifecycle -----------------------------------------------------------------------
    def start(self, role: Role) -> None:
        _PARENT[0] = os.getpid()
        # preexec_fn is unsafe only with threads; the launcher has none.
        preexec = _die_with_parent if _LIBC is not None else None
        env = {**os.environ, **role.env} if role.env else None
        role.proc = subprocess.Popen(role.argv, env=env, preexec_fn=preexec)  # noqa: PLW1509
        role.started_at = time.monotonic()
        role.restart_at = None
        role.pids.append(role.process.pid)
        log.info("launcher.started", role=role.name, pid=role.process.pid, restarts=role.restarts)

    def run(self) -> int:
        previous = {s: signal.signal(s, self._on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            for role in self.roles:
                self.start(role)
            self.write_status()
            while not self.stop_requested and not self.failed:
                if all(r.done for r in self.roles):
                    log.info("launcher.all_done")
                    self.write_status(stopped=True)
                    return 0
                if self.tick():
                    self.write_status()
                time.sleep(POLL_S)
            return self.shutdown()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def tick(self) -> bool:
        """Reap exited children, schedule and perform restarts; True when status changed."""
        changed = False
        now = time.monotonic()
        for role in self.roles:
            if role.done:
                continue
            if role.restart_at is not None:
                if now >= role.restart_at and not self.stop_requested:
                    self.start(role)
                    changed = True
                continue
            code = role.proc.poll() if role.proc else None
            if code is None:
                continue
            changed = True
            role.last_exit = describe_exit(code)
            if code == 0:
                role.done = True
                log.info("launcher.role_done", role=role.name, pid=role.process.pid)
                print(f"gyre launch: {role.name} finished (exit 0)", file=sys.stderr)
                continue
            self._crashed(role, code, now)
        return changed

    def _crashed(self, role: Role, code: int, now: float) -> None:
        if now - role.started_at >= STABLE_AFTER_S:
            role.streak = 0
        role.restarts += 1
        role.streak += 1
        limit = "∞" if self.max_restarts < 0 else str(self.max_restarts)
        if 0 <= self.max_restarts < role.restarts:
            self.failed = role.name
            log.error("launcher.gave_up", role=role.name, pid=role.process.pid,
                      exit=role.last_exit, exit_code=code, restarts=role.restarts - 1,
                      max_restarts=self.max_restarts)
            print(f"gyre launch: {role.name} (pid {role.process.pid}) died with "
                  f"{role.last_exit}; restart limit {limit} reached, stopping", file=sys.stderr)
            return
        delay = backoff_s(role.streak)
        role.restart_at = now + delay
        log.warning("launcher.restart", role=role.name, pid=role.process.pid,
                    exit=role.last_exit, exit_code=code, restart=role.restarts,
                    max_restarts=self.max_restarts, backoff_s=delay)
        print(f"gyre launch: {role.name} (pid {role.process.pid}) died with {role.last_exit}; "
              f"restart {role.restarts}/{limit} in {delay:g} s", file=sys.stderr)

    def shutdown(self) -> int:
        """SIGTERM every child, wait ``stop_timeout``, SIGKILL the rest, reap all."""
        reason = f"role {self.failed} failed" if self.failed else "signal"
        log.info("launcher.stopping", reason=reason)
        self._signal_all(signal.SIGTERM)
        deadline = time.monotonic() + self.stop_timeout
        while any(r.alive for r in self.roles) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        for role in self.roles:
            if role.alive:
                log.warning("launcher.kill", role=role.name, pid=role.process.pid)
                role.process.kill()
            if role.proc is not None:
                role.last_exit = describe_exit(role.proc.wait())
            role.restart_at = None
        self.write_status(stopped=True)
        log.info("launcher.stopped", reason=reason)
        return 1 if self.failed else 0

    def write_status(self, *, stopped: bool = False) -> None:
        if not self.status_file:
            return
        status = {
            "launcher_pid": os.getpid(),
            "stopped": stopped,
            "failed_role": self.failed,
            "roles": {r.name: {"pid": r.proc.pid if r.proc else None, "pids": r.pids,
                               "alive": r.alive, "restarts": r.restarts, "done": r.done,
                               "restarting": r.restart_at is not None,
                               "last_exit": r.last_exit} for r in self.roles},
        }
        atomic_write_text(self.status_file, json.dumps(status, indent=1))


def read_status(path: str | os.PathLike) -> dict:
    """The status file a launcher writes (``--status-file``); ``{}`` before the first write."""
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def wait_until(what: str, predicate, timeout: float, every: float = 0.2):
    """Poll ``predicate`` until it returns something truthy (returned), or raise TimeoutError.

    For scripts and tests that drive a launcher from outside (chaos runs, launcher tests).
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")


def run(args) -> int:
    """``gyre launch`` (arguments parsed by :mod:`gyre_async.cli.launch`): validate the
    config and roles, then supervise until done or stopped."""
    from gyre_async.config import load_config

    cfg = load_config(args.config)  # a ConfigError here beats four crash-looping children
    names = [r.strip() for r in args.roles.split(",") if r.strip()]
    unknown = [r for r in names if r not in ROLES]
    if unknown or not names or len(set(names)) != len(names):
        print(f"gyre launch: --roles {args.roles!r}: give distinct roles from "
              f"{', '.join(sorted(ROLES))}", file=sys.stderr)
        return 2
    try:
        counts = parse_replicas(getattr(args, "replicas", ""), names)
    except ValueError as exc:
        print(f"gyre launch: --replicas {exc}", file=sys.stderr)
        return 2
    check_bus(cfg, args.bus)  # so is an unreachable bus (BusUnreachable, one line)
    base = args.metrics_port_base
    env = child_environment(args)
    roles: list[Role] = []
    for name in names:
        for index in range(counts[name]):
            port = base + len(roles) if base else None
            if counts[name] == 1:
                roles.append(Role(name, role_argv(name, args, port), env))
            else:
                roles.append(Role(f"{name}-{index}",
                                  role_argv(name, args, port, (index, counts[name])), env))
    return Launcher(roles, max_restarts=args.max_restarts, stop_timeout=args.stop_timeout,
                    status_file=args.status_file).run()


def check_bus(cfg, override: str | None) -> None:
    """Connect once to a Kafka bus and leave (raises :class:`BusUnreachable` or
    :class:`BusURLError`). The embedded bus is not opened here: its roles create it."""
    from gyre_async.config import bus_url
    from gyre_async.runtime.process import open_run_bus, run_main

    if not bus_url(cfg, override).startswith("kafka:"):
        return

    async def connect() -> None:
        async with open_run_bus(cfg, override):
            pass

    run_main(connect)
