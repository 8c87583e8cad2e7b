"""An optional Prometheus text-format endpoint per actor process (``gyre actor --metrics-port``).

Why it exists: heartbeats on ``telemetry`` already carry every counter, but reading them
needs a bus client. Operators run Prometheus/Grafana and Kubernetes probes, which speak
HTTP; this endpoint exposes the same numbers where those tools look, without a new
dependency (stdlib ``http.server`` in a daemon thread, so it never blocks the event loop
and dies with the process).

Choices, and why:

- **Names are namespaced and sanitised here**, once: ``charts/max_staleness_seen`` becomes
  ``gyre_charts_max_staleness_seen``, an actor's plain stat ``episodes`` becomes
  ``gyre_sampler_episodes`` (its role in the name, so one dashboard query per stat works
  across pods), and anything outside ``[a-zA-Z0-9_:]`` becomes ``_``. A collector may return
  keys with labels (``gyre_busy_seconds{category="bus"}``); label values are escaped.
- **Types from names**: ``*_total`` and ``gyre_busy_seconds`` (monotonic busy time per
  category, from :mod:`gyre_async.timing`) are counters, the rest gauges; graph counters
  with ``rate()``.
- **Lag is fetched at scrape time** on the actor's own event loop (the bus clients are not
  thread-safe) with a 2 s bound, so a scrape never reports a lag older than the scrape;
  when the loop does not answer it reports ``gyre_bus_lag -1`` like the heartbeat does.
- **Loopback by default** (:data:`DEFAULT_HOST`): ``--metrics-host`` opens it to other
  machines (a Prometheus outside the pod, a Kubernetes probe) when that is meant.
- **/healthz** answers 200 only if the actor's event loop runs a callback within 5 s:
  a wedged loop (the "silent actor" of the runbook) fails the liveness probe, while a busy
  learner training in its worker thread does not.
"""

from __future__ import annotations

import asyncio
import math
import re
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from gyre_async import timing
from gyre_async.bus.secrets import redact

#: Where the endpoint listens unless told otherwise: this machine only. Metrics name the
#: run's roles and counters, and nothing on the endpoint is authenticated; expose it to a
#: scraper on purpose (``--metrics-host 0.0.0.0`` in a pod), not by default.
DEFAULT_HOST = "127.0.0.1"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
NAMESPACE = "gyre"
#: Counter families whose names do not end in ``_total``.
COUNTERS = frozenset({"gyre_busy_seconds"})
_BAD = re.compile(r"[^a-zA-Z0-9_:]")
_KEY = re.compile(r"^(?P<name>[^{]+)(?:\{(?P<labels>.*)\})?$")
_LABEL = re.compile(r'\s*([^=,\s]+)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')


def metric_name(*parts: str) -> str:
    """``gyre_`` + the parts joined by ``_``, sanitised to Prometheus' name alphabet."""
    name = "_".join(p.strip("/_ ") for p in parts if p)
    name = _BAD.sub("_", name)
    name = re.sub(r"_+", "_", name).strip("_")
    if not name.startswith(NAMESPACE + "_"):
        name = f"{NAMESPACE}_{name}"
    return name


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _unescape(value: str) -> str:
    """Label values in a key arrive escaped as in the exposition format: undo it once."""
    return re.sub(r"\\(.)", lambda m: "\n" if m[1] == "n" else m[1], value)


def _format_value(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def render(metrics: dict[str, float]) -> str:
    """Prometheus text exposition (0.0.4) of ``{"name{label=\\"v\\"}": value}``.

    Names are re-sanitised (a collector may pass anything), samples of one family are
    grouped under one ``# TYPE`` line, and values that are not numbers are skipped rather
    than breaking the whole scrape.
    """
    families: dict[str, list[str]] = {}
    for key, value in metrics.items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        match = _KEY.match(key.strip())
        if match is None:
            continue
        name = metric_name(match["name"])
        labels = _LABEL.findall(match["labels"] or "")
        label_text = ",".join(f'{_BAD.sub("_", k)}="{_escape(redact(_unescape(v)))}"'
                              for k, v in labels)
        sample = f"{name}{{{label_text}}}" if label_text else name
        families.setdefault(name, []).append(f"{sample} {_format_value(number)}")
    lines = []
    for name in sorted(families):
        kind = "counter" if name.endswith("_total") or name in COUNTERS else "gauge"
        lines.append(f"# TYPE {name} {kind}")
        lines.extend(sorted(families[name]))
    return "\n".join(lines) + "\n"


class _Handler(BaseHTTPRequestHandler):
    server: _MetricsServer

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            try:
                body, status = render(self.server.collect()).encode(), 200
            except Exception as exc:  # noqa: BLE001 - a scrape error must not kill the thread
                body, status = f"collect failed: {exc!r}\n".encode(), 500
        elif path in ("/healthz", "/livez"):
            ok = self.server.health() if self.server.health else True
            body, status = (b"ok\n", 200) if ok else (b"event loop not responding\n", 503)
        else:
            body, status = b"see /metrics and /healthz\n", 404
        self.send_response(status)
        self.send_header("Content-Type", CONTENT_TYPE)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:
        """Scrapes every few seconds would flood stderr; stay quiet."""


class _MetricsServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address: tuple[str, int], collect: Callable[[], dict[str, float]],
                 health: Callable[[], bool] | None):
        super().__init__(address, _Handler)
        self.collect = collect
        self.health = health
        self.thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.server_address[1]

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


def start_metrics_server(port: int, collect: Callable[[], dict[str, float]], *,
                         host: str = DEFAULT_HOST,
                         health: Callable[[], bool] | None = None) -> _MetricsServer:
    """Serve ``GET /metrics`` (and ``/healthz``) from a daemon thread; returns the server.

    ``port=0`` picks a free port (read it back from ``server.port``). ``server.stop()``
    shuts it down; a process that just exits needs no cleanup (daemon thread).
    """
    server = _MetricsServer((host, port), collect, health)
    server.thread = threading.Thread(target=server.serve_forever, name=f"metrics-{port}",
                                     daemon=True)
    server.thread.start()
    return server


def actor_metrics(runner, *, lag: float | None = None) -> dict[str, float]:
    """Everything a heartbeat says about one actor, as namespaced Prometheus samples.

    ``runner`` is an :class:`gyre_async.runtime.actor.ActorRunner`. ``lag`` is the consumer lag if
    the caller measured it (it needs the bus, see :func:`serve_actor_metrics`).
    """
    role = runner.actor.role
    out: dict[str, float] = {
        "gyre_up": 1.0,
        "gyre_processed_total": float(runner.processed),
        "gyre_dead_letters_total": float(runner.dead_letters),
        "gyre_duplicates_total": float(runner.duplicates),
        "gyre_uptime_seconds": time.monotonic() - runner._started,
        "gyre_stopping": 1.0 if runner.stopping.is_set() else 0.0,
    }
    if lag is not None:
        out["gyre_bus_lag"] = float(lag)
    for key, value in runner.actor.stats().items():
        # "charts/x" and "losses/x" are already namespaced by kind; plain keys by role.
        name = metric_name(key) if "/" in key else metric_name(role, key)
        out[name] = float(value)
    busy = timing.snapshot()
    for category, seconds in busy.items():
        out[f'gyre_busy_seconds{{category="{category}"}}'] = float(seconds)
    out["gyre_framework_share"] = timing.framework_share(busy)
    return out


def serve_actor_metrics(runner, port: int, *, lag_timeout_s: float = 2.0,
                        host: str = DEFAULT_HOST) -> _MetricsServer:
    """Start the endpoint for a runner; call from inside its running event loop.

    The HTTP thread asks the loop for the consumer lag (``bus.lag`` on the loop, bounded by
    ``lag_timeout_s``) and for liveness (a no-op callback answered within 5 s).
    """
    loop = asyncio.get_running_loop()

    def lag() -> float | None:
        if not runner.actor.consumes:
            return None
        future = asyncio.run_coroutine_threadsafe(
            runner.bus.lag(runner.group, runner.actor.consumes), loop)
        try:
            return float(future.result(timeout=lag_timeout_s))
        except Exception:  # noqa: BLE001 - closed loop, timeout or bus error: unknown
            future.cancel()
            return -1.0

    def healthy() -> bool:
        if loop.is_closed():
            return False
        answered = threading.Event()
        try:
            loop.call_soon_threadsafe(answered.set)
        except RuntimeError:
            return False
        return answered.wait(5.0)

    return start_metrics_server(port, lambda: actor_metrics(runner, lag=lag()),
                                host=host, health=healthy)
