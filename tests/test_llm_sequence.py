"""``ops/bench/llm_sequence.py --smoke``: window contexts vs segment sequences, side by side,
with the tiny policy (the real run uses SmolLM2; its figures are in docs/llm.md)."""

from __future__ import annotations

import json

import pytest
from conftest import load_script


@pytest.mark.slow  # an end-to-end run: the full tier (the fast tier stays under 3 minutes)
def test_the_smoke_run_reports_every_figure_of_both_modes(tmp_path, capsys):
    bench = load_script("ops/bench/llm_sequence.py")
    assert bench.main(["--smoke", "--minutes", "1", "--check-episodes", "1",
                       "--draft-tokens", "3", "--out", str(tmp_path)]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for field in bench.FIELDS:
        assert set(result[field]) == {"window", "segment"}, field
    reused = result["prefill_reused_per_step"]
    assert reused["window"] == 0.0 and reused["segment"] > 0  # the cache served the prefix
    assert result["prefill_tokens_per_step"]["segment"] < result["prefill_tokens_per_step"][
        "window"]
    assert all(d <= 1e-4 for d in result["logprob_max_abs_diff"].values())
    assert result["one_pass_vs_apart_max_abs_diff"]["segment"] <= 1e-4
    assert all(v > 0 for v in result["env_steps_per_s"].values())
    # acting read drafts (exact: the log-prob checks above hold with them)
    assert all(0 < v <= 1 for v in result["draft_kept_fraction"].values())
    assert all(v > 0 for v in result["act_forwards_per_step"].values())
    assert all(0 <= v <= 1 for v in result["sampler_paused_fraction"].values())
    assert {"prefill_tokens_per_step", "learner_tokens_per_step",
            "env_steps_per_s"} <= set(result["ratios"])
    assert json.loads((tmp_path / "result.json").read_text()) == result
