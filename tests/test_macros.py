"""Macro-actions: expansion and its stopping rules, config, vocabulary, and both levels on
the trajectory in a real run (with the elite pool and retention on)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from gyre_async.audit.replay import replay_learner
from gyre_async.bus import open_bus
from gyre_async.bus.reading import read_events
from gyre_async.compose import action_token_ids, build_tokenizer
from gyre_async.envs import WorkshopEnv
from gyre_async.envs.macros import Macro, MacroEnv, env_steps_of, macros_from_config, with_macros
from gyre_async.envs.workshop import make_orders
from gyre_async.envs.workshop_macros import gather_sequence, workshop_macros
from gyre_async.experience.elite import ElitePool
from gyre_async.runtime.loop import run_loop
from gyre_async.storage.segments import SegmentStore
from schemas.config import Config, MacroSection
from schemas.events import PolicyVersion, SegmentClosed, SegmentDropped, TrajectoryStep
from schemas.topics import POLICY_VERSION, SEGMENT_CLOSED, TELEMETRY, TRAJECTORY_STEP


def seed_with_first_order(item: str, count: int, n_orders: int = 1) -> int:
    cfg = WorkshopEnv(n_orders=n_orders).config
    return next(s for s in range(10_000) if (o := make_orders(cfg, "t", s)[0]).item == item
                and o.count == count)


async def play(env, seed: int, actions: list[str]):
    await env.reset("t", seed)
    return [await env.step(a) for a in actions]


def test_sequence_macro_expands_and_records_primitives():
    seed = seed_with_first_order("axe", 1, n_orders=2)
    env = MacroEnv(WorkshopEnv(n_orders=2, noise_prob=0.0), workshop_macros())
    r = asyncio.run(play(env, seed, ["gather_axe"]))[0]
    assert r.info["macro"] == "gather_axe"
    assert [p.action for p in r.info["primitives"]] == list(gather_sequence("axe")) == \
        ["mine rock", "smelt ore", "chop tree", "chop tree"]
    assert all(p.ok for p in r.info["primitives"]) and "furnace 1" in r.observation
    # a plain action passes through as one step, with no macro record
    r = asyncio.run(play(env, seed, ["gather_axe", "wait_furnace", "craft"]))
    assert [p.action for p in r[1].info["primitives"]] == ["wait"]  # the ingot lands
    assert "macro" not in r[2].info and r[2].info["step"] == 6
    assert r[2].milestones and "craft ok" in r[2].observation


def test_macro_stops_on_failure_milestone_done_and_cap():
    seed = seed_with_first_order("shovel", 1)
    macros = {"bad": Macro("bad", sequence=("smelt ore", "chop tree")),
              "make shovel": Macro("make shovel", sequence=(
                  "chop tree", "chop tree", "cut stone", "craft", "chop tree")),
              "chop lots": Macro("chop lots", sequence=("chop tree",) * 50)}
    env = MacroEnv(WorkshopEnv(n_orders=1, noise_prob=0.0), macros, max_primitive_steps=5)
    bad, = asyncio.run(play(env, seed, ["bad tree"]))  # called by the first words
    assert [(p.action, p.ok) for p in bad.info["primitives"]] == [("smelt ore", False)]
    made, = asyncio.run(play(env, seed, ["make shovel"]))  # milestone and done: stop there
    assert len(made.info["primitives"]) == 4 and made.done and made.success and made.milestones
    lots, = asyncio.run(play(env, seed, ["chop lots"]))
    assert len(lots.info["primitives"]) == 5  # max_primitive_steps
    # The inner step cap counts primitive steps: a macro is cut where the episode is.
    capped = MacroEnv(WorkshopEnv(n_orders=1, max_steps=3), macros, max_primitive_steps=5)
    cut, = asyncio.run(play(capped, seed, ["chop lots"]))
    assert len(cut.info["primitives"]) == 3 and cut.truncated


def test_noop_macro_takes_no_step_and_decisions_are_capped():
    env = MacroEnv(WorkshopEnv(n_orders=1, max_steps=4), workshop_macros())
    results = asyncio.run(play(env, 0, ["wait_furnace"] * 4))  # furnace empty: nothing to do
    assert [len(r.info["primitives"]) for r in results] == [0, 0, 0, 0]
    assert [r.truncated for r in results] == [False, False, False, True]


def test_config_declares_sequences_and_scripts(tmp_path):
    section = msgspec.toml.decode(b'''
builtin = "workshop"
max_primitive_steps = 8
[define]
"fetch wood" = ["chop tree", "chop tree"]
"wait more" = "gyre_async.envs.workshop_macros:wait_for_furnace"
''', type=MacroSection)
    macros = macros_from_config(section)
    assert macros["fetch wood"].sequence == ("chop tree", "chop tree")
    assert macros["wait more"].script is not None and "gather_lamp" in macros
    cfg = Config(macros=section)
    tok = build_tokenizer(cfg)
    assert all(t != tok.unk_id for t in tok.encode("gather_lamp fetch wood wait more"))
    allowed = set(action_token_ids(cfg, tok))
    assert {*tok.encode("gather_lamp"), *tok.encode("fetch")} <= allowed
    # without macros the vocabulary (and so every checkpoint) is unchanged
    assert build_tokenizer(Config()).vocab_size == tok.vocab_size - 9  # 7 built-in names, fetch, more
    assert isinstance(with_macros(WorkshopEnv(), MacroSection()), WorkshopEnv)
    with pytest.raises(ValueError, match="module:function|cannot be loaded"):
        macros_from_config(MacroSection(define={"x y": "no_such_module:f"}))
    with pytest.raises(ValueError, match="lower-case words"):
        Macro("Gather  Axe", sequence=("chop tree",))


@pytest.mark.slow
def test_run_with_macros_elite_and_retention(tmp_path, tiny):
    """A real run: macro decisions are trained on (tokens + log-probs of the name), their
    primitive steps recorded and counted; the elite pool persists; retention holds."""
    bound = 150_000  # below what the run writes (about 200 kB)
    cfg = tiny.config(run={"run_dir": str(tmp_path)}, macros={"builtin": "workshop"},
                      elite={"capacity": 8, "mix_share": 0.25, "jump_threshold": 1e-3},
                      segmenter={"retain_bytes": bound}, learner={"max_versions": 5})
    summary = asyncio.run(run_loop(cfg)).summary

    async def read():
        async with open_bus(f"sqlite:///{tmp_path}/events.db") as bus:
            return [e async for _, e in read_events(
                bus, [TRAJECTORY_STEP, SEGMENT_CLOSED, POLICY_VERSION, TELEMETRY],
                on_bad="raise")]

    events = asyncio.run(read())
    steps = [e for e in events if isinstance(e, TrajectoryStep)]
    tok = build_tokenizer(cfg)
    macro_steps = [s for s in steps if s.macro]
    assert macro_steps, "the policy never called a macro"
    for s in macro_steps[:50]:  # the macro is what the generated text starts with
        assert s.action_text.split()[0] == s.macro == tok.decode(s.action_tokens).split()[0]
        assert len(s.action_logprobs) == len(s.action_tokens)  # credited at the policy level
        assert 0 <= len(s.primitives) <= cfg.macros.max_primitive_steps
    by_traj = {}
    for s in steps:
        by_traj.setdefault(s.trajectory_id, {})[s.step_index] = s
    for seg in (e for e in events if isinstance(e, SegmentClosed)):
        own = [by_traj[seg.trajectory_id][i] for i in range(seg.step_start, seg.step_end)]
        assert seg.env_steps == sum(env_steps_of(s) for s in own)
    assert summary["env_steps"] == sum(env_steps_of(s) for s in steps) > len(steps)
    # Elite pool: filled, mixed into batches, and the same after a restart of the learner.
    versions = [e for e in events if isinstance(e, PolicyVersion) and e.reason == "update"]
    assert versions[-1].metrics["elite/size"] > 0 and versions[-1].metrics["elite/mixed_steps"] > 0
    pool = ElitePool(str(tmp_path / "elite.zarr"), capacity=8)
    from actors.learner import Learner
    assert Learner(cfg).core.elite.hashes() == pool.hashes() != []
    # Retention deleted consumed segments, while every trained segment of the newest batch
    # (still needed by a restarted learner) and every unconsumed one is still there. (Disk
    # use itself comes back a whole chunk at a time: test_experience.py runs long enough.)
    store = SegmentStore(str(tmp_path / "segments.zarr"), read_only=True)
    live = set(store.list_segments())
    announced = {e.segment_id for e in events if isinstance(e, SegmentClosed)}
    assert live < announced
    assert set(versions[-1].trained_segments) <= live
    consumed = {sid for v in versions[:-1] for sid in v.trained_segments} | \
        {e.segment_id for e in events if isinstance(e, SegmentDropped)}
    assert announced - consumed <= live  # nothing unconsumed (unscored, buffered) is gone

    async def audit():  # the learner audit names updates whose segments retention deleted
        async with open_bus(f"sqlite:///{tmp_path}/events.db") as bus:
            return await replay_learner(bus, cfg)

    assert asyncio.run(audit()).missing
