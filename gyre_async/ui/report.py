"""``gyre report RUN_DIR``: one self-contained HTML page about a run, read from its event log.

Everything comes from the recorded events (plus ``config.json`` and ``summary.json`` of the
run directory), so a finished run, a live one and a Kafka archive (``--bus``) report alike.
The events are folded by :class:`~gyre_async.folds.run_fold.RunFold`, as for the monitor and
``summary.json``, so the three agree; undecodable records are skipped and counted.
The figures (``report_plots.py``) are PNGs embedded as base64 data URIs: the page needs no
network and no other file. The PNGs are also written to ``<run_dir>/report/``.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import html
import json
import os
from collections import Counter
from collections.abc import Sequence
from functools import cached_property

from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_events
from gyre_async.bus.secrets import redact
from gyre_async.folds.run_fold import RunFold
from gyre_async.folds.runlog import summarize
from schemas.topics import ALL_TOPICS, DEAD_LETTER, PROBE_IN, PROBE_OUT

READ_TOPICS = tuple(t for t in ALL_TOPICS if t not in (PROBE_IN, PROBE_OUT))


class ReportData(RunFold):
    """The run's fold (every record kept: the figures need them) and the run directory's
    files; undecodable records are skipped and counted (``read.skipped``, under health)."""

    def __init__(self, run_dir: str, bus_url: str | None = None):
        super().__init__(keep_records=True)
        self.run_dir = run_dir
        self.bus_url = bus_url
        self.topic_counts: dict[str, int] = {}
        self.config: dict | None = None
        self.summary: dict | None = None
        self.problems: list[str] = []

    @cached_property
    def t0(self) -> float:
        """Run start: the first env step, else the first event of any kind."""
        if self.step_ts:
            return self.step_ts[0]
        stamps = [x.ts for xs in (self.versions, self.evals, self.segments, self.scored)
                  for x in xs]
        return min(stamps, default=0.0)

    @property
    def max_staleness(self) -> int | None:
        loop = (self.config or {}).get("loop") or {}
        try:
            return int(loop["max_staleness"])
        except (TypeError, KeyError, ValueError):
            return None


def _read_json(path: str, problems: list[str]) -> dict | None:
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        problems.append(f"could not read {os.path.basename(path)}: {exc}")
        return None


async def load_report_data(run_dir: str, bus: str | None = None) -> ReportData:
    """Read a run: its config/summary files and every topic the report shows."""
    d = ReportData(run_dir=os.path.abspath(run_dir))
    d.config = _read_json(os.path.join(d.run_dir, "config.json"), d.problems)
    d.summary = _read_json(os.path.join(d.run_dir, "summary.json"), d.problems)
    db = os.path.join(d.run_dir, "events.db")
    url = bus or (f"sqlite:///{db}" if os.path.exists(db) else
                  ((d.config or {}).get("bus") or {}).get("url"))
    if not url:  # never create an empty log in someone's run directory
        d.problems.append(f"no event log at {db} (use --bus URL to read another log)")
        return d
    d.bus_url = url
    # read back with the limit the run consumed with (its config's, else the default)
    limit = ((d.config or {}).get("bus") or {}).get("max_message_bytes")
    options: dict[str, object] = {"max_message_bytes": int(limit)} if limit else {}
    async with open_bus(url, reader=True, **options) as log:
        d.topic_counts = {t.name: sum(t.end_offsets.values()) for t in await log.topics()}
        wanted = [t for t in READ_TOPICS if d.topic_counts.get(t)]
        if wanted:
            async for record, event in read_events(log, wanted, on_bad="skip", counts=d.read):
                d.apply(event, record.topic)
    return d


def summary_of(d: ReportData) -> tuple[dict, str]:
    """summary.json if the run wrote one, else the same summary computed from the log."""
    if d.summary is not None:
        return d.summary, "summary.json (written at the end of the run)"
    last = max([x.ts for xs in (d.versions, d.evals, d.segments) for x in xs] + d.step_ts[-1:],
               default=d.t0)
    return summarize(d, last - d.t0), "computed from the event log (no summary.json)"


def _e(x: object) -> str:
    return html.escape(str(x), quote=True)


def _fmt(v: object) -> str:
    if v is None or isinstance(v, bool):
        return "—" if v is None else str(v).lower()
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, int):
        return f"{v:,}"
    if isinstance(v, (list, dict)):
        text = json.dumps(v)
        return text if len(text) <= 300 else text[:300] + " …"
    return str(v)


def _pct(v: object) -> str:
    return "—" if v is None else f"{float(v):.0%}"  # type: ignore[arg-type]


def _when(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _table(head: list[str], rows: Sequence[Sequence[object]], cls: str = "") -> str:
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{_e(_fmt(c))}</td>" for c in r) + "</tr>"
                   for r in rows)
    return f'<table class="{cls}"><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>'


def _nodata(what: str) -> str:
    return f'<p class="nodata">no data — {_e(what)}</p>'


def _figure_html(name: str, result: object) -> str:
    from gyre_async.ui.report_plots import FIGURES

    _, title, caption = FIGURES[name]
    out = f'<section id="{name}"><h2>{_e(title)}</h2>'
    if isinstance(result, bytes):
        b64 = base64.b64encode(result).decode()
        out += (f'<img alt="{_e(title)}" src="data:image/png;base64,{b64}">'
                f'<p class="cap">{_e(caption)}</p>')
    elif isinstance(result, Exception):
        out += f'<p class="warn">figure failed: {_e(type(result).__name__)}: {_e(result)}</p>'
    else:
        out += _nodata(f"this run has no events for {title.lower()}")
    return out + "</section>"


def _cards(s: dict, d: ReportData) -> str:
    stale = sum(x.reason == "stale" for x in d.dropped)
    best = s.get("best") or {}
    items = [
        (_pct(s.get("final_success")),
         f"final val success (v{_fmt(s.get('final_eval_version'))})"),
        (_pct(best.get("success")), f"best val success (v{_fmt(best.get('version'))}, "
         "best.json)"),
        (_pct(s.get("initial_success")), "initial val success"),
        (_fmt(s.get("env_steps")), "env steps"),
        (_fmt(s.get("env_steps_per_s")), "env steps / s"),
        (_fmt(s.get("policy_versions")), "policy versions"),
        (_fmt(s.get("episodes")), f"episodes ({_pct(s.get('train_success_rate'))} success)"),
        (_fmt(stale), f"stale drops (+{len(d.dropped) - stale} other drops)"),
        (_fmt(len(d.rollbacks)), "rollbacks"),
        (_fmt(d.counts.dead_letters), "dead letters"),
    ]
    return '<div class="cards">' + "".join(
        f'<div class="card"><div class="v">{_e(v)}</div><div class="k">{_e(k)}</div></div>'
        for v, k in items) + "</div>"


def _evals_html(d: ReportData) -> str:
    if not d.evals:
        return _nodata("no eval events")
    steps_at = {v.version: v.env_steps for v in d.versions}
    rows = [[e.policy_version, steps_at.get(e.policy_version, e.env_steps), e.episodes,
             _pct(e.success_rate), e.mean_score, e.mean_length, _when(e.ts),
             ", ".join(f"{k} {v:.0%}" for k, v in sorted(e.milestone_rates.items()))]
            for e in d.evals]
    return _table(["version", "env steps trained", "episodes", "success", "score",
                   "mean length", "time", "milestone rates"], rows)


def _training_parts_html(s: dict) -> str:
    """The training episodes in parts by when they ended (``summary.training_parts``)."""
    parts = s.get("training_parts") or []
    if not parts:
        return _nodata("no finished training episodes")
    rows = [[p["episodes"], p["versions"], f"{p['won']}/{p['of']}", p["lost"], p["failed"],
             p["mean_milestones"], p["mean_length"]] for p in parts]
    return _table(["episodes (in the order they ended)", "versions", "won", "lost by the game",
                   "failed", "mean milestones", "mean length"], rows)


def _health_html(d: ReportData) -> str:
    drops = Counter(x.reason for x in d.dropped)
    rows = [["dropped segments", len(d.dropped), ", ".join(f"{r}: {n}" for r, n in
                                                           sorted(drops.items()))],
            ["rollbacks", len(d.rollbacks), ", ".join(f"v{v.version} at {_when(v.ts)}"
                                                      for v in d.rollbacks)],
            ["env errors", d.counts.env_errors, ", ".join(
                f"{k}: {n}" for k, n in d.env_error_kinds.most_common())],
            ["failed episodes (no outcome: out of group baselines, bootstrapped)",
             d.counts.failed_episodes, ", ".join(
                 f"{k}: {n}" for k, n in d.failure_kinds.most_common())],
            ["reward failures", d.counts.reward_failed, ""],
            ["undecodable records (skipped)", d.read.skipped, d.read.last_skip_reason],
            ["duplicate deliveries (ignored)", d.counts.duplicates, ""]]
    return _table(["what", "count", "detail"], rows)


def _dead_letters_html(d: ReportData) -> str:
    if not d.dead_letters:
        return ('<p>0 dead letters — every input was usable.</p>'
                if DEAD_LETTER in d.topic_counts else _nodata("no dead-letter topic"))
    by = Counter((e.actor, e.source_topic) for e in d.dead_letters)
    out = f"<p><b>{len(d.dead_letters)}</b> dead letter(s).</p>"
    out += _table(["actor", "source topic", "count"],
                  [[a, t, n] for (a, t), n in by.most_common()])
    latest = d.dead_letters[-10:][::-1]
    out += "<p class='cap'>Latest reasons:</p>" + _table(
        ["time", "actor", "source", "reason", "bytes"],
        [[_when(e.ts), e.actor, f"{e.source_topic}[{e.source_partition}]@{e.source_offset}",
          e.reason if len(e.reason) < 400 else e.reason[:400] + " …", len(e.original)]
         for e in latest])
    return out


def render_html(d: ReportData, figures: dict) -> str:
    from gyre_async.ui.report_plots import CSS, FIGURES

    s, source = summary_of(d)
    run = (d.config or {}).get("run") or {}
    title = f"Gyre run {run.get('run_id', os.path.basename(d.run_dir))}"
    now = dt.datetime.now().timestamp()
    span = (f"started {_when(d.t0)} · " if d.t0 else "") + f"report generated {_when(now)}"
    mode = run.get("mode", s.get("mode", "?"))
    meta = f"{d.run_dir} · log {redact(d.bus_url or 'none')} · {span}"
    parts = [(f"<!doctype html><html lang='en'><head><meta charset='utf-8'>"
              f"<meta name='viewport' content='width=device-width,initial-scale=1'>"
              f"<title>{_e(title)}</title><style>{CSS}</style></head><body><header>"
              f"<h1>{_e(title)} <small>({_e(mode)})</small></h1><div class='meta'>{_e(meta)}"
              "</div></header><main>")]
    if d.problems:
        parts.append("<div class='problems'>" + "".join(f"<div>{_e(p)}</div>"
                                                         for p in d.problems) + "</div>")
    parts.append(_cards(s, d))
    links = [(n, FIGURES[n][1]) for n in figures] + [
        ("evals", "Evaluations"), ("summary", "Summary"), ("dead-letters", "Dead letters"),
        ("events", "Event log"), ("config", "Config")]
    parts.append("<nav>" + "".join(f"<a href='#{n}'>{_e(t)}</a>" for n, t in links) + "</nav>")
    parts += [_figure_html(name, result) for name, result in figures.items()]
    parts.append(f"<section id='evals'><h2>Evaluations</h2>{_evals_html(d)}"
                 f"<h2>Training episodes</h2>{_training_parts_html(s)}</section>")
    rows = [[k, v] for k, v in s.items() if k not in ("evals", "training_parts")]
    parts.append(f"<section id='summary'><h2>Summary</h2><p class='cap'>Source: {_e(source)}"
                 f"</p>{_table(['metric', 'value'], rows, 'kv')}<h2>Health</h2>"
                 f"{_health_html(d)}</section>")
    parts.append(f"<section id='dead-letters'><h2>Dead letters</h2>{_dead_letters_html(d)}"
                 "</section>")
    topics = (_table(["topic", "records"], sorted(d.topic_counts.items()))
              if d.topic_counts else _nodata("no topics on the bus"))
    parts.append(f"<section id='events'><h2>Event log</h2>{topics}</section>")
    cfg = (f"<details><summary>config.json</summary><pre>{_e(redact(json.dumps(d.config, indent=2)))}"
           "</pre></details>" if d.config is not None else _nodata("no config.json"))
    parts.append(f"<section id='config'><h2>Config</h2>{cfg}</section>")
    parts.append("</main></body></html>\n")
    return "".join(parts)


def write_report(d: ReportData, out: str) -> str:
    """Render the figures and the page (blocking: run it off the event loop)."""
    from gyre_async.ui.report_plots import render_all

    figures = render_all(d)
    png_dir = os.path.join(d.run_dir, "report")
    os.makedirs(png_dir, exist_ok=True)
    for name, result in figures.items():
        path = os.path.join(png_dir, f"{name}.png")
        if isinstance(result, bytes):
            with open(path, "wb") as f:
                f.write(result)
        elif os.path.exists(path):  # a stale figure from an earlier report
            os.remove(path)
    from gyre_async.storage.atomic import atomic_write_text

    atomic_write_text(out, render_html(d, figures))
    return out


async def build_report(run_dir: str, *, out: str | None = None, bus: str | None = None) -> str:
    """Write the HTML report of ``run_dir`` (default ``<run_dir>/report.html``); return its path.

    ``bus`` reads the event log from another URL (e.g. a Kafka run); the figures are also
    written as PNGs to ``<run_dir>/report/``.
    """
    if not os.path.isdir(run_dir):
        raise FileNotFoundError(f"run directory {run_dir!r} does not exist")
    d = await load_report_data(run_dir, bus)
    out = os.path.abspath(out or os.path.join(d.run_dir, "report.html"))
    return await asyncio.to_thread(write_report, d, out)
