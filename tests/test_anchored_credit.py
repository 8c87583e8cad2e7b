"""Anchored credit: against its slow reference, and on a hand-made group of three games."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_advantages import slow_anchored_credit

from gyre_async.config import validate
from gyre_async.core.learner_batch import BatchItem, anchor_key, prepare_batch
from gyre_async.core.segmenter import ClosedSegment, segment_arrays
from gyre_async.errors import ConfigError
from gyre_async.rl.fusion import anchored_credit
from schemas.events import Scored, TrajectoryStep

FLOATS = st.floats(min_value=-10.0, max_value=10.0, allow_nan=False, width=32)


@st.composite
def anchored_cases(draw):
    """Random ragged segments, returns, anchors from a small alphabet (so groups form, some
    of equal returns) and outcomes, NaN where unknown."""
    batch, horizon = draw(st.integers(1, 6)), draw(st.integers(1, 8))
    lengths = draw(st.lists(st.integers(0, horizon), min_size=batch, max_size=batch))
    values = st.sampled_from([0.0, 1.0, 2.5]) | FLOATS
    returns = draw(st.lists(st.lists(values, min_size=horizon, max_size=horizon),
                            min_size=batch, max_size=batch))
    anchors = [draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)) for n in lengths]
    g = draw(st.lists(FLOATS | st.just(math.nan), min_size=batch, max_size=batch))
    mask = [[1.0 if t < n else 0.0 for t in range(horizon)] for n in lengths]
    return returns, mask, anchors, g


@settings(max_examples=150, deadline=None)
@given(anchored_cases())
def test_anchored_credit_matches_slow_reference(case):
    returns, mask, anchors, g = case
    f64 = torch.float64
    adv, w, compared = anchored_credit(torch.tensor(returns, dtype=f64), torch.tensor(mask),
                                       anchors, torch.tensor(g, dtype=f64))
    slow, slow_w = slow_anchored_credit(returns, mask, anchors, g)
    assert torch.allclose(adv, torch.tensor(slow, dtype=f64), atol=1e-6)
    assert w.tolist() == slow_w
    known = [x if x == x else 0.0 for x in g]
    moved = sum(1 for i, row in enumerate(slow) for t, a in enumerate(row)
                if mask[i][t] and a != known[i])
    assert compared >= moved  # every step that moved off its outcome was compared


def test_a_key_per_real_step_is_required():
    with pytest.raises(ValueError, match="anchor keys"):
        anchored_credit(torch.zeros(1, 3), torch.tensor([[1, 1, 0]]), [[0]],
                        torch.tensor([math.nan]))


class FlatCritic:
    """A critic that knows nothing (V = 0): anchored credit must not need one."""

    def values(self, contexts: list[list[int]]) -> torch.Tensor:
        return torch.zeros(len(contexts))

    def evaluate(self, contexts, actions):
        from gyre_async.policy.base import EvalOutput
        zeros = torch.zeros(len(actions), max(len(a) for a in actions))
        return EvalOutput(logprobs=zeros, entropy=zeros, values=self.values(contexts),
                          mask=zeros)


def _game(tid: str, actions: list[int], rewards: list[float], task: str = "simon:7"
          ) -> BatchItem:
    """One game as one segment: each context is the prompt and every action so far (so two
    games share a context exactly while they have acted alike), as in Simon Says."""
    prompt = [11, 12, 13]
    contexts = [prompt + actions[:i] for i in range(len(actions) + 1)]
    steps = tuple(TrajectoryStep(
        event_id=f"{tid}-{i}", run_id="r", producer="test", trajectory_id=tid, task_id=task,
        step_index=i, policy_version=0, context_tokens=contexts[i], action_tokens=[a],
        action_logprobs=[-0.1], next_context_tokens=contexts[i + 1],
        done=i == len(actions) - 1) for i, a in enumerate(actions))
    arrays = segment_arrays(ClosedSegment(tid, steps, "trajectory-end", terminal=True))
    scored = Scored(
        event_id=f"scored-{tid}", run_id="r", producer="arbiter", key=tid, segment_id=tid,
        trajectory_id=tid, task_id=task, address="a", content_hash="h", step_start=0,
        step_end=len(actions), min_policy_version=0, trajectory_done=True,
        success=rewards[-1] > 0, components={}, step_rewards=rewards, total=sum(rewards),
        decided_by="outcome")
    return BatchItem(scored, arrays)


def test_the_step_where_the_games_part_takes_the_blame_and_shared_steps_cancel():
    won = [0.1, 0.1, 1.1]  # milestone, milestone, the last milestone and the win
    games = [_game("a", [5, 6, 7], won), _game("b", [5, 6, 7], won),
             _game("c", [5, 9], [0.1, -1.0])]  # c parts at step 1 with a wrong action, loses
    outcomes = [1.3, 1.3, -0.9]
    mean = sum(outcomes) / 3
    std = (sum((o - mean) ** 2 for o in outcomes) / 2) ** 0.5
    g = [(o - mean) / (std + 1e-6) for o in outcomes]
    prep = prepare_batch(FlatCritic(), games, 1.0, 0.95, g, "anchored")
    adv = prep.advantages.tolist()
    a, b, c = adv[0:3], adv[3:6], adv[6:8]
    step = [x - g[k] for k, x in zip([0, 0, 0, 1, 1, 1, 2, 2], adv)]  # anchor part
    # step 0: one context, one action for all three: the anchor parts sum to zero
    assert step[0] + step[3] + step[6] == pytest.approx(0.0, abs=1e-5)
    # step 1: one context again; c's wrong action gets the most negative advantage of all
    assert c[1] == min(adv) and step[7] < 0 < step[1] == step[4]
    # step 2 is reached by a and b alone, with equal returns: no comparison
    assert step[2] == pytest.approx(0.0, abs=1e-6) and step[5] == pytest.approx(0.0, abs=1e-6)
    assert prep.anchored_steps == 6 and prep.credit_stats()["credit/anchored_steps"] == 6.0
    assert a == b


def test_a_group_that_played_alike_gives_no_signal():
    won = [0.1, 0.1, 1.1]
    games = [_game(t, [5, 6, 7], won) for t in "abc"]
    prep = prepare_batch(FlatCritic(), games, 1.0, 0.95, [0.0, 0.0, 0.0], "anchored")
    assert bool((prep.advantages == 0).all()) and prep.anchored_steps == 0


def test_other_tasks_never_share_an_anchor():
    assert anchor_key("simon:7", [1, 2, 3]) != anchor_key("simon:8", [1, 2, 3])
    assert anchor_key("simon:7", [1, 2, 3]) == anchor_key("simon:7", [1, 2, 3])
    games = [_game("a", [5, 6], [0.1, 1.1], "simon:1"), _game("b", [5, 9], [0.1, -1.0], "simon:2")]
    prep = prepare_batch(FlatCritic(), games, 1.0, 0.95, [math.nan, math.nan], "anchored")
    assert bool((prep.advantages == 0).all())


def test_anchored_credit_without_groups_is_refused_with_the_fix(tiny):
    with pytest.raises(ConfigError, match="group_size >= 2"):
        validate(tiny.config(learner={"credit": "anchored"}))
    validate(tiny.config(learner={"credit": "anchored"}, sampler={"group_size": 4},
                         run={"mode": "sync"}))


def test_a_run_with_anchored_credit_compares_steps_and_replays_bit_for_bit(tiny):
    """The tiny loop in sync mode, one group per round: the groups' games share contexts,
    some updates compare steps at anchors, and ``gyre replay learner`` re-derives every
    update's advantages from the log (anchors come from the segments alone)."""
    import asyncio

    from gyre_async.audit.replay import replay_learner
    from gyre_async.bus import open_bus
    from gyre_async.bus.reading import read_events
    from gyre_async.runtime.loop import run_loop
    from schemas.events import PolicyVersion
    from schemas.topics import POLICY_VERSION

    base = tiny.config()
    cfg = tiny.config(run={"mode": "sync"}, learner={"credit": "anchored", "max_versions": 4},
                      sampler={"group_size": base.sampler.num_envs})
    validate(cfg)
    asyncio.run(run_loop(cfg))

    async def audit():
        async with open_bus(f"sqlite:///{cfg.run.run_dir}/events.db") as bus:
            updates = [e async for _, e in read_events(bus, [POLICY_VERSION])
                       if isinstance(e, PolicyVersion) and e.reason == "update"]
            return updates, await replay_learner(bus, cfg)

    updates, report = asyncio.run(audit())
    assert len(updates) >= 3
    assert sum(u.metrics["credit/anchored_steps"] for u in updates) > 0
    assert report.differences == 0 and report.replayed_outputs == len(updates), report
