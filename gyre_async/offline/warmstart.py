"""Offline warm-start: behaviour cloning from demonstrations, published as policy version 0.

``gyre warmstart CONFIG`` builds the run's policy exactly as every role builds it
(:func:`gyre_async.compose.build_policy`), rebuilds the contexts the sampler would
have seen at each demonstration step (:func:`gyre_async.offline.demonstrations.training_pairs`) and
maximises the log-probability of the demonstrated action tokens (and of stopping after
them) through the policy's own :meth:`~gyre_async.policy.base.Policy.evaluate`, so any
backend that can evaluate log-probs can be warm-started. With segment contexts
(``policy.context = "segment"``) the demonstrations are cut into the sampler's segment
sequences (:func:`~gyre_async.offline.demonstrations.training_segments`) and each is read
in one forward pass, as the learner reads them: a warm start on windows would teach the
model contexts the run never shows it. The result is saved to the run's
checkpoint store and published on the run's bus as ``policy-version`` 0 with reason
``warmstart``: the learner, the sampler and the evaluator of a later ``gyre run`` on the
same run directory start from it (they load the latest published version on start).

Demonstrations come from ``warmstart.demonstrations`` (JSONL files: gold sequences,
walkthroughs or ``gyre export`` output) or, when none are given, from the environment's
own gold paths on ``warmstart.gold_episodes`` training seeds.
"""

from __future__ import annotations

import math
import random
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, TextIO

import torch

from gyre_async.compose import (
    build_context_builder,
    build_policy,
    build_tokenizer,
    save_weights,
)
from gyre_async.core.learner_batch import pack_by_length
from gyre_async.errors import ConfigError
from gyre_async.offline.demonstrations import (
    Demonstration,
    SegmentExample,
    gold_demonstrations,
    read_demonstrations,
    training_pairs,
    training_segments,
)
from gyre_async.policy.base import Policy
from schemas import event_id
from schemas.config import Config
from schemas.events import PolicyVersion
from schemas.topics import ALL_TOPICS, POLICY_VERSION


def load_demonstrations(cfg: Config) -> list[Demonstration]:
    W = cfg.warmstart
    if W.demonstrations:
        demos: list[Demonstration] = []
        for path in W.demonstrations:
            demos += read_demonstrations(path)
        return demos
    start = cfg.task.train_seed_start
    return gold_demonstrations(cfg.task.env, dict(cfg.task.env_config),
                               range(start, start + W.gold_episodes))


def action_tokens(policy: Policy, tokenizer, text: str, max_tokens: int) -> list[int] | None:
    """The tokens the policy must write for ``text`` (then ``<eos>``), or None if it cannot
    (a word it may not generate); cut at ``max_tokens`` like generation is."""
    tokens = [*tokenizer.encode(text), tokenizer.eos_id][:max_tokens]
    allowed = getattr(policy, "allowed", None)
    if allowed is not None and not all(bool(allowed[t]) for t in tokens):
        return None
    return tokens


class CloneProgress:
    """Warm-start's progress on stderr: a line at most every ``every_s`` seconds and at
    each epoch's end (cloning a language model's demonstrations takes tens of minutes)."""

    def __init__(self, epochs: int, every_s: float = 10.0, out: TextIO | None = None):
        self.epochs, self.every_s = epochs, every_s
        self.out = out if out is not None else sys.stderr
        self.started = time.monotonic()
        self._printed = self.started

    def __call__(self, epoch: int, step: int, steps: int, nll: float) -> None:
        now = time.monotonic()
        if step < steps and now - self._printed < self.every_s:
            return
        self._printed = now
        print(f"[warm-start {now - self.started:6.0f}s] epoch {epoch}/{self.epochs} "
              f"step {step}/{steps} nll {nll:.4f}", file=self.out, flush=True)


#: called after every gradient step: (epoch, step, steps in the epoch, epoch's nll so far)
OnStep = Callable[[int, int, int, float], None]

#: one gradient step's forward and backward passes; returns (summed nll, action tokens)
GradientStep = Callable[[], tuple[float, float]]


def _clone(policy: Policy, count: int, epoch_steps: Callable[[list[int]], list[GradientStep]],
           *, epochs: int, learning_rate: float, max_seconds: float, seed: int,
           max_grad_norm: float, on_step: OnStep | None) -> dict[str, float]:
    """The cloning loop both context forms share: Adam on the trainable parameters, the
    ``count`` examples shuffled each epoch and cut into gradient steps by ``epoch_steps``
    (each step accumulates its own gradient), clipping, progress, and the time bound
    (checked at an epoch's end)."""
    params = [p for p in policy.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=learning_rate)
    rng = random.Random(seed)
    order = list(range(count))
    started = time.monotonic()
    nll_epoch = float("nan")
    done_epochs = 0
    for epoch in range(1, epochs + 1):
        rng.shuffle(order)
        steps = epoch_steps(order)
        total, counted = 0.0, 0.0
        for step, gradient_step in enumerate(steps, 1):
            optimizer.zero_grad()
            nll, n_tokens = gradient_step()
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            optimizer.step()
            total += nll
            counted += n_tokens
            if on_step is not None:
                on_step(epoch, step, len(steps), total / max(counted, 1.0))
        nll_epoch = total / max(counted, 1.0)
        done_epochs += 1
        if max_seconds and time.monotonic() - started > max_seconds:
            break
    return {"bc/nll": nll_epoch, "bc/epochs": float(done_epochs),
            "bc/seconds": time.monotonic() - started}


def behaviour_clone(policy: Policy, examples: list[tuple[list[int], list[int]]], *,
                    epochs: int, learning_rate: float, batch_size: int, max_seconds: float = 0.0,
                    seed: int = 0, max_grad_norm: float = 1.0,
                    on_step: OnStep | None = None) -> dict[str, float]:
    """Minimise the mean negative log-likelihood of the action tokens given the contexts."""

    def window_step(batch: list[tuple[list[int], list[int]]]) -> GradientStep:
        def run() -> tuple[float, float]:
            out = policy.evaluate([c for c, _ in batch], [a for _, a in batch])
            n_tokens = out.mask.sum().clamp(min=1)
            loss = -(out.logprobs * out.mask).sum() / n_tokens
            loss.backward()
            return float(loss.detach()) * float(n_tokens), float(n_tokens)
        return run

    def epoch_steps(order: list[int]) -> list[GradientStep]:
        return [window_step([examples[i] for i in order[start:start + batch_size]])
                for start in range(0, len(order), batch_size)]

    stats = _clone(policy, len(examples), epoch_steps, epochs=epochs,
                   learning_rate=learning_rate, max_seconds=max_seconds, seed=seed,
                   max_grad_norm=max_grad_norm, on_step=on_step)
    return {**stats, "bc/examples": float(len(examples))}


def token_batches(segments: list[SegmentExample], order: list[int], steps: int,
                  tokens: int) -> Iterator[list[list[SegmentExample]]]:
    """Segments in ``order``, as gradient steps of about ``steps`` demonstration steps each,
    every one split into forward passes of similar lengths of at most ``tokens`` tokens
    counting the padding to the pass's longest (the learner's packing,
    :func:`~gyre_async.core.learner_batch.pack_by_length`; a longer segment gets a pass of
    its own; 0: one pass per gradient step)."""
    batch: list[SegmentExample] = []
    for n, i in enumerate(order, 1):
        batch.append(segments[i])
        if sum(len(s.decisions) for s in batch) >= steps or n == len(order):
            if not tokens:
                yield [batch]
            else:
                yield [[batch[k] for k in group] for group in
                       pack_by_length([len(s.sequence) for s in batch], tokens)]
            batch = []


def behaviour_clone_segments(policy: Policy, segments: list[SegmentExample], *, epochs: int,
                             learning_rate: float, batch_steps: int, micro_tokens: int = 0,
                             max_seconds: float = 0.0, seed: int = 0,
                             max_grad_norm: float = 1.0,
                             on_step: OnStep | None = None) -> dict[str, float]:
    """:func:`behaviour_clone` on segment contexts: each segment's action tokens are read
    off one forward pass over its sequence (``evaluate_sequences``, as the learner reads
    it), passes of at most ``micro_tokens`` tokens accumulated into one gradient step."""
    evaluate_sequences = getattr(policy, "evaluate_sequences", None)
    if evaluate_sequences is None:
        raise ConfigError(f"{type(policy).__name__} cannot read segment sequences; set "
                          'policy.context = "window" for warm-start with this backend')

    def segment_step(passes: list[list[SegmentExample]]) -> GradientStep:
        def run() -> tuple[float, float]:
            n_tokens = float(sum(n_act for p in passes for s in p for _, n_act in s.decisions))
            total = 0.0
            for part in passes:
                out = evaluate_sequences([s.sequence for s in part], [s.decisions for s in part])
                loss = -(out.logprobs * out.mask).sum() / max(n_tokens, 1.0)
                loss.backward()
                total += float(loss.detach()) * n_tokens
            return total, n_tokens
        return run

    def epoch_steps(order: list[int]) -> list[GradientStep]:
        return [segment_step(passes)
                for passes in token_batches(segments, order, batch_steps, micro_tokens)]

    stats = _clone(policy, len(segments), epoch_steps, epochs=epochs,
                   learning_rate=learning_rate, max_seconds=max_seconds, seed=seed,
                   max_grad_norm=max_grad_norm, on_step=on_step)
    return {**stats, "bc/examples": float(sum(len(s.decisions) for s in segments)),
            "bc/segments": float(len(segments))}


def warm_policy(cfg: Config, demos: list[Demonstration] | None = None
                ) -> tuple[Policy, dict[str, float]]:
    """The run's policy after behaviour cloning on ``demos`` (default: from config), on the
    contexts the run's sampler builds (windows, or segment sequences read one pass each)."""
    demos = load_demonstrations(cfg) if demos is None else demos
    tokenizer = build_tokenizer(cfg)
    policy = build_policy(cfg, tokenizer)
    builder = build_context_builder(cfg, tokenizer)
    W = cfg.warmstart
    if builder.segments:
        segments, refused = training_segments(
            demos, builder, cfg.segmenter,
            lambda text: action_tokens(policy, tokenizer, text, cfg.policy.max_action_tokens))
        if not segments:
            raise ConfigError(f"warm-start: none of {len(demos)} demonstrations gave a usable "
                              f"segment ({refused} steps left out: words the policy may not "
                              "generate); check warmstart.demonstrations and task.env_config")
        stats = behaviour_clone_segments(
            policy, segments, epochs=W.epochs, learning_rate=W.learning_rate,
            batch_steps=W.batch_steps, micro_tokens=cfg.learner.micro_tokens,
            max_seconds=W.max_seconds, seed=cfg.run.seed, on_step=CloneProgress(W.epochs))
        return policy, _checked(stats, demos, refused)
    examples, refused = [], 0
    for context, text in training_pairs(demos, builder):
        tokens = action_tokens(policy, tokenizer, text, cfg.policy.max_action_tokens)
        if tokens is None:
            refused += 1
        else:
            examples.append((context, tokens))
    if not examples:
        raise ConfigError(f"warm-start: none of {len(demos)} demonstrations gave a usable step "
                          f"({refused} steps use words the policy may not generate); check "
                          "warmstart.demonstrations and task.env_config")
    stats = behaviour_clone(policy, examples, epochs=W.epochs, learning_rate=W.learning_rate,
                            batch_size=W.batch_steps, max_seconds=W.max_seconds,
                            seed=cfg.run.seed, on_step=CloneProgress(W.epochs))
    return policy, _checked(stats, demos, refused)


def _checked(stats: dict[str, float], demos: list[Demonstration], refused: int
             ) -> dict[str, float]:
    """``stats`` with the demonstrations' counts; an error if cloning diverged."""
    stats.update({"bc/demonstrations": float(len(demos)),
                  "bc/successful_demonstrations": float(sum(d.success for d in demos)),
                  "bc/refused_steps": float(refused)})
    if not math.isfinite(stats["bc/nll"]):
        raise RuntimeError(f"warm-start diverged (nll {stats['bc/nll']}); lower "
                           "warmstart.learning_rate")
    return stats


async def publish_warmstart(cfg: Config, policy: Policy, stats: dict[str, float],
                            bus_override: str | None = None) -> PolicyVersion:
    """Save ``policy`` as version 0 of the run and publish it (reason ``warmstart``)."""
    from gyre_async.bus.base import Bus  # noqa: F401 - type context only
    from gyre_async.folds.runlog import current_policy_version
    from gyre_async.runtime.process import open_run_bus
    from gyre_async.storage.checkpoints import CheckpointStore
    from gyre_async.storage.roots import StorageRoots
    from schemas import encode

    async with open_run_bus(cfg, bus_override) as bus:
        await bus.create_topics(ALL_TOPICS, cfg.bus.partitions)
        latest = await current_policy_version(bus, cfg.run.run_id)
        if latest is not None:
            raise ConfigError(
                f"run {cfg.run.run_id!r} already has policy version {latest.version} "
                f"({latest.reason}); warm-start starts a run: use a fresh run.run_dir (or bus)")
        store = CheckpointStore(StorageRoots.from_config(cfg).checkpoints)
        ref = save_weights(store, policy, 0, {"run_id": cfg.run.run_id, "reason": "warmstart"})
        event = PolicyVersion(
            event_id=event_id("policy-version", cfg.run.run_id, 0, "warmstart"),
            run_id=cfg.run.run_id, producer="warmstart", key="policy", version=0,
            checkpoint=ref.address, checkpoint_hash=ref.sha256, parent=None, reason="warmstart",
            learning_rate=cfg.learner.learning_rate, env_steps=0,
            metrics={k: float(v) for k, v in stats.items()})
        await bus.publish(POLICY_VERSION, [(event.key.encode(), encode(event))])
        return event


async def warmstart(cfg: Config, bus_override: str | None = None) -> dict[str, Any]:
    """``gyre warmstart``: clone, then publish version 0; returns a summary."""
    import asyncio
    import os

    os.makedirs(cfg.run.run_dir, exist_ok=True)
    policy, stats = await asyncio.to_thread(warm_policy, cfg)
    event = await publish_warmstart(cfg, policy, stats, bus_override)
    return {"version": event.version, "checkpoint": event.checkpoint, **stats}
