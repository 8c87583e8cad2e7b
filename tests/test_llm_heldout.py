"""``ops/bench/llm_heldout.py``: choose a run's version on dev games, report it on test games.

Its figures are only worth reading if it plays what the evaluator played: the same weights
(loaded from the run's checkpoints), the same games, the same decoding. A short real run
(TextWorldExpress, the tiny policy, validation on dev games) checks that: the script's dev
figures of version 0 and of the last version equal the ones the run's own evaluator
published. The Wilson interval is checked against its definition, solved by bisection.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import msgspec
import pytest
import textworld_express  # noqa: F401 - the test extra installs the simulator
from conftest import load_script

from gyre_async.config import load_config
from gyre_async.core.evaluation import wilson_interval

ROOT = Path(__file__).resolve().parents[1]


def wilson_by_bisection(successes: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The interval's ends are the p where |phat - p| = z * sqrt(p (1 - p) / n)."""
    phat = successes / n

    def outside(p: float) -> float:
        return abs(phat - p) - z * math.sqrt(p * (1 - p) / n)

    def root(lo: float, hi: float) -> float:  # outside(lo) and outside(hi) differ in sign
        for _ in range(200):
            mid = (lo + hi) / 2
            if (outside(mid) > 0) == (outside(lo) > 0):
                lo = mid
            else:
                hi = mid
        return (lo + hi) / 2

    low = 0.0 if successes == 0 else root(0.0, phat)
    high = 1.0 if successes == n else root(phat, 1.0)
    return low, high


@pytest.mark.parametrize("successes,n", [(0, 32), (1, 32), (19, 64), (22, 32), (32, 32),
                                         (47, 96)])
def test_wilson_interval_matches_its_definition(successes, n):
    low, high = wilson_interval(successes, n)
    ref_low, ref_high = wilson_by_bisection(successes, n)
    assert low == pytest.approx(ref_low, abs=1e-9)
    assert high == pytest.approx(ref_high, abs=1e-9)


@pytest.fixture(scope="module")
def heldout():
    return load_script("ops/bench/llm_heldout.py")


def test_one_sided_p_value(heldout):
    assert heldout.two_proportion_p(20, 20, 64) == pytest.approx(0.5)
    assert heldout.two_proportion_p(19, 33, 64) < 0.01 < heldout.two_proportion_p(19, 24, 64)
    assert heldout.two_proportion_p(0, 0, 64) == 1.0


def test_the_choice_is_among_updates_only(heldout):
    rows = [{"version": 0, "success": 0.9, "score": 1.0, "candidate": False},
            {"version": 2, "success": 0.5, "score": 0.6, "candidate": True},
            {"version": 4, "success": 0.5, "score": 0.7, "candidate": True},
            {"version": 5, "success": 0.5, "score": 0.7, "candidate": True}]
    assert heldout.choose(rows)["version"] == 4  # success, then score, then the earlier


def test_milestones_decide_where_every_candidate_lost_with_the_same_score(heldout):
    """Simon Says scores every lost game -1: with nothing won, the candidate whose games
    reached more milestones is chosen, not the earliest."""
    rows = [{"version": 8, "success": 0.0, "score": -1.0, "milestones": 5.0, "candidate": True},
            {"version": 32, "success": 0.0, "score": -1.0, "milestones": 7.3, "candidate": True},
            {"version": 40, "success": 0.0, "score": -1.0, "milestones": 6.8, "candidate": True},
            {"version": 48, "success": 0.0, "score": -1.0, "candidate": True}]  # kept from before
    assert heldout.choose(rows)["version"] == 32


@pytest.mark.slow  # an end-to-end run: the full tier (the fast tier stays under 3 minutes)
def test_dev_figures_equal_the_runs_own_evaluator(heldout, tmp_path, monkeypatch):
    from gyre_async.bus import open_bus
    from gyre_async.bus.reading import read_events
    from gyre_async.runtime.loop import run_loop
    from schemas.events import EvalResult
    from schemas.topics import EVAL

    monkeypatch.setenv("GYRE_CACHE", str(tmp_path / "cache"))
    s = msgspec.structs.replace
    cfg = load_config(ROOT / "ops" / "configs" / "twx.toml")
    run_dir = str(tmp_path / "run")
    cfg = s(cfg, run=s(cfg.run, run_dir=run_dir),
            learner=s(cfg.learner, max_versions=3, batch_steps=64, minibatch_steps=32),
            evaluator=s(cfg.evaluator, every_versions=100, seeds=list(range(8))),
            loop=s(cfg.loop, max_wall_s=120))
    asyncio.run(run_loop(cfg))
    published: dict[int, EvalResult] = {}

    async def evals():
        async with open_bus(f"sqlite:///{run_dir}/events.db") as bus:
            async for _, e in read_events(bus, [EVAL], on_bad="raise", run_id=cfg.run.run_id):
                if isinstance(e, EvalResult):
                    published.setdefault(e.policy_version, e)

    asyncio.run(evals())
    assert 0 in published and 3 in published  # version 0 and the final one

    out = tmp_path / "heldout.json"
    assert heldout.main(["--run-dir", run_dir, "--engine", "torch", "--every", "2",
                         "--dev-episodes", "8", "--test-episodes", "8",
                         "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {e["version"]: e for e in result["selection"]}
    assert sorted(rows) == [0, 2, 3]  # version 0 for reference, every 2nd update, the last
    assert not rows[0]["candidate"] and rows[2]["candidate"] and rows[3]["candidate"]
    for version in (0, 3):
        assert rows[version]["success"] == published[version].success_rate
        assert rows[version]["score"] == pytest.approx(published[version].mean_score, abs=1e-4)
        assert rows[version]["length"] == pytest.approx(published[version].mean_length,
                                                        abs=1e-2)
    best = result["best_version"]
    assert best in (2, 3) and result["test"]["best"]["version"] == best
    assert result["test"]["base"]["episodes"] == 8 and result["final_version"] == 3
    low, _ = wilson_interval(result["test"]["best"]["wins"], 8)
    assert result["best_success_ci_low"] == pytest.approx(low, abs=1e-4)
    assert Path(result["png"]).exists()
    assert result["start_success"] is None  # version 0 is the init, not a warm start

    # Judging again plays nothing: every play is kept beside the run, the same figures
    async def no_play(*args, **kwargs):
        raise AssertionError("a kept play was played again")

    monkeypatch.setattr(heldout, "play", no_play)
    again = tmp_path / "again.json"
    assert heldout.main(["--run-dir", run_dir, "--engine", "torch", "--every", "2",
                         "--dev-episodes", "8", "--test-episodes", "8",
                         "--out", str(again)]) == 0
    kept = json.loads(again.read_text())
    assert kept["selection"] == result["selection"] and kept["test"] == result["test"]
    assert (tmp_path / "heldout-plays.jsonl").exists()


def test_env_params_keep_the_equals_signs_of_their_values(heldout):
    assert heldout.env_overrides(["params=numLocations=9,includeDoors=0", "max_steps=30"]) == {
        "params": "numLocations=9,includeDoors=0", "max_steps": 30}
    with pytest.raises(SystemExit, match="KEY=VALUE"):
        heldout.env_overrides(["numLocations"])


def test_concurrency_caps_the_games_at_once_and_keys_the_play(heldout):
    """Fewer games at once hold fewer contexts' keys/values; a sampled play's draws depend on
    which games share a batch, so a capped play is a play of its own."""
    cfg = load_config(ROOT / "ops" / "configs" / "twx.toml")
    own = heldout.split_config(cfg, "test", 8, "torch")
    capped = heldout.split_config(cfg, "test", 8, "torch", None, 3)
    assert own.evaluator.concurrency == cfg.evaluator.concurrency
    assert capped.evaluator.concurrency == 3
    assert capped.evaluator.seeds == own.evaluator.seeds
    assert heldout.PlayBook.key(capped, "torch", "base") != heldout.PlayBook.key(own, "torch",
                                                                                 "base")
    with pytest.raises(SystemExit):
        heldout.main(["--run-dir", "x", "--concurrency", "-1"])


def test_a_play_is_kept_by_its_weights_and_game_settings(heldout, tmp_path):
    cfg = load_config(ROOT / "ops" / "configs" / "twx.toml")
    s = msgspec.structs.replace
    test = heldout.split_config(cfg, "test", 8, "torch")
    key = heldout.PlayBook.key(test, "torch", "base")
    # the run's name, directory, budget and learner do not change a game
    other_run = s(test, run=s(test.run, run_dir="/elsewhere", run_id="another"),
                  loop=s(test.loop, max_wall_s=1.0),
                  learner=s(test.learner, learning_rate=1.0))
    assert heldout.PlayBook.key(other_run, "torch", "base") == key
    # nor do the training plays' temperature and group size; the sampler's batching wait does
    hotter = s(test, sampler=s(test.sampler, temperature=1.0, group_size=8, num_envs=3))
    assert heldout.PlayBook.key(hotter, "torch", "base") == key
    assert heldout.PlayBook.key(s(test, sampler=s(test.sampler, batch_wait_s=0.5)), "torch",
                                "base") != key
    # the weights, the split, the games, the seed, the decoding and the engine do
    assert len({key, heldout.PlayBook.key(test, "torch", "ab12"),
                heldout.PlayBook.key(heldout.split_config(cfg, "dev", 8, "torch"), "torch",
                                     "base"),
                heldout.PlayBook.key(heldout.split_config(cfg, "test", 9, "torch"), "torch",
                                     "base"),
                heldout.PlayBook.key(s(test, run=s(test.run, seed=test.run.seed + 1)),
                                     "torch", "base"),
                heldout.PlayBook.key(s(test, evaluator=s(test.evaluator, temperature=0.3)),
                                     "torch", "base"),
                heldout.PlayBook.key(test, "vllm", "base")}) == 7

    path = tmp_path / "plays.jsonl"
    book = heldout.PlayBook(str(path))
    assert book.get(key) is None
    book.put(key, {"wins": 3, "episodes": 8})
    with open(path, "a") as f:
        f.write('{"key": "cut sh')  # a write cut short: ignored, that play runs again
    reread = heldout.PlayBook(str(path))
    assert reread.get(key) == {"wins": 3, "episodes": 8} and len(reread.kept) == 1


def test_a_torch_run_is_judged_by_vllm_with_its_versions_merged(heldout):
    cfg = load_config(ROOT / "ops" / "configs" / "twx.toml")
    s = msgspec.structs.replace
    hf = s(cfg, policy=s(cfg.policy, backend="hf"))
    judged = heldout.vllm_judged(hf, "vllm")
    assert judged.policy.backend == "vllm" and judged.policy.vllm_lora == "merged"
    assert judged.policy.model == hf.policy.model and judged.policy.lora.rank == hf.policy.lora.rank
    assert heldout.PlayBook.key(judged, "vllm", "base") != heldout.PlayBook.key(hf, "torch", "base")
    assert heldout.vllm_judged(hf, "torch") is hf  # torch plays the run as it ran
    vllm_run = s(cfg, policy=s(cfg.policy, backend="vllm"))
    assert heldout.vllm_judged(vllm_run, "vllm") is vllm_run  # its own vllm_lora setting
    tiny = s(cfg, policy=s(cfg.policy, backend="tiny"))
    with pytest.raises(SystemExit, match="only a pretrained model"):
        heldout.vllm_judged(tiny, "vllm")
