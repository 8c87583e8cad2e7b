"""Exploration: the annealing schedule, adaptive parameter-space noise, policy distances,
and the behaviour log-probs the sampler records under both."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import pytest
import torch
from conftest import TinyConfig
from hypothesis import given, settings
from hypothesis import strategies as st
from scratch import wait_until

from actors.sampler import Sampler
from gyre_async.compose import build_policy, build_tokenizer, save_weights
from gyre_async.core.exploration import PerturbedPolicyHolder, sampling_params_at
from gyre_async.core.probes import probe_contexts
from gyre_async.policy.base import SamplingParams
from gyre_async.policy.torch_policy import _behaviour_logp
from gyre_async.rl.exploration import AdaptiveParamNoise, anneal
from gyre_async.rl.policy_distance import mean_kl, relative_param_change
from gyre_async.storage.checkpoints import CheckpointStore
from schemas import event_id
from schemas.events import PolicyVersion, TrajectoryStep
from schemas.topics import POLICY_VERSION, TRAJECTORY_STEP


def exploring(tiny: TinyConfig, num_envs: int = 8, **exploration):
    """The tiny config sampling wide (temperature 1.6, top-p 1) with these exploration settings."""
    return tiny.config(sampler={"num_envs": num_envs, "temperature": 1.6, "top_p": 1.0,
                                "exploration": exploration})


# -- schedule -------------------------------------------------------------------------------

@settings(max_examples=200, deadline=None, database=None)
@given(start=st.floats(0.1, 5), end=st.floats(0.1, 5), x=st.floats(0, 1), y=st.floats(0, 1),
       shape=st.sampled_from(["linear", "cosine"]))
def test_anneal_moves_monotonically_from_start_to_end(start, end, x, y, shape):
    assert anneal(start, end, 0.0, shape) == start
    assert anneal(start, end, 1.0, shape) == pytest.approx(end)
    assert anneal(start, end, 7.0, shape) == anneal(start, end, 1.0, shape)  # clamped
    lo, hi = sorted((x, y))
    a, b = anneal(start, end, lo, shape), anneal(start, end, hi, shape)
    assert (b - a) * (end - start) >= -1e-12  # never moves back towards the start
    assert min(start, end) - 1e-12 <= a <= max(start, end) + 1e-12


def test_sampling_params_follow_the_policy_version(tiny):
    cfg = exploring(tiny, temperature_end=0.6, top_p_end=0.8, anneal_versions=10, shape="linear")
    assert sampling_params_at(cfg, 0) == SamplingParams(1.6, 1.0, cfg.policy.max_action_tokens)
    mid = sampling_params_at(cfg, 5)
    assert (mid.temperature, mid.top_p) == pytest.approx((1.1, 0.9))
    for v in (10, 11, 500):
        end = sampling_params_at(cfg, v)
        assert (end.temperature, end.top_p) == pytest.approx((0.6, 0.8))
    cos = exploring(tiny, temperature_end=0.6, anneal_versions=10, shape="cosine")
    assert sampling_params_at(cos, 2).temperature > sampling_params_at(cfg, 2).temperature
    assert sampling_params_at(exploring(tiny), 1000).temperature == 1.6  # no schedule: constant


# -- distances against slow references -----------------------------------------------------

def mean_kl_reference(logp_p: list[list[float]], logp_q: list[list[float]]) -> float:
    """Slow, obviously-correct mean KL(p || q): loops over rows and tokens."""
    total = 0.0
    for row_p, row_q in zip(logp_p, logp_q):
        kl = 0.0
        for lp, lq in zip(row_p, row_q):
            if lp == -math.inf:
                continue
            kl += math.exp(lp) * (lp - lq)
        total += kl
    return total / len(logp_p)


def relative_param_change_reference(old: dict[str, torch.Tensor],
                                    new: dict[str, torch.Tensor]) -> float:
    """Slow reference: element by element."""
    num = den = 0.0
    for name, a in old.items():
        if not a.is_floating_point():
            continue
        for x, y in zip(a.reshape(-1).tolist(), new[name].reshape(-1).tolist()):
            num += (y - x) ** 2
            den += x * x
    return math.sqrt(num / den) if den > 0 else 0.0


@settings(max_examples=60, deadline=None, database=None)
@given(rows=st.integers(1, 4), cols=st.integers(2, 6), seed=st.integers(0, 10_000),
       masked=st.booleans())
def test_mean_kl_matches_reference(rows, cols, seed, masked):
    g = torch.Generator().manual_seed(seed)
    logits_p, logits_q = torch.randn(rows, cols, generator=g), torch.randn(rows, cols, generator=g)
    if masked:  # a disallowed token: -inf under both policies
        logits_p[:, 0] = logits_q[:, 0] = -math.inf
    lp, lq = torch.log_softmax(logits_p, -1), torch.log_softmax(logits_q, -1)
    assert mean_kl(lp, lq) == pytest.approx(mean_kl_reference(lp.tolist(), lq.tolist()),
                                            rel=1e-4, abs=1e-6)
    assert mean_kl(lp, lp) == pytest.approx(0.0, abs=1e-6)
    assert mean_kl(lp, lq) >= -1e-6


@settings(max_examples=60, deadline=None, database=None)
@given(seed=st.integers(0, 10_000), scale=st.floats(0.0, 2.0))
def test_relative_param_change_matches_reference(seed, scale):
    g = torch.Generator().manual_seed(seed)
    old = {"a": torch.randn(3, 4, generator=g), "b": torch.randn(5, generator=g),
           "step": torch.tensor(3)}
    new = {k: (v + scale * torch.randn(v.shape, generator=g) if v.is_floating_point() else v)
           for k, v in old.items()}
    assert relative_param_change(old, new) == pytest.approx(
        relative_param_change_reference(old, new), rel=1e-9, abs=1e-12)


def test_adaptive_rule_is_plappert():
    noise = AdaptiveParamNoise(target=0.1, initial_std=1.0, alpha=2.0)
    assert noise.adapt(0.05) == 2.0 and noise.adapt(0.2) == 1.0 and noise.adapt(0.1) == 0.5
    with pytest.raises(ValueError, match="alpha > 1"):
        AdaptiveParamNoise(0.1, 1.0, 1.0)


# -- parameter-space noise reaches its target ----------------------------------------------

def _checkpoint(cfg, tmp_path: Path, version: int, seed: int):
    policy = build_policy(cfg, build_tokenizer(cfg))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=g))
    # in the run's checkpoint root: the only place the sampler reads checkpoints from
    return save_weights(CheckpointStore(f"{cfg.run.run_dir}/checkpoints"), policy, version), policy


@pytest.fixture
def one_thread():
    """Small forward passes run faster on one thread, and far faster on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_param_noise_adapts_to_the_target_kl(tmp_path, tiny, one_thread):
    target = 0.05
    cfg = exploring(tiny, param_noise_target_kl=target, param_noise_initial_std=0.004,
               param_noise_adapt=1.15, param_noise_probe_contexts=32)
    ref, _ = _checkpoint(cfg, tmp_path, 0, seed=1)
    holder = PerturbedPolicyHolder(build_policy(cfg, build_tokenizer(cfg)), cfg, seed=3)
    holder.load(ref.address, ref.sha256, 0)
    holder.recent.extend(asyncio.run(probe_contexts(cfg, holder.policy.tokenizer, 32, 9000)))
    first = holder.measure_kl()
    kls = [holder.adapt_now() for _ in range(45)]
    settled = kls[-25:]
    mean = sum(settled) / len(settled)
    # From std 0.004 the KL starts far below the target; the rule climbs (~15 steps of
    # 1.15x), then hovers around it: the mean of the last 25 measurements is on target.
    assert first < target / 10
    assert abs(mean - target) / target < 0.25, (mean, settled)
    print(f"param noise: first KL {first:.5f}, mean of last 25 {mean:.4f} "
          f"(target {target}), std {holder.noise.std:.4f}")
    assert holder.noise.std > 0.004 * 1.15 ** 8


def test_perturbed_actions_carry_the_perturbed_policys_logprobs(tmp_path, tiny):
    cfg = exploring(tiny, param_noise_target_kl=0.05, param_noise_initial_std=0.05,
               temperature_end=0.7, top_p_end=0.9, anneal_versions=4)
    ref, clean = _checkpoint(cfg, tmp_path, 0, seed=2)
    holder = PerturbedPolicyHolder(build_policy(cfg, build_tokenizer(cfg)), cfg, seed=5)
    holder.load(ref.address, ref.sha256, 5)  # past the schedule: temperature 0.7, top-p 0.9
    contexts = asyncio.run(probe_contexts(cfg, clean.tokenizer, 16, 7000))
    ignored = SamplingParams(temperature=3.0, max_action_tokens=4)  # the schedule decides
    actions, version = holder.act(contexts, ignored, seed=11)
    params = holder.params_now()
    assert version == 5 and (params.temperature, params.top_p) == pytest.approx((0.7, 0.9))
    perturbed_lp = _behaviour_logp(holder.policy.next_token_logprobs(contexts), params)
    clean_lp = _behaviour_logp(clean.next_token_logprobs(contexts), params)
    got = torch.tensor([a.logprobs[0] for a in actions])
    first = torch.tensor([a.tokens[0] for a in actions])
    assert torch.allclose(got, perturbed_lp.gather(1, first[:, None]).squeeze(1), atol=1e-5)
    assert not torch.allclose(got, clean_lp.gather(1, first[:, None]).squeeze(1), atol=1e-3)


# -- the sampler, through the bus -------------------------------------------------------------

def _pv(ref, version) -> PolicyVersion:
    return PolicyVersion(event_id=event_id("pv", version), run_id="tiny", producer="learner",
                         key="policy", version=version, checkpoint=ref.address,
                         checkpoint_hash=ref.sha256, parent=version - 1 if version else None,
                         reason="update" if version else "init")


async def test_sampler_records_logprobs_of_the_annealed_distribution(tmp_path, tiny, scratch_bus):
    """Steps of v0 are drawn at the start temperature, steps of v10 at the end one (with
    top-p): each recorded first-token log-prob equals the policy's at that version's
    scheduled temperature and top-p, recomputed here from the checkpoint. (Every step,
    including those of batches that were waiting while v10's weights loaded.)"""
    cfg = exploring(tiny, num_envs=4, temperature_end=0.5, top_p_end=0.9, anneal_versions=10)
    ref0, policy0 = _checkpoint(cfg, tmp_path, 0, seed=1)
    ref10, policy10 = _checkpoint(cfg, tmp_path, 10, seed=2)

    scratch_bus.partitions = 2  # its topics and runner
    await scratch_bus.publish(POLICY_VERSION, _pv(ref0, 0))
    async with scratch_bus.running(Sampler(cfg), name="sampler") as runner:

        async def steps_of(version: int) -> list[TrajectoryStep]:
            mine: list[TrajectoryStep] = []

            async def enough() -> bool:
                mine[:] = [s for s in await scratch_bus.events(TRAJECTORY_STEP)
                           if isinstance(s, TrajectoryStep) and s.policy_version == version]
                return len(mine) >= 40

            assert await wait_until(enough, 60, runner), \
                f"sampler produced too few steps of v{version}"
            return mine

        early = await steps_of(0)
        await scratch_bus.publish(POLICY_VERSION, _pv(ref10, 10))
        late = await steps_of(10)
    for steps, policy, version in ((early, policy0, 0), (late, policy10, 10)):
        params = sampling_params_at(cfg, version)
        behaviour = _behaviour_logp(policy.next_token_logprobs([s.context_tokens
                                                                for s in steps]), params)
        recorded = torch.tensor([s.action_logprobs[0] for s in steps])
        first = torch.tensor([s.action_tokens[0] for s in steps])
        assert torch.allclose(recorded, behaviour.gather(1, first[:, None]).squeeze(1),
                              atol=1e-5), version
    assert sampling_params_at(cfg, 10).temperature == pytest.approx(0.5)
