"""The figures of ``gyre report`` (one function per section) and the page's style sheet.

Each function takes the :class:`gyre_async.ui.report.ReportData` read from the event log and
returns None when the run has nothing to show for that section (the page then says "no
data"); a figure whose panels are partly empty says so inside the empty panel. Rollbacks
(``PolicyVersion.reason == "rollback"``) are drawn as red dotted vertical lines.
"""

from __future__ import annotations

import io
from collections import Counter, defaultdict
from typing import TYPE_CHECKING

import numpy as np
from matplotlib.ticker import MaxNLocator

if TYPE_CHECKING:
    from gyre_async.ui.report import ReportData

ROLLBACK = {"color": "crimson", "linestyle": ":", "linewidth": 1.5}
BOUNDARIES = ("milestone", "state-change", "max-length", "trajectory-end")
COMPONENT_ORDER = ("outcome", "milestone", "guard", "feedback")
RC = {"font.size": 9, "axes.titlesize": 10, "axes.spines.top": False,
      "axes.spines.right": False, "axes.grid": True, "grid.alpha": 0.3,
      "legend.fontsize": 8, "legend.framealpha": 0.8, "axes.formatter.useoffset": False}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    _plt().close(fig)
    return buf.getvalue()


def _nodata(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no data\n({what})", ha="center", va="center", color="0.45",
            transform=ax.transAxes)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.grid(False)


def _headroom(ax, frac: float = 0.35) -> None:  # room above the data for the legend
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, hi + (hi - lo) * frac)


def _integer(axis) -> None:
    axis.set_major_locator(MaxNLocator(integer=True))


def _rollback_lines(ax, xs, label: bool = True) -> None:
    for i, x in enumerate(xs):
        ax.axvline(x, **ROLLBACK, label="rollback" if label and i == 0 else None)


def _figure(ncols: int, nrows: int = 1, height: float = 3.6):
    return _plt().subplots(nrows, ncols, figsize=(12, height * nrows), squeeze=False)


def learning_curves(d: ReportData) -> bytes | None:
    """Validation success/score vs env steps trained; rolling train success vs time."""
    episodes = [s for s in d.segments if s.trajectory_done]
    if not d.evals and not episodes:
        return None
    fig, axes = _figure(2)
    ax = axes[0, 0]
    steps_at = {v.version: v.env_steps for v in d.versions}
    if d.evals:
        pts = sorted(((steps_at.get(e.policy_version, e.env_steps), e) for e in d.evals),
                     key=lambda p: (p[0], p[1].policy_version))
        xs = [x for x, _ in pts]
        ax.plot(xs, [e.success_rate for _, e in pts], "o-", label="validation success")
        ax.plot(xs, [e.mean_score for _, e in pts], "s--", label="validation score")
        if len(pts) <= 30:
            for x, e in pts:
                ax.annotate(f"v{e.policy_version}", (x, e.success_rate), fontsize=7,
                            textcoords="offset points", xytext=(0, 6), ha="center",
                            color="0.35")
        _rollback_lines(ax, [v.env_steps for v in d.rollbacks])
        ax.set(ylim=(-0.05, 1.25), yticks=np.linspace(0, 1, 6))
        ax.legend(loc="upper left", ncol=3)
    else:
        _nodata(ax, "no eval events")
    ax.set_xlabel("env steps trained on")
    ax.set_title(f"validation on unseen tasks ({len(d.evals)} evals)")
    ax = axes[0, 1]
    if episodes:
        t = np.array([s.ts - d.t0 for s in episodes])
        ok = np.array([float(s.success) for s in episodes])
        window = int(min(100, max(1, len(ok) // 5)))
        csum = np.concatenate([[0.0], np.cumsum(ok)])
        idx = np.arange(1, len(ok) + 1)
        rolling = (csum[idx] - csum[np.maximum(idx - window, 0)]) / np.minimum(idx, window)
        ax.plot(t, rolling, color="C2", label=f"rolling mean ({window} episodes)")
        ax.plot(t, csum[1:] / idx, color="0.5", linewidth=1, label="cumulative mean")
        ax.plot(t, ok * 1.08 - 0.04, "|", color="C3", alpha=0.5, markersize=8,
                label="episode outcome (0/1)")
        _rollback_lines(ax, [v.ts - d.t0 for v in d.rollbacks])
        ax.set(ylim=(-0.08, 1.3), yticks=np.linspace(0, 1, 6))
        ax.legend(loc="upper left", ncol=2)
    else:
        _nodata(ax, "no finished trajectories")
    ax.set_xlabel("seconds since first step")
    ax.set_title(f"train success rate ({len(episodes)} episodes)")
    return _png(fig)


def _component_key(name: str) -> tuple[int, str]:
    head = name.split(":", 1)[0]
    rank = COMPONENT_ORDER.index(head) if head in COMPONENT_ORDER else len(COMPONENT_ORDER)
    return rank, name


def reward_components(d: ReportData) -> bytes | None:
    """Mean reward components per segment, by the behaviour policy version that acted."""
    if not d.scored:
        return None
    by_version: dict[int, list] = defaultdict(list)
    for s in d.scored:
        by_version[s.min_policy_version].append(s)
    versions = sorted(by_version)
    names = sorted({k for s in d.scored for k in s.components}, key=_component_key)
    fig, axes = _figure(2)
    ax = axes[0, 0]
    x = np.array(versions)
    pos, neg = np.zeros(len(versions)), np.zeros(len(versions))
    for i, name in enumerate(names):
        vals = np.array([np.mean([s.components.get(name, 0.0) for s in by_version[v]])
                         for v in versions])
        base = np.where(vals >= 0, pos, neg)
        label = name + (" (recorded, not paid)" if name == "feedback" else "")
        ax.bar(x, vals, bottom=base, color=f"C{i}", label=label, width=0.8,
               hatch="//" if name == "feedback" else None, edgecolor="white", linewidth=0.5)
        pos += np.clip(vals, 0, None)
        neg += np.clip(vals, None, 0)
    ax.plot(x, [np.mean([s.total for s in by_version[v]]) for v in versions], "ko-",
            markersize=3, linewidth=1, label="paid total")
    ax.axhline(0, color="0.3", linewidth=0.8)
    _integer(ax.xaxis)
    ax.set_xlabel("behaviour policy version (segment min_policy_version)")
    ax.set_ylabel("mean per segment")
    ax.set_title(f"reward components ({len(d.scored)} scored segments)")
    _headroom(ax, 0.45)
    ax.legend(loc="upper left", ncol=3)
    ax = axes[0, 1]
    deciders = sorted({s.decided_by for s in d.scored})
    bottom = np.zeros(len(versions))
    for i, who in enumerate(deciders):
        share = np.array([np.mean([s.decided_by == who for s in by_version[v]])
                          for v in versions])
        ax.bar(x, share, bottom=bottom, color=f"C{i + 4}", label=who, width=0.8)
        bottom += share
    _integer(ax.xaxis)
    ax.set_ylim(0, 1)
    ax.set_xlabel("behaviour policy version")
    ax.set_ylabel("share of segments")
    ax.set_title("which arbiter level decided each segment")
    ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0), title="decided by")
    return _png(fig)


def staleness_values(d: ReportData) -> list[int]:
    """Learner version at training minus segment min_policy_version, per trained segment
    (the fold's join of policy-version.trained_segments with segment-closed)."""
    return [k for k, n in sorted(d.staleness_hist.items()) for _ in range(n)]


def staleness(d: ReportData) -> bytes | None:
    values = staleness_values(d)
    updates = [v for v in d.versions if "charts/max_staleness_seen" in v.metrics]
    if not values and not updates and not d.dropped:
        return None
    fig, axes = _figure(2)
    bound = d.max_staleness
    dropped = Counter(x.reason for x in d.dropped)
    ax = axes[0, 0]
    if values:
        hi = max(max(values), bound if bound is not None else 0)
        counts = np.bincount(np.clip(values, 0, None), minlength=hi + 1)
        ax.bar(np.arange(len(counts)), counts, color="C0", width=0.8, label="trained segments")
        ax.set_xticks(np.arange(len(counts)))
        if bound is not None:
            ax.axvline(bound + 0.5, color="C3", linestyle="--", label=f"bound ({bound})")
        _integer(ax.yaxis)
        _headroom(ax, 0.3)
        ax.legend(loc="upper left", ncol=2)
    else:
        _nodata(ax, "no trained segments joined to segment-closed")
    ax.set_xlabel("staleness at training (versions)")
    ax.set_ylabel("segments")
    drops = ", ".join(f"{r}: {n}" for r, n in sorted(dropped.items())) or "none"
    ax.set_title(f"staleness of trained segments — dropped: {drops}")
    ax = axes[0, 1]
    if updates:
        xs = [v.version for v in updates]
        ax.plot(xs, [v.metrics["charts/max_staleness_seen"] for v in updates], "o-",
                color="C0", label="max staleness in batch")
        if bound is not None:
            ax.axhline(bound, color="C3", linestyle="--", label=f"bound ({bound})")
        cum = [v.metrics.get("charts/dropped_segments") for v in updates]
        if any(c is not None for c in cum):
            ax.plot(xs, [c or 0.0 for c in cum], "s-", color="0.5", markersize=3,
                    label="stale drops (cumulative)")
        _rollback_lines(ax, [v.version for v in d.rollbacks])
        _integer(ax.xaxis)
        _headroom(ax, 0.35)
        ax.legend(loc="upper left", ncol=2)
    else:
        _nodata(ax, "no charts/max_staleness_seen")
    ax.set_xlabel("policy version")
    ax.set_title("charts/max_staleness_seen over versions")
    return _png(fig)


def segments(d: ReportData) -> bytes | None:
    if not d.segments:
        return None
    fig, axes = _figure(2)
    lengths = np.array([s.step_end - s.step_start for s in d.segments])
    ax = axes[0, 0]
    ax.hist(lengths, bins=np.arange(0.5, lengths.max() + 1.5, max(1, lengths.max() // 40)),
            color="C0")
    ax.axvline(lengths.mean(), color="C3", linestyle="--", label=f"mean {lengths.mean():.1f}")
    ax.set_xlabel("segment length (steps)")
    ax.set_ylabel("segments")
    ax.set_title(f"segment lengths ({len(lengths)} segments, median {np.median(lengths):.0f})")
    _headroom(ax, 0.15)
    ax.legend(loc="upper left")
    ax = axes[0, 1]
    reasons: Counter[str] = Counter(s.boundary for s in d.segments)
    names = list(BOUNDARIES) + sorted(set(reasons) - set(BOUNDARIES))
    bars = ax.barh(names, [reasons.get(n, 0) for n in names], color="C1")
    ax.bar_label(bars, padding=3)
    ax.invert_yaxis()
    ax.set_xlabel("segments")
    ax.set_title("why segments were closed (boundary)")
    return _png(fig)


def _rate(ts: np.ndarray, t0: float, t1: float, width: float) -> tuple[np.ndarray, np.ndarray]:
    """Events per second in ``width``-second bins from ``t0``: (edges - t0, rates).

    The last bin is usually partial: scaled by its real length, or dropped when shorter
    than half a bin (it would read as a slowdown that never happened).
    """
    n = max(1, int(np.ceil((t1 - t0) / width)))
    edges = t0 + width * np.arange(n + 1)
    counts, _ = np.histogram(ts, bins=edges)
    span = np.minimum(edges[1:], t1) - edges[:-1]
    if n > 1 and span[-1] < width / 2:
        counts, edges, span = counts[:-1], edges[:-1], span[:-1]
    return edges - t0, counts / np.maximum(span, width / 20)


def throughput(d: ReportData, bin_s: float = 10.0) -> bytes | None:
    """Env steps/s and segments/s in 10 s bins (finer on runs shorter than 100 s)."""
    if not d.step_ts and not d.segments and not d.versions:
        return None
    fig, axes = _figure(2)
    t_end = max([d.t0, *d.step_ts[-1:], *(s.ts for s in d.segments[-1:]),
                 *(v.ts for v in d.versions)])
    if t_end - d.t0 < 10 * bin_s:  # at least ~10 bins
        bin_s = max(0.1, round((t_end - d.t0) / 10, 1))
    ax = axes[0, 0]
    if d.step_ts:
        edges, rate = _rate(np.array(d.step_ts), d.t0, t_end, bin_s)
        ax.stairs(rate, edges, color="C0", fill=True, alpha=0.3)
        ax.set_ylabel("env steps/s", color="C0")
        ax.set_ylim(bottom=0)
        _rollback_lines(ax, [v.ts - d.t0 for v in d.rollbacks])
        if d.segments:
            tw = ax.twinx()
            edges, srate = _rate(np.array([s.ts for s in d.segments]), d.t0, t_end, bin_s)
            tw.stairs(srate, edges, color="C1", linewidth=1.2)
            tw.set_ylabel("segments/s", color="C1")
            tw.set_ylim(bottom=0)
            tw.grid(False)
        ax.set_title(f"throughput ({bin_s:g} s bins; {len(d.step_ts):,} steps)")
    else:
        _nodata(ax, "no trajectory-step events")
        ax.set_title("throughput")
    ax.set_xlabel("seconds since first step")
    ax = axes[0, 1]
    if d.versions:
        vs = sorted(d.versions, key=lambda v: v.ts)
        ax.step([v.ts - d.t0 for v in vs], [v.version for v in vs], where="post",
                color="C2", marker="o", markersize=3, label="policy version")
        if d.evals:
            ax.plot([e.ts - d.t0 for e in d.evals], [e.policy_version for e in d.evals],
                    "D", color="C4", markersize=5, label="evaluated")
        _rollback_lines(ax, [v.ts - d.t0 for v in d.rollbacks])
        _integer(ax.yaxis)
        ax.legend(loc="upper left")
    else:
        _nodata(ax, "no policy-version events")
    ax.set_xlabel("seconds since first step")
    ax.set_ylabel("policy version")
    ax.set_title(f"policy versions over time ({len(d.versions)} published)")
    return _png(fig)


LEARNER_KEYS = ("charts/mean_reward", "charts/mean_return", "charts/mean_value")


def learner(d: ReportData) -> bytes | None:
    """Learner diagnostics per update: every ``losses/*`` metric and the reward charts."""
    updates = [v for v in d.versions if v.reason == "update" and v.metrics]
    keys = sorted({k for v in updates for k in v.metrics if k.startswith("losses/")})
    keys += [k for k in LEARNER_KEYS if any(k in v.metrics for v in updates)]
    if not keys:
        return None
    ncols = 4
    fig, axes = _figure(ncols, nrows=(len(keys) + ncols - 1) // ncols, height=2.6)
    for ax, key in zip(axes.flat, keys):
        pts = [(v.version, v.metrics[key]) for v in updates if key in v.metrics]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", markersize=3, color="C0")
        _rollback_lines(ax, [v.version for v in d.rollbacks], label=False)
        ax.set_title(key)
        ax.set_xlabel("policy version")
        _integer(ax.xaxis)
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    return _png(fig)


#: section id -> (figure, title, caption)
FIGURES = {
    "learning_curves": (learning_curves, "Learning curves", (
        "Left: validation success rate and mean score of each evaluated policy version (eval "
        "events), at the env steps that version was trained on. Right: training success of "
        "finished trajectories (segment-closed with trajectory_done), rolling and cumulative.")),
    "reward_components": (reward_components, "Reward components", (
        "Mean of each arbiter component per scored segment, by the policy version that acted "
        "(min_policy_version). Feedback is recorded but never paid; guard:* counts vetoed "
        "claims; black: the paid total. Right: the arbiter level that decided each segment.")),
    "staleness": (staleness, "Staleness", (
        "Per trained segment: learner version at training minus the segment's "
        "min_policy_version (policy-version.trained_segments joined with segment-closed). "
        "Dashed: the configured bound (loop.max_staleness).")),
    "segments": (segments, "Segments", (
        "Length (step_end - step_start) and boundary reason of every closed segment.")),
    "throughput": (throughput, "Throughput", (
        "Env steps/s (blue) from trajectory-step timestamps and segments/s (orange) from "
        "segment-closed timestamps, in 10 s bins (finer for runs under 100 s); right: when "
        "each policy version was published and evaluated.")),
    "learner": (learner, "Learner diagnostics", (
        "Every losses/* metric and reward chart the learner attached to each update's "
        "policy-version event.")),
}


CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0;color:#1d2330;
background:#f5f6f8}main{max-width:1240px;margin:0 auto;padding:16px 24px 48px}
header{background:#1d2330;color:#f5f6f8;padding:18px 24px}header h1{margin:0 0 4px;font-size:22px}
header .meta{font-size:13px;opacity:.8}nav{margin:12px 0;font-size:13px}nav a{margin-right:14px}
section,.card{background:#fff;border-radius:8px;box-shadow:0 1px 3px rgba(0,0,0,.08)}
section{padding:14px 18px;margin:14px 0}h2{font-size:17px;margin:0 0 8px}.card{padding:10px 12px}
.cards{display:grid;grid-template-columns:repeat(auto-fill,minmax(118px,1fr));gap:10px;
margin:14px 0}.card .v{font-size:22px;font-weight:600}.card .k{font-size:12px;color:#5b6375}
img{max-width:100%;height:auto;display:block}p.cap,.cap{font-size:13px;color:#4a5263}
.nodata{color:#8a90a0;font-style:italic;padding:18px;background:#fafbfc;border-radius:6px}
table{border-collapse:collapse;font-size:13px;margin:6px 0}td,th{padding:3px 10px;
border-bottom:1px solid #e6e8ee;text-align:left;vertical-align:top}th{background:#f0f2f6}
.problems{background:#fff4e5;border-left:4px solid #f0a020;padding:8px 14px;border-radius:6px}
.warn{color:#b3261e;font-weight:600}pre{background:#f6f8fa;padding:10px;overflow:auto;
font-size:12px;border-radius:6px;max-height:600px}code{font-size:12px}
"""


def render_all(d: ReportData) -> dict[str, bytes | None | Exception]:
    """Every figure: PNG bytes, None (no data) or the exception that stopped it."""
    out: dict[str, bytes | None | Exception] = {}
    plt = _plt()
    with plt.rc_context(RC):
        for name, (fn, _, _) in FIGURES.items():
            try:
                out[name] = fn(d)
            except Exception as exc:  # noqa: BLE001 - a broken figure must not sink the page
                plt.close("all")
                out[name] = exc
    return out
