"""Critic stability: prior, complete returns, and the divergence detector on a reward spike.

The spike test drives the real learner actor through the embedded bus: real segments in a
real segment store, ``scored`` events in, ``policy-version`` and ``critic-reset`` out.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from scratch import wait_until

from actors.learner import Learner
from gyre_async.compose import build_policy
from gyre_async.core.segmenter import ClosedSegment, segment_arrays
from gyre_async.policy.base import SamplingParams
from gyre_async.rl.critic import DivergenceDetector, complete_returns, value_prior
from gyre_async.storage.segments import SegmentStore
from schemas import event_id
from schemas.config import Config, LearnerConfig, PolicySection, RunSection
from schemas.events import CriticReset, Scored, TrajectoryStep
from schemas.topics import POLICY_VERSION, SCORED, TELEMETRY


def test_value_prior_and_complete_returns_hand_worked():
    # Mean step reward (0 + 0.1 + 0 + 0.3) / 4 = 0.1, gamma 0.9 -> prior 0.1 / 0.1 = 1.0.
    assert value_prior([0.0, 0.1, 0.0, 0.3], 0.9) == pytest.approx(1.0)
    assert value_prior([1.0], 1.0) == 0.0
    # Trajectory "a": segments [0,2) rewards [1, 0] and [2,4) rewards [0, 2], terminal.
    #   step 3: 2; step 2: 0 + 0.5*2 = 1; step 1: 0 + 0.5*1 = 0.5; step 0: 1 + 0.5*0.5 = 1.25
    # Trajectory "b": its terminal segment [4,5) is here but [2,4) is missing -> only the
    #   terminal segment's steps are complete; segment [0,2) is not.
    # Trajectory "c": not terminal in the batch -> nothing is complete.
    out = complete_returns(
        rewards=[[0.0, 2.0], [1.0, 0.0], [3.0], [1.0, 1.0], [5.0]],
        trajectory_ids=["a", "a", "b", "b", "c"],
        step_starts=[2, 0, 4, 0, 0],
        terminal=[True, False, True, False, False],
        gamma=0.5,
    )
    assert out == [[1.0, 2.0], [1.25, 0.5], [3.0], [None, None], [None]]


def test_detector_thresholds():
    d = DivergenceDetector(max_advantage=10.0, max_value_loss=5.0)
    assert d.check_advantages(torch.tensor([1.0, -9.9])) is None
    assert d.check_advantages(torch.tensor([1.0, -10.5])).reason == "advantage"
    assert d.check_advantages(torch.tensor([math.nan])).reason == "advantage"
    assert d.check_value_loss(4.0, 1.0) is None
    assert d.check_value_loss(math.inf, 1.0).reason == "value-loss"
    assert DivergenceDetector(0.0, 0.0).check_advantages(torch.tensor([1e9])) is None


# -- the spike, through the real learner actor -----------------------------------------------

SEG_STEPS = 12
TRAJECTORIES = 4  # per batch, 2 segments each -> 96 steps per batch


def config(tmp_path) -> Config:
    return Config(
        run=RunSection(run_id="spike", run_dir=str(tmp_path), seed=3),
        policy=PolicySection(d_model=32, n_layers=1, n_heads=2, context_tokens=48,
                             history_turns=0),
        learner=LearnerConfig(batch_steps=TRAJECTORIES * 2 * SEG_STEPS, minibatch_steps=48,
                              epochs=2, learning_rate=3e-3, value_refit_every=2,
                              max_versions=0),
    )


def make_batch(cfg: Config, policy, store: SegmentStore, batch: int,
               spike: float = 0.0) -> list[Scored]:
    """Scored segments of TRAJECTORIES two-segment trajectories, acted by ``policy``.

    Rewards: 0.1 at one step of each segment; the final step pays 1 in every other
    trajectory. ``spike`` is added to one step of the first trajectory (a poisoned reward).
    """
    rng = random.Random(batch)
    tok = policy.tokenizer
    n_ctx = 2 * SEG_STEPS + 1
    contexts = [tok.encode(f"order 1 of 4 : axe x {rng.randint(1, 2)} . need wood "
                           f"{rng.randint(0, 3)} ore {rng.randint(0, 2)} . ready no .")
                for _ in range(TRAJECTORIES * n_ctx)]
    acts = policy.act_batch(contexts, SamplingParams(max_action_tokens=4))
    segments, events = [], []
    for k in range(TRAJECTORIES):
        tid = f"b{batch}-t{k}"
        ctx, act = contexts[k * n_ctx:(k + 1) * n_ctx], acts[k * n_ctx:(k + 1) * n_ctx]
        for s in range(2):
            span = range(s * SEG_STEPS, (s + 1) * SEG_STEPS)
            done = s == 1
            steps = tuple(TrajectoryStep(
                event_id=f"{tid}-{i}", run_id="spike", producer="test", trajectory_id=tid,
                task_id=f"task-{batch}", step_index=i, policy_version=max(batch - 1, 0),
                context_tokens=ctx[i], action_tokens=act[i].tokens,
                action_logprobs=act[i].logprobs, next_context_tokens=ctx[i + 1],
                done=done and i == span[-1]) for i in span)
            seg_id = f"{tid}-s{s}"
            segments.append((seg_id, segment_arrays(ClosedSegment(
                tid, steps, "trajectory-end" if done else "max-length", terminal=done))))
            rewards = [0.0] * SEG_STEPS
            rewards[rng.randrange(SEG_STEPS)] += 0.1
            if done and k % 2 == 0:
                rewards[-1] += 1.0
            if spike and k == 0 and s == 0:
                rewards[3] += spike
            events.append((tid, seg_id, span, done, rewards))
    refs = store.write_many(segments)
    out = []
    for (tid, seg_id, span, done, rewards), ref in zip(events, refs):
        out.append(Scored(
            event_id=event_id("scored", seg_id), run_id="spike", producer="arbiter",
            key=tid, segment_id=seg_id, trajectory_id=tid, task_id=f"task-{batch}",
            address=ref.address, content_hash=ref.content_hash, step_start=span[0],
            step_end=span[-1] + 1, min_policy_version=max(batch - 1, 0),
            trajectory_done=done, success=done and rewards[-1] >= 1.0, components={},
            step_rewards=rewards, total=sum(rewards), decided_by="outcome"))
    return out


async def drive_learner(scratch_bus, cfg: Config, spikes: dict[int, float], batches: int):
    store = SegmentStore(f"{cfg.run.run_dir}/segments.zarr", durable=False)
    behaviour = build_policy(cfg)  # acts the synthetic segments (any fixed policy will do)
    versions: list = []
    async with scratch_bus.running(Learner(cfg), run_id="spike", name="learner") as runner:
        for b in range(1, batches + 1):
            scored = make_batch(cfg, behaviour, store, b, spikes.get(b, 0.0))
            await scratch_bus.publish(SCORED, *scored)

            async def trained(b=b) -> bool:
                versions[:] = await scratch_bus.events(POLICY_VERSION)
                return len(versions) > b  # v0 (init) + one update per batch

            await wait_until(trained, 60, runner)
            assert len(versions) == b + 1, "the learner did not train on the batch"
    resets = [e for e in await scratch_bus.events(TELEMETRY) if isinstance(e, CriticReset)]
    return versions, resets


async def test_reward_spike_resets_the_critic_and_training_recovers(tmp_path, scratch_bus):
    cfg = config(tmp_path)
    spike_batch, batches = 3, 6
    versions, resets = await drive_learner(scratch_bus, cfg, {spike_batch: 1e4}, batches)
    by_version = {v.version: v for v in versions}
    # Exactly one reset, announced, for the spiked batch, which was not trained on.
    assert [(r.version, r.reason, r.skipped_update) for r in resets] == [
        (spike_batch, "advantage", True)]
    assert resets[0].max_abs_advantage > cfg.learner.divergence_max_advantage
    spiked = by_version[spike_batch]
    assert spiked.metrics["critic/skipped_update"] == 1.0
    # The step shrank: every later version carries the halved learning rate.
    lr = cfg.learner.learning_rate
    assert all(by_version[v].learning_rate == lr for v in range(spike_batch))
    assert resets[0].learning_rate == pytest.approx(lr * cfg.learner.divergence_lr_shrink)
    assert all(by_version[v].learning_rate == pytest.approx(lr * 0.5)
               for v in range(spike_batch, batches + 1))
    # Recovery: the later updates train normally (no second alarm, finite and small losses,
    # raw advantages back in the normal range) and the critic refits.
    for v in range(spike_batch + 1, batches + 1):
        m = by_version[v].metrics
        assert "critic/skipped_update" not in m
        assert math.isfinite(m["losses/policy_loss"]) and m["losses/value_loss"] < 1.0
        assert m["credit/max_abs_local_advantage"] < 5.0
    assert any("losses/value_refit" in by_version[v].metrics
               for v in range(spike_batch + 1, batches + 1))


def test_exploding_value_loss_resets_the_value_head(tmp_path):
    """The other alarm: a value head driven far off (here by hand) trips the value loss."""
    from gyre_async.core.learner import LearnerCore
    from gyre_async.rl.critic import value_head

    cfg = config(tmp_path)
    store = SegmentStore(f"{tmp_path}/segments.zarr", durable=False)
    policy = build_policy(cfg)
    core = LearnerCore(cfg, policy)
    scored = make_batch(cfg, policy, store, 1)
    core.critic.resume()  # keep the poisoned head below as the starting critic
    with torch.no_grad():
        value_head(policy).bias.fill_(40.0)  # V = 40 where returns are <= 1.2
    for offset, segment in enumerate(scored):
        assert core.add(segment, (0, offset)) is None
    core.attach_arrays(store.read_many(core.buffered_addresses()))
    result = core.train()
    assert result.metrics["losses/value_loss"] > cfg.learner.divergence_max_value_loss
    assert not result.skipped  # the value-loss alarm comes after the update
    assert [r.reason for r in core.take_critic_resets()] == ["value-loss"]
    assert core.take_critic_resets() == []  # each reset is announced once
    assert float(value_head(policy).bias.detach()) == pytest.approx(core.critic.prior)
    assert core.learning_rate == pytest.approx(1.5e-3)


def test_the_prior_is_the_mean_complete_return_when_episodes_end(tmp_path):
    """Episodes that end in the first batch give the critic's prior: their mean complete
    return, not ``mean(r) / (1 - gamma)`` (rewards forever), which sits far above every
    return of a short episode and made the value loss read as divergence."""
    from gyre_async.core.learner import LearnerCore
    from gyre_async.rl.critic import CriticGuard, value_head

    cfg = config(tmp_path)
    store = SegmentStore(f"{tmp_path}/segments.zarr", durable=False)
    policy = build_policy(cfg)
    core = LearnerCore(cfg, policy)
    scored = make_batch(cfg, policy, store, 1)
    for offset, segment in enumerate(scored):
        assert core.add(segment, (0, offset)) is None
    core.attach_arrays(store.read_many(core.buffered_addresses()))
    result = core.train()
    returns = complete_returns([s.step_rewards for s in scored],
                               [s.trajectory_id for s in scored],
                               [s.step_start for s in scored],
                               [s.trajectory_done for s in scored], cfg.learner.gamma)
    flat = [r for row in returns for r in row if r is not None]
    assert len(flat) == TRAJECTORIES * 2 * SEG_STEPS  # every trajectory ended in the batch
    assert core.critic.prior == pytest.approx(sum(flat) / len(flat))
    forever = value_prior([r for s in scored for r in s.step_rewards], cfg.learner.gamma)
    assert forever > 2 * max(flat)  # what the old prior was: above every return
    assert result.metrics["losses/value_loss"] < 1.0 and not core.take_critic_resets()

    # A long task whose first batch ended no episode keeps mean(r) / (1 - gamma).
    guard = CriticGuard(cfg.learner, seed=0)
    guard.start(policy, [0.0, 0.1, 0.0, 0.3])
    assert guard.prior == pytest.approx(value_prior([0.0, 0.1, 0.0, 0.3], cfg.learner.gamma))
    assert float(value_head(policy).bias.detach()) == pytest.approx(guard.prior)
