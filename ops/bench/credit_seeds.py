"""Credit modes across seeds: the held-out judgings of several LLM runs, side by side.

One run of ~15 updates moves its chosen version's test success by ±0.1 from its seed alone
(docs/training.md, "Batch shape, a second seed, and anchored credit"), so a credit mode is
judged by its mean over seeds, never by one run. This script reads the ``heldout.json`` of
each run (``llm_heldout.py``'s output), labelled ``CREDIT:SEED=PATH``, and prints per credit
mode the gain of each seed's chosen version over its own start (``best_minus_start``, or
``best - base`` when version 0 is the base model), their mean, and the gap between modes;
and draws the curves the issue asks for: dev-game success per policy version, one line per
run, coloured by credit mode, each run's start as a dotted line, and the test-game gains per
seed beside them. Where two modes share a seed (the same test games), ``head_to_head``
sets their chosen versions against each other directly, with no start in between: each
judging draws its start's plays afresh, and those differ by a few wins from one judging to
the next.

    python ops/bench/credit_seeds.py --run fusion:1=runs/a/heldout.json \\
        --run fusion:2=runs/b/heldout.json --run outcome:1=runs/c/heldout.json \\
        --png docs/llm-simon-credit.png

Last line, one JSON object:
{"bench": "credit_seeds", "credits": {CREDIT: {"gains": {SEED: x}, "mean_gain": x,
 "seeds": n, "chosen_test_wins": {SEED: w}, ...}}, "gaps": {"A - B": x},
 "head_to_head": {"A vs B": {SEED: {"wins": [a, b], "p_a_above_b": p}}}, "png": path}
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys

from _common import print_result, two_proportion_p

COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")


def parse_run(text: str) -> tuple[str, str, str]:
    """``CREDIT:SEED=PATH`` -> (credit, seed, path), with an error that shows the form."""
    label, sep, path = text.partition("=")
    credit, colon, seed = label.partition(":")
    if not (sep and colon and credit and seed and path):
        raise argparse.ArgumentTypeError(
            f"--run {text!r}: expected CREDIT:SEED=PATH, e.g. fusion:2=runs/x/heldout.json")
    return credit, seed, path


def gain(heldout: dict) -> float:
    """What RL added, as ``llm_heldout.py`` measured it: the chosen version's test success
    minus its start's (``best_minus_start``, when version 0 is a warm start), else minus the
    base model's (``improvement``), on the same test games."""
    start = heldout.get("best_minus_start")
    return heldout["improvement"] if start is None else start


def summarise(runs: list[tuple[str, str, dict]]) -> dict:
    """Per credit mode: each seed's gain, chosen version and test wins, and the mean gain;
    ``gaps``: the difference of mean gains for every ordered pair of modes."""
    credits: dict[str, dict] = {}
    for credit, seed, h in runs:
        c = credits.setdefault(credit, {"gains": {}, "chosen_version": {},
                                        "chosen_test_wins": {}, "start_test_wins": {},
                                        "test_episodes": {}})
        if seed in c["gains"]:
            raise ValueError(f"{credit}:{seed} given twice")
        test = h["test"]
        start = test.get("start") or test["base"]
        c["gains"][seed] = gain(h)
        c["chosen_version"][seed] = h["best_version"]
        c["chosen_test_wins"][seed] = test["best"]["wins"]
        c["start_test_wins"][seed] = start["wins"]
        c["test_episodes"][seed] = h["test_episodes"]
    for c in credits.values():
        c["seeds"] = len(c["gains"])
        c["mean_gain"] = round(statistics.fmean(c["gains"].values()), 4)
    gaps = {f"{a} - {b}": round(credits[a]["mean_gain"] - credits[b]["mean_gain"], 4)
            for a, b in itertools.permutations(credits, 2)}
    return {"bench": "credit_seeds", "credits": credits, "gaps": gaps,
            "head_to_head": head_to_head(credits)}


def head_to_head(credits: dict[str, dict]) -> dict[str, dict]:
    """For each pair of modes (in the order given) and each seed both judged on as many test
    games: the chosen versions' test wins, and the one-sided p that the first mode's is the
    higher success (``llm_heldout.py``'s test)."""
    pairs: dict[str, dict] = {}
    for a, b in itertools.combinations(credits, 2):
        ca, cb = credits[a], credits[b]
        shared = {}
        for seed, n in ca["test_episodes"].items():
            if cb["test_episodes"].get(seed) != n:
                continue
            wa, wb = ca["chosen_test_wins"][seed], cb["chosen_test_wins"][seed]
            shared[seed] = {"wins": [wa, wb],
                            "p_a_above_b": float(f"{two_proportion_p(wb, wa, n):.2g}")}
        if shared:
            pairs[f"{a} vs {b}"] = shared
    return pairs


def plot(runs: list[tuple[str, str, dict]], summary: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, gains) = plt.subplots(1, 2, figsize=(10, 3.9),
                                        gridspec_kw={"width_ratios": [2.2, 1]})
    colour = {c: COLOURS[i % len(COLOURS)] for i, c in enumerate(summary["credits"])}
    styles = itertools.cycle(("-", "--", "-.", (0, (1, 1))))
    for credit, seed, h in runs:
        sel = h["selection"]
        ls = next(styles)
        curves.plot([e["version"] for e in sel], [e["success"] for e in sel], marker="o",
                    ls=ls, color=colour[credit], label=f"{credit}, seed {seed}")
        curves.axhline(sel[0]["success"], color=colour[credit], ls=":", lw=0.8, alpha=0.7)
    curves.set_xlabel("policy version")
    curves.set_ylabel(f"dev games won ({runs[0][2]['dev_episodes']})")
    curves.set_title("dev success per version (dotted: each run's start)", fontsize=9)
    curves.legend(fontsize=7)
    for i, (credit, c) in enumerate(summary["credits"].items()):
        ys = list(c["gains"].values())
        # seeds side by side, so that equal gains (whole games of 96) stay apart
        xs = [i + 0.12 * (k - (len(ys) - 1) / 2) for k in range(len(ys))]
        gains.scatter(xs, ys, color=colour[credit], zorder=3)
        for x, y, seed in zip(xs, ys, c["gains"]):
            gains.annotate(seed, (x, y), xytext=(3, 2), textcoords="offset points", fontsize=6)
        gains.hlines(c["mean_gain"], i - 0.25, i + 0.25, color=colour[credit], lw=2)
    gains.axhline(0.0, color="gray", ls=":")
    gains.set_xticks(range(len(summary["credits"])), list(summary["credits"]), fontsize=8)
    gains.set_ylabel("chosen - start, test games")
    gains.set_title("gain per seed (bar: mean)", fontsize=9)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="append", type=parse_run, required=True,
                   metavar="CREDIT:SEED=PATH", help="a run's heldout.json (repeat the flag)")
    p.add_argument("--png", default="credit-seeds.png", help="where the plot goes")
    p.add_argument("--title", default="credit modes across seeds (chosen on dev games, "
                                      "gains on test games)")
    p.add_argument("--out", default="", help="also write the result here (indented JSON)")
    args = p.parse_args(argv)
    runs = []
    for credit, seed, path in args.run:
        try:
            with open(path) as f:
                runs.append((credit, seed, json.load(f)))
        except (OSError, json.JSONDecodeError) as e:
            p.error(f"--run {credit}:{seed}: cannot read {path} ({e}); give a heldout.json "
                    "that ops/bench/llm_heldout.py wrote")
    summary = summarise(runs)
    plot(runs, summary, args.png, args.title)
    print_result({**summary, "png": args.png}, args.out or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
