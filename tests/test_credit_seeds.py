"""``ops/bench/credit_seeds.py``: credit modes compared by their mean over seeds.

The gain of a run is its chosen version's test success over its own start (the warm start
when version 0 is one, else the base model); a mode's figure is the mean of its seeds, and
the gap between modes is the difference of those means. Checked on judgings shaped as
``llm_heldout.py`` writes them, with the arithmetic done by hand.
"""

from __future__ import annotations

import json
import math

import pytest
from conftest import load_script

seeds = load_script("ops/bench/credit_seeds.py")


def judging(start_wins: int | None, base_wins: int, best_wins: int, version: int,
            dev: list[tuple[int, float]], n: int = 96) -> dict:
    test = {"base": {"wins": base_wins, "success": base_wins / n, "version": 0},
            "best": {"wins": best_wins, "success": best_wins / n, "version": version}}
    if start_wins is not None:
        test["start"] = {"wins": start_wins, "success": start_wins / n, "version": 0}
    return {"base_success": base_wins / n, "best_success": best_wins / n,
            "start_success": None if start_wins is None else start_wins / n,
            "improvement": round((best_wins - base_wins) / n, 4),
            "best_minus_start": None if start_wins is None else round((best_wins - start_wins) / n, 4),
            "best_version": version, "test_episodes": n, "dev_episodes": 32,
            "selection": [{"version": v, "success": s} for v, s in dev], "test": test}


def test_gains_are_measured_from_each_runs_own_start_and_averaged_per_mode(tmp_path):
    runs = [("fusion", "1", judging(32, 10, 39, 14, [(0, 0.375), (8, 0.4), (14, 0.5)])),
            ("fusion", "2", judging(30, 10, 33, 8, [(0, 0.4), (8, 0.45), (15, 0.3)])),
            ("outcome", "1", judging(None, 31, 47, 14, [(0, 0.4), (14, 0.6)]))]
    s = seeds.summarise(runs)
    fusion, outcome = s["credits"]["fusion"], s["credits"]["outcome"]
    assert fusion["gains"] == {"1": round(7 / 96, 4), "2": round(3 / 96, 4)}
    assert fusion["mean_gain"] == round((round(7 / 96, 4) + round(3 / 96, 4)) / 2, 4)
    assert outcome["gains"] == {"1": round(16 / 96, 4)}  # no warm start: from the base
    assert fusion["seeds"] == 2 and outcome["seeds"] == 1
    assert fusion["chosen_test_wins"] == {"1": 39, "2": 33}
    assert fusion["start_test_wins"] == {"1": 32, "2": 30}
    assert s["gaps"]["fusion - outcome"] == round(fusion["mean_gain"] - outcome["mean_gain"], 4)
    assert s["gaps"]["outcome - fusion"] == -s["gaps"]["fusion - outcome"]
    with pytest.raises(ValueError, match="fusion:1 given twice"):
        seeds.summarise(runs + runs[:1])


def test_the_script_reads_judgings_draws_the_plot_and_explains_a_bad_flag(tmp_path, capsys):
    paths = []
    for i, h in enumerate((judging(32, 10, 39, 14, [(0, 0.375), (14, 0.5)]),
                           judging(31, 10, 35, 8, [(0, 0.4), (8, 0.45)]))):
        paths.append(tmp_path / f"h{i}.json")
        paths[-1].write_text(json.dumps(h))
    png = tmp_path / "c.png"
    assert seeds.main(["--run", f"fusion:1={paths[0]}", "--run", f"outcome:1={paths[1]}",
                       "--png", str(png)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["gaps"]["fusion - outcome"] == pytest.approx(3 / 96, abs=1e-4)
    assert png.stat().st_size > 10_000
    with pytest.raises(SystemExit):
        seeds.main(["--run", f"fusion={paths[0]}"])
    assert "expected CREDIT:SEED=PATH" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        seeds.main(["--run", f"fusion:1={tmp_path / 'missing.json'}"])
    assert "llm_heldout.py" in capsys.readouterr().err


def test_modes_sharing_a_seed_are_set_head_to_head_on_their_chosen_versions():
    """The same seed's chosen versions against each other, no start in between; a seed only
    one mode has, or judged on other test games, is left out."""
    runs = [("fusion", "2", judging(31, 10, 45, 12, [(0, 0.47), (12, 0.53)])),
            ("fusion", "3", judging(34, 10, 43, 18, [(0, 0.38), (18, 0.53)])),
            ("fusion", "4", judging(30, 10, 40, 6, [(0, 0.4), (6, 0.5)], n=64)),
            ("outcome", "2", judging(33, 10, 41, 12, [(0, 0.41), (12, 0.47)])),
            ("outcome", "3", judging(32, 10, 25, 24, [(0, 0.53), (24, 0.41)])),
            ("outcome", "4", judging(30, 10, 40, 6, [(0, 0.4), (6, 0.5)]))]
    h2h = seeds.summarise(runs)["head_to_head"]
    assert list(h2h) == ["fusion vs outcome"]
    pair = h2h["fusion vs outcome"]
    assert set(pair) == {"2", "3"}  # seed 4: 64 test games against 96
    assert pair["2"]["wins"] == [45, 41] and pair["3"]["wins"] == [43, 25]
    # pooled z by hand: seed 3, (43 - 25) / 96 over sqrt(p(1-p) 2/96) with p = 68/192
    z = (18 / 96) / (68 / 192 * (1 - 68 / 192) * 2 / 96) ** 0.5
    assert pair["3"]["p_a_above_b"] == pytest.approx(0.5 * math.erfc(z / math.sqrt(2)), rel=0.05)
    assert pair["3"]["p_a_above_b"] < 0.01 < 0.2 < pair["2"]["p_a_above_b"] < 0.5
