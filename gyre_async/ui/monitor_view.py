"""Rendering of a :class:`~gyre_async.ui.monitor.MonitorState` as one rich frame.

Kept apart from the state so the fold stays pure and testable, and so the same frame
serves ``rich.live.Live`` (following a run) and a single ``console.print`` (``--once``).
The frame is a ``Group`` of ``Panel``s in a two-column ``Table.grid`` rather than a
``Layout``: a Layout fills a fixed terminal height, which clips or pads a printed frame,
while panels at their natural height read the same on a terminal, in a pipe or in a file.
Labels such as ``policy v12``, ``env steps 1234`` and ``dead letters 0`` are stable text
so scripts (and the tests) can read numbers off the screen.
"""

from __future__ import annotations

import datetime as dt
import os
import sys
from typing import TYPE_CHECKING

from rich.console import Console, Group, JustifyMethod, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from gyre_async.bus.secrets import redact

if TYPE_CHECKING:  # runtime import would be circular (monitor imports this module)
    from gyre_async.ui.monitor import MonitorState

BARS = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 24


def sparkline(values, lo: float | None = None, hi: float | None = None,
              width: int = SPARK_WIDTH) -> str:
    """The last ``width`` values as block characters (fixed range when ``lo``/``hi`` given)."""
    vals = list(values)[-width:]
    if not vals:
        return "·"
    lo = min(vals) if lo is None else lo
    hi = max(vals) if hi is None else hi
    span = hi - lo
    if span <= 0:
        return BARS[3] * len(vals)
    top = len(BARS) - 1
    return "".join(BARS[max(0, min(top, int((v - lo) / span * top + 0.5)))] for v in vals)


def _clock(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%H:%M:%S") if ts else "-"


def _rate(r: float | None) -> str:
    return "-" if r is None else f"{r:.1f}/s"


def _kv(rows: list[tuple[str, object]]) -> Table:
    t = Table.grid(padding=(0, 1))
    t.add_column(style="bold cyan", no_wrap=True)
    t.add_column(overflow="fold")
    for k, v in rows:
        t.add_row(k, v if isinstance(v, Text) else str(v))
    return t


def _policy(s: MonitorState) -> Panel:
    cur = s.current
    rollbacks = s.rollbacks
    last_rb = rollbacks[-1] if rollbacks else None
    ev = s.latest_eval
    lines = [
        Text(f"policy v{cur.version} ({cur.reason})  max v{s.max_version}" if cur
             else "policy -", style="bold"),
        Text(f"versions {len(s.versions)}  updates {s.counts.updates}  rollbacks "
             f"{len(rollbacks)}", style="bold red" if rollbacks else ""),
        Text(f"trained on {cur.env_steps if cur else 0} env steps"
             + (f"  lr {cur.learning_rate:.2g}" if cur else "")),
        Text(f"val success {ev.success_rate:.1%} (v{ev.policy_version})  score "
             f"{ev.mean_score:.3f}  {len(s.evals)} evals" if ev else "val success -"),
    ]
    if last_rb:
        lines.append(Text(f"latest rollback -> v{last_rb.version} (from v{last_rb.parent}) at "
                          f"{_clock(last_rb.ts)}", style="bold red"))
    if s.critic_resets:
        cr = max(s.critic_resets, key=lambda e: e.ts)
        lines.append(Text(f"critic resets {len(s.critic_resets)}: latest at v{cr.version} "
                          f"({cr.reason}) at {_clock(cr.ts)}", style="bold yellow"))
        lines.append(Text(f"  max |adv| {cr.max_abs_advantage:.3g}  value loss "
                          f"{cr.value_loss:.3g}  lr -> {cr.learning_rate:.2g}",
                          style="yellow"))
    return Panel(Group(*lines), title="policy", border_style="blue")


def _curves(s: MonitorState) -> Panel:
    evals = s.evals
    ok = s.train_success
    returns = list(s.returns)[-100:]
    failed = ", ".join(f"{k} {n}" for k, n in s.failure_kinds.most_common())
    rows = [
        ("val success", Text.assemble(sparkline([e.success_rate for e in evals], 0.0, 1.0),
                                      f"  {evals[-1].success_rate:.1%}" if evals else "")),
        ("val score", Text.assemble(sparkline([e.mean_score for e in evals]),
                                    f"  {evals[-1].mean_score:.3f}" if evals else "")),
        ("train success", Text.assemble(
            sparkline(s.train_curve, 0.0, 1.0),
            f"  {ok:.1%} (last 100)" if ok is not None else "")),
        ("", f"episodes {s.counts.episodes}  successes {s.counts.successes}"),
        ("failed episodes", f"{s.counts.failed_episodes}" + (f" ({failed})" if failed else "")),
        ("episode return", Text.assemble(
            sparkline(s.returns),
            f"  mean {sum(returns) / len(returns):.3f} (last {len(returns)})" if returns else "")),
    ]
    return Panel(_kv(rows), title="success and return", border_style="green")


def _throughput(s: MonitorState) -> Panel:
    head = Text(f"env steps {s.steps}  {s.env_steps_per_s():.1f}/s (last 10 s)  "
                f"avg {s.env_steps_avg():.1f}/s", style="bold")
    rates = s.role_rates()
    roles = _kv([(role, f"{_rate(rates[role])} inputs processed") for role in sorted(rates)])
    kinds = ", ".join(f"{k} {n}" for k, n in s.env_error_kinds.most_common())
    tail = [Text(f"env errors {s.counts.env_errors}" + (f" ({kinds})" if kinds else "")),
            Text(f"segments {s.counts.segments} closed  {s.counts.scored} scored  "
                 f"{s.counts.dropped} dropped")]
    return Panel(Group(head, roles, *tail), title="throughput (roles: heartbeat deltas)",
                 border_style="magenta")


def _actors(s: MonitorState) -> Panel:
    silent = s.silent_actors()
    t = Table(expand=True, box=None, padding=(0, 1))
    columns: list[tuple[str, JustifyMethod]] = [
        ("actor", "left"), ("inputs", "right"), ("rate", "right"), ("lag", "right"),
        ("beat", "right"), ("state", "left")]
    for name, justify in columns:
        t.add_column(name, justify=justify, no_wrap=True, overflow="ellipsis")
    for a in sorted(s.actors.values(), key=lambda a: (a.role, a.actor)):
        quiet = a.actor in silent
        who = a.actor if a.actor == a.role else f"{a.actor} ({a.role})"
        t.add_row(who, str(a.processed), _rate(a.rate()), str(a.lag),
                  f"{s.newest_ts - a.last_ts:.0f}s",
                  Text("SILENT", style="bold red") if quiet else Text("ok", style="green"))
    head = (Text(f"SILENT: {', '.join(silent)}", style="bold red") if silent
            else Text(f"all {len(s.actors)} actors beating (silent after "
                      f"{s.silent_after_s:.0f} s)", style="green"))
    return Panel(Group(head, t), title="heartbeats and consumer lag", border_style="yellow")


def _rewards(s: MonitorState) -> Panel:
    t = Table(expand=True, box=None, padding=(0, 1))
    t.add_column("component")
    for name in ("n", "sum", "mean"):
        t.add_column(name, justify="right")
    for name, (n, total) in sorted(s.components.items()):
        t.add_row(name, str(int(n)), f"{total:.3f}", f"{total / n:.3f}" if n else "-")
    scored = s.counts.scored
    t.add_row(Text("total", style="bold"), str(scored), f"{s.total_reward:.3f}",
              f"{s.total_reward / scored:.3f}" if scored else "-")
    notes = _kv([("reward failed", str(s.counts.reward_failed)),
                 ("reward-model agreement", "n/a (no drift-report events)")])
    return Panel(Group(t, notes), title="reward components", border_style="cyan")


def _staleness(s: MonitorState) -> Panel:
    t = Table.grid(padding=(0, 1))
    t.add_column(justify="right", style="bold")
    t.add_column()
    t.add_column(justify="right")
    peak = max(s.staleness_hist.values(), default=0)
    for k in sorted(s.staleness_hist):
        n = s.staleness_hist[k]
        t.add_row(str(k), "█" * max(1, round(20 * n / peak)), str(n))
    dropped = ", ".join(f"{k}: {n}" for k, n in sorted(s.dropped_hist.items()))
    info = _kv([("learner max", f"latest {s.learner_staleness:.0f}  max {s.max_staleness_seen:.0f}"),
                ("dropped", f"{s.counts.dropped}"
                 + (f" (staleness {dropped})" if dropped else ""))])
    return Panel(Group(Text("trained segments by staleness (versions)", style="dim"), t, info),
                 title="staleness", border_style="red")


def _dead(s: MonitorState) -> Panel:
    dead = s.counts.dead_letters
    rows: list = [Text(f"dead letters {dead}", style="bold red" if dead else "bold")]
    for d in reversed(s.latest_dead):
        rows.append(Text(f"{_clock(d.ts)} {d.actor} <- {d.source_topic}: {d.reason}"[:200],
                         overflow="fold"))
    return Panel(Group(*rows), title="dead letters (latest 3)", border_style="red")


def render(state: MonitorState, *, url: str | None = None, mode: str | None = None,
           wall_now: float | None = None) -> RenderableType:
    """One frame: header, three rows of two panels, footer."""
    s = state
    runs = s.run_id or (", ".join(sorted(s.run_ids)) if s.run_ids else "-")
    head = Text.assemble(("Gyre monitor", "bold"), f" · run {runs}",
                         f" · {redact(url)}" if url else "",
                         f" · newest event {_clock(s.newest_ts)}")
    if wall_now is not None and s.newest_ts:
        head.append(f" ({max(0.0, wall_now - s.newest_ts):.0f}s ago)")
    if mode:
        head.append(f" · {mode}", style="italic")
    grid = Table.grid(expand=True, padding=(0, 1))
    grid.add_column(ratio=1)
    grid.add_column(ratio=1)
    grid.add_row(_policy(s), _curves(s))
    grid.add_row(_throughput(s), _actors(s))
    grid.add_row(_rewards(s), Group(_staleness(s), _dead(s)))
    topics = " ".join(f"{t}:{n}" for t, n in sorted(s.by_topic.items()))
    foot = Text(f"events read {s.counts.events}  undecodable {s.read.skipped} (skipped)  "
                f"duplicates {s.counts.duplicates}  other runs {s.counts.other_runs}  |  "
                f"{topics}", style="dim", overflow="fold")
    return Group(head, grid, foot)


def make_console(once: bool) -> Console:
    """The terminal's console; 120 columns for a ``--once`` frame going to a pipe or file."""
    if once and not sys.stdout.isatty() and "COLUMNS" not in os.environ:
        return Console(width=120)
    return Console()
