"""Run an environment in a child process with memory and CPU-time limits.

An environment is foreign code: a tool that leaks memory or spins in a loop inside the
sampler's process would take every trajectory (and the sampler) down with it. Wrapped
here, it runs in its own process, and:

- **memory**: the child's address space is capped with ``RLIMIT_AS`` (``memory_mb``); an
  allocation past it fails, the child reports ``MemoryError`` and exits;
- **CPU time**: before every call the child sets its soft ``RLIMIT_CPU`` to the CPU time
  used so far plus ``cpu_s``; a call that spins past it gets ``SIGXCPU`` and dies;
- **wall-clock time**: the sampler's ``guarded_step`` timeout cancels the call; the
  cancelled call kills the child (SIGKILL) so a hung environment stops consuming anything.

Every such death raises :class:`EnvProcessError` with what happened and which limit to
raise, which ``guarded_step`` turns into an ``env-error`` event (the trajectory ends,
truncated). The next ``reset`` starts a fresh child. Nothing is pickled: requests and
answers are msgspec JSON lines over the child's stdin/stdout.

Config (``task.env = "subprocess"``; ``task.env_config`` is flat)::

    env_config = { inner = "workshop", memory_mb = 1024, cpu_s = 30, n_orders = 6 }

``inner`` is a registered environment name or ``module:factory``; keys other than
``inner``, ``memory_mb`` and ``cpu_s`` go to the inner environment.
"""

from __future__ import annotations

import asyncio
import importlib
import resource
import signal
import sys
from typing import Any

import msgspec

from gyre_async.envs.base import Env, StepResult, make_env, register_env
from schemas.events import Milestone

MAX_LINE_BYTES = 16 << 20
_CHILD = ("import sys; from gyre_async.envs.subprocess_env import child_main; "
          "sys.exit(child_main(sys.argv[1:]))")


class EnvProcessError(RuntimeError):
    """The environment's process failed or was killed; the message says how to fix it."""


class _Request(msgspec.Struct):
    op: str
    task_id: str = ""
    seed: int = 0
    action: str = ""


class _Answer(msgspec.Struct):
    ok: bool
    error: str = ""
    observation: str = ""
    result: dict[str, Any] | None = None
    task: str = ""


def _build_inner(inner: str, config: dict[str, Any]) -> Env:
    if ":" in inner:
        module, _, name = inner.partition(":")
        return getattr(importlib.import_module(module), name)(**config)
    return make_env(inner, **config)


class SubprocessEnv(Env):
    """The environment ``inner`` in a resource-limited child process (module docstring)."""

    def __init__(self, inner: str = "workshop", memory_mb: int = 1024, cpu_s: float = 30.0,
                 max_steps: int = 0, **config: Any):
        self.inner = inner
        self.memory_mb = int(memory_mb)
        self.cpu_s = float(cpu_s)
        self.config = dict(config, **({"max_steps": int(max_steps)} if max_steps else {}))
        self.max_steps = int(max_steps) or 10**9
        self._proc: asyncio.subprocess.Process | None = None
        self._actions: list[str] = []
        self._task = ""

    # -- Env API ----------------------------------------------------------------------------
    async def reset(self, task_id: str, seed: int) -> str:
        await self.close()  # a fresh process per episode: limits and state start clean
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", _CHILD, self.inner,
            str(self.memory_mb), str(self.cpu_s), msgspec.json.encode(self.config).decode(),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            limit=MAX_LINE_BYTES)
        answer = await self._call(_Request("reset", task_id=task_id, seed=seed))
        self._task = answer.task
        return answer.observation

    async def step(self, action: str) -> StepResult:
        answer = await self._call(_Request("step", action=action))
        r = dict(answer.result or {})
        r["milestones"] = tuple(msgspec.convert(m, Milestone) for m in r.get("milestones", ()))
        self._actions = r.pop("admissible", [])
        self._task = answer.task
        return StepResult(observation=answer.observation, **r)

    def admissible_actions(self) -> list[str]:
        return list(self._actions)

    def task(self) -> str:
        return self._task

    async def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()

    # -- internals --------------------------------------------------------------------------
    async def _call(self, request: _Request) -> _Answer:
        proc = self._proc
        if proc is None:
            raise EnvProcessError("environment process not started: call reset first")
        stdin, stdout = proc.stdin, proc.stdout
        assert stdin is not None and stdout is not None, "started with stdin/stdout=PIPE"
        try:
            stdin.write(msgspec.json.encode(request) + b"\n")
            await stdin.drain()
            line = await stdout.readline()
        except asyncio.CancelledError:  # the caller's timeout: kill, never leave it running
            await self.close()
            raise
        except (BrokenPipeError, ConnectionResetError):
            line = b""
        if not line:
            code = await proc.wait()
            self._proc = None
            raise EnvProcessError(self._death(code))
        answer = msgspec.json.decode(line, type=_Answer)
        if not answer.ok:
            if proc.returncode is None and "MemoryError" in answer.error:
                await proc.wait()  # the child exits after reporting a MemoryError
            raise EnvProcessError(answer.error)
        return answer

    def _death(self, code: int) -> str:
        if code == -signal.SIGXCPU or code == -signal.SIGKILL:
            how = signal.Signals(-code).name
            return (f"environment process ({self.inner}) killed by {how}: CPU time limit "
                    f"of {self.cpu_s:g} s per call reached; raise env_config.cpu_s if the "
                    "environment legitimately needs more")
        return (f"environment process ({self.inner}) died with exit status {code}; its "
                "stderr is in the sampler's log")


register_env("subprocess", SubprocessEnv)


# -- the child --------------------------------------------------------------------------------

def _limit_cpu(cpu_s: float) -> None:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = usage.ru_utime + usage.ru_stime
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = int(used + cpu_s) + 1
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))


def _serve(inner: str, memory_mb: int, cpu_s: float, config: dict[str, Any]) -> int:
    limit = memory_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    env = _build_inner(inner, config)
    out = sys.stdout.buffer
    for line in sys.stdin.buffer:
        request = msgspec.json.decode(line, type=_Request)
        _limit_cpu(cpu_s)
        try:
            if request.op == "reset":
                obs = asyncio.run(env.reset(request.task_id, request.seed))
                answer = _Answer(True, observation=obs, task=env.task())
            elif request.op == "step":
                r = asyncio.run(env.step(request.action))
                result = {k: getattr(r, k) for k in ("feedback", "done", "truncated",
                                                     "success", "score", "state_changed")}
                result["milestones"] = [msgspec.to_builtins(m) for m in r.milestones]
                result["info"] = msgspec.to_builtins(r.info, str_keys=True,
                                                     enc_hook=repr)
                result["admissible"] = env.admissible_actions()
                answer = _Answer(True, observation=r.observation, result=result,
                                 task=env.task())
            else:
                answer = _Answer(False, error=f"unknown request {request.op!r}")
        except MemoryError:
            out.write(msgspec.json.encode(_Answer(
                False, error=f"environment process ({inner}) ran out of memory (MemoryError "
                f"at the {memory_mb} MB limit); raise env_config.memory_mb if the "
                "environment legitimately needs more")) + b"\n")
            out.flush()
            return 3
        except Exception as exc:  # noqa: BLE001 - reported to the parent as an env error
            answer = _Answer(False, error=f"{type(exc).__name__}: {exc}")
        out.write(msgspec.json.encode(answer) + b"\n")
        out.flush()
    return 0


def child_main(argv: list[str]) -> int:
    """The child's entry point: ``INNER MEMORY_MB CPU_S CONFIG_JSON``."""
    inner, memory_mb, cpu_s, config = argv
    return _serve(inner, int(memory_mb), float(cpu_s), msgspec.json.decode(config))
