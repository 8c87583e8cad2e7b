"""Environments in a child process with memory and CPU-time limits (``"subprocess"``).

The wrapper answers like the environment it wraps; a memory hog, a CPU spinner and a hung
call are each stopped (the child is gone afterwards) and come back from ``guarded_step`` as
an ``EnvFailure`` — which the sampler publishes as an ``env-error`` — whose message says
which limit was hit and how to raise it.
"""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from gyre_async.envs import EnvFailure, guarded_reset, guarded_step, make_env
from gyre_async.envs.workshop import WorkshopEnv, oracle_action

TESTS = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def child_can_import_test_envs(monkeypatch):
    path = os.environ.get("PYTHONPATH", "")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(TESTS), path])))


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


async def test_wrapped_workshop_answers_like_the_workshop():
    config = {"n_orders": 2, "max_steps": 40}
    wrapped = make_env("subprocess", inner="workshop", memory_mb=1024, cpu_s=10, **config)
    local = WorkshopEnv(**config)
    try:
        obs = await wrapped.reset("t", 5)
        assert obs == await local.reset("t", 5)
        for _ in range(6):
            action = oracle_action(obs)
            a, b = await wrapped.step(action), await local.step(action)
            assert (a.observation, a.feedback, a.done, a.milestones) == (
                b.observation, b.feedback, b.done, b.milestones)
            obs = a.observation
        assert wrapped.admissible_actions() == local.admissible_actions()
    finally:
        await wrapped.close()


async def test_the_task_the_child_states_is_the_parents_after_reset_and_each_step():
    env = make_env("subprocess", inner="env_faults:Stating", cpu_s=10)
    try:
        assert env.task() == ""
        await env.reset("t7", 0)
        assert env.task() == "task t7"
        await env.step("look")
        await env.step("take key")
        assert env.task() == "task t7, then look, then take key"
    finally:
        await env.close()


async def test_memory_hog_is_stopped_and_reported():
    env = make_env("subprocess", inner="env_faults:Misbehaving", mode="memory",
                   memory_mb=256, cpu_s=30)
    assert isinstance(await guarded_reset(env, "t", 0, 120), str)
    pid = env._proc.pid
    failure = await guarded_step(env, "go", 120)
    assert isinstance(failure, EnvFailure) and failure.kind == "exception"
    assert "out of memory" in failure.message and "memory_mb" in failure.message
    assert not alive(pid)


async def test_runaway_cpu_is_killed_by_the_cpu_limit():
    env = make_env("subprocess", inner="env_faults:Misbehaving", mode="cpu", cpu_s=1)
    assert isinstance(await guarded_reset(env, "t", 0, 120), str)
    pid = env._proc.pid
    started = time.monotonic()
    failure = await guarded_step(env, "go", 120)  # the wall-clock timeout is not what stops it
    assert isinstance(failure, EnvFailure) and failure.kind == "exception"
    assert "SIGXCPU" in failure.message and "cpu_s" in failure.message, failure.message
    assert time.monotonic() - started < 300 and not alive(pid)  # CPU seconds, not wall


async def test_hung_call_times_out_and_the_child_is_killed():
    env = make_env("subprocess", inner="env_faults:Misbehaving", mode="hang", cpu_s=30)
    assert isinstance(await guarded_reset(env, "t", 0, 120), str)
    pid = env._proc.pid
    failure = await guarded_step(env, "go", 0.5)
    assert isinstance(failure, EnvFailure) and failure.kind == "timeout"
    deadline = time.monotonic() + 5
    while alive(pid) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert not alive(pid)
    # the next episode gets a fresh child
    assert isinstance(await guarded_reset(env, "t", 1, 120), str)
    await env.close()
