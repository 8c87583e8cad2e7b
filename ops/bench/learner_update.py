"""One learner update on segment sequences, against plain Hugging Face + peft on the same tokens.

The long task's segments (its gold walkthroughs on training games, cut where the sampler
cuts them, as the warm start reads them) are put into the learner's batch layout (one
sequence per segment) with made-up rewards, and :class:`gyre_async.core.learner.LearnerCore`
runs ``--updates`` updates on them, as the learner role does (the values' pass, the critic's
start and defences, the PPO epochs, the critic refit when due). Beside it, in the same
process on the same sequences: forward + backward + AdamW with ``transformers`` and ``peft``
alone (loss on action tokens, the same micro-batches by tokens, the same minibatches).

Last line, one JSON object: ``gyre_tokens_per_s``, ``raw_tokens_per_s``, their ratio, and
where Gyre's update spends its time (``split_s``, from a profile of the update)::

    python ops/bench/learner_update.py --updates 2
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

#: the update's parts as the profile names them (cumulative seconds of each function)
PARTS = {
    "values_pass": ("learner_batch.py", "values_and_logprobs"),
    "bootstrap_values": ("torch_policy.py", "values"),
    "ppo_epochs": ("learner_ppo.py", "run"),
    "ppo_forward_backward": ("learner_ppo.py", "_minibatch_loss"),
    "optimizer_step": ("adam.py", "step"),
    "critic_start": ("critic.py", "start"),
    "critic_refit": ("learner.py", "_refit"),
    "evaluate_sequences": ("torch_policy.py", "evaluate_sequences"),
    "backward": ("_tensor.py", "backward"),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--updates", type=int, default=2, help="updates timed per side")
    p.add_argument("--demos", type=int, default=8,
                   help="training games whose walkthroughs give the segments")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: as is)")
    p.add_argument("--profile-out", default="", help="also write the update's pstats here")
    return p


def long_task_config():
    """The long task's learner and policy settings (``ops/bench/llm.py --long-task``)."""
    import llm

    args = llm.parse_args(["--long-task", "--out", tempfile.mkdtemp()])
    return llm.bench_config(args)


def batch_items(cfg, policy, tok, demos: int, steps: int):
    """Segments of the walkthroughs, in the learner's layout, until ``steps`` steps."""
    from gyre_async.compose import build_context_builder
    from gyre_async.core.learner_batch import BatchItem
    from gyre_async.offline.demonstrations import gold_demonstrations, training_segments
    from gyre_async.offline.warmstart import action_tokens
    from schemas.events import Scored

    found = gold_demonstrations(cfg.task.env, dict(cfg.task.env_config), range(demos))
    examples, _ = training_segments(found, build_context_builder(cfg, tok), cfg.segmenter,
                                    lambda text: action_tokens(policy, tok, text,
                                                               cfg.policy.max_action_tokens))
    items, total = [], 0
    for k, ex in enumerate(examples):
        if total >= steps:
            break
        n = len(ex.decisions)
        width = max(a for _, a in ex.decisions)
        act = np.zeros((n, width), dtype=np.int32)
        mask = np.zeros((n, width), dtype=np.uint8)
        for i, (c, a) in enumerate(ex.decisions):
            act[i, :a] = ex.sequence[c:c + a]
            mask[i, :a] = 1
        arrays = {"sequence_tokens": np.array([ex.sequence], dtype=np.int32),
                  "sequence_len": np.array([len(ex.sequence)], dtype=np.int32),
                  "context_len": np.array([c for c, _ in ex.decisions], dtype=np.int32),
                  "action_tokens": act, "action_mask": mask,
                  "action_logprobs": np.full((n, width), -1.0, dtype=np.float32),
                  "policy_version": np.zeros(n, dtype=np.int32),
                  "feedback": np.zeros(n, dtype=np.float32),
                  "step_index": np.arange(n, dtype=np.int64),
                  "bootstrap_context": np.zeros((1, 1), dtype=np.int32),
                  "bootstrap_len": np.array([0], dtype=np.int32),
                  "terminal": np.array([1], dtype=np.uint8)}
        scored = Scored(event_id=f"e{k}", run_id="bench", producer="arbiter",
                        segment_id=f"s{k}", trajectory_id=f"t{k}", task_id="twx:0",
                        step_start=0, step_end=n, address=f"bench/{k}", content_hash="0",
                        step_rewards=[0.1 * (i % 3) for i in range(n)], total=0.1,
                        decided_by="rules", min_policy_version=0, components={},
                        trajectory_done=True, success=bool(k % 2))
        items.append(BatchItem(scored, arrays))
        total += n
    return items


def gyre_updates(cfg, policy, items, updates: int, profile_out: str) -> tuple[float, dict]:
    """Seconds per update through ``LearnerCore``, and the profile's split of them."""
    import msgspec

    from gyre_async.core.learner import LearnerCore, TrainResult
    from gyre_async.storage.checkpoints import CheckpointRef

    core = LearnerCore(cfg, policy)
    core.publish("init", CheckpointRef("bench", "0" * 64, 0), "learner", {})
    profile = cProfile.Profile()
    seconds = 0.0
    for u in range(updates):
        for offset, item in enumerate(items):
            scored = msgspec.structs.replace(item.scored,
                                             segment_id=f"{item.scored.segment_id}-{u}",
                                             min_policy_version=core.version)
            assert core.add(scored, (0, u * len(items) + offset)) is None
        core.attach_arrays([it.arrays for it in items])
        started = time.perf_counter()
        profile.enable()
        out = core.update()
        profile.disable()
        seconds += time.perf_counter() - started
        assert isinstance(out, TrainResult), out
        core.publish("update", CheckpointRef("bench", "0" * 64, core.version + 1), "learner",
                     out.metrics, out)
    if profile_out:
        profile.dump_stats(profile_out)
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    split = {}
    for name, (file, func) in PARTS.items():
        split[name] = round(sum(v[3] for (f, _, fn), v in stats.items()
                                if f.endswith(file) and fn == func) / updates, 2)
    return seconds / updates, split


def packed(items: list, budget: int) -> list[list]:
    """Sequences longest first, a pass holding at most ``budget`` tokens once padded to its
    longest: what a plain training loop does to keep padding small (written out here, so
    the raw side runs without Gyre's code, against any Gyre commit)."""
    ordered = sorted(items, key=lambda x: -int(x.arrays["sequence_len"][0]))
    out: list[list] = []
    for x in ordered:
        if out and int(out[-1][0].arrays["sequence_len"][0]) * (len(out[-1]) + 1) <= budget:
            out[-1].append(x)
        else:
            out.append([x])
    return out


def raw_updates(cfg, items, updates: int) -> float:
    """Seconds per update of plain transformers + peft on the same sequences: one
    forward+backward per micro-batch (whole sequences of similar lengths up to
    ``micro_tokens`` padded tokens: :func:`packed`),
    loss on the action tokens, AdamW stepped per minibatch of ``minibatch_steps`` steps."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from gyre_async.policy.smollm2 import ensure_converted

    lora = cfg.policy.lora
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(ensure_converted()),
                           LoraConfig(r=lora.rank, lora_alpha=lora.alpha,
                                      lora_dropout=lora.dropout,
                                      target_modules=list(lora.target_modules) or None))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=cfg.learner.learning_rate)
    settings = cfg.learner
    minibatches: list[list] = [[]]
    for it in items:
        if sum(len(x.arrays["context_len"]) for x in minibatches[-1]) >= settings.minibatch_steps:
            minibatches.append([])
        minibatches[-1].append(it)
    started = time.perf_counter()
    for _ in range(updates * settings.epochs):
        for mb in minibatches:
            micro = packed(mb, settings.micro_tokens)
            for part in micro:
                width = max(int(x.arrays["sequence_len"][0]) for x in part)
                ids = torch.zeros(len(part), width, dtype=torch.long)
                attn = torch.zeros(len(part), width, dtype=torch.long)
                labels = torch.full((len(part), width), -100, dtype=torch.long)
                for i, x in enumerate(part):
                    seq = x.arrays["sequence_tokens"][0]
                    ids[i, :len(seq)] = torch.from_numpy(seq.astype(np.int64))
                    attn[i, :len(seq)] = 1
                    for c, m in zip(x.arrays["context_len"], x.arrays["action_mask"]):
                        a = int(m.sum())
                        labels[i, c:c + a] = ids[i, c:c + a]
                loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
                (loss / len(micro)).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return (time.perf_counter() - started) / updates


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    import torch

    from gyre_async.compose import build_policy, build_tokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = long_task_config()
    tok = build_tokenizer(cfg)
    policy = build_policy(cfg, tok)
    items = batch_items(cfg, policy, tok, args.demos, cfg.learner.batch_steps)
    tokens = sum(int(it.arrays["sequence_len"][0]) for it in items)
    steps = sum(len(it.arrays["context_len"]) for it in items)
    print(f"batch: {len(items)} segments, {steps} steps, {tokens} tokens "
          f"(longest {max(int(it.arrays['sequence_len'][0]) for it in items)})", flush=True)
    raw_s = raw_updates(cfg, items, args.updates)
    print(f"raw transformers+peft: {raw_s:.1f} s per update", flush=True)
    gyre_s, split = gyre_updates(cfg, policy, items, args.updates, args.profile_out)
    print(f"gyre LearnerCore: {gyre_s:.1f} s per update; {split}", flush=True)
    print(json.dumps({
        "bench": "learner_update", "segments": len(items), "steps": steps, "tokens": tokens,
        "epochs": cfg.learner.epochs, "threads": torch.get_num_threads(),
        "gyre_s_per_update": round(gyre_s, 2), "raw_s_per_update": round(raw_s, 2),
        "gyre_tokens_per_s": round(tokens * cfg.learner.epochs / gyre_s, 1),
        "raw_tokens_per_s": round(tokens * cfg.learner.epochs / raw_s, 1),
        "gyre_over_raw_time": round(gyre_s / raw_s, 3), "split_s": split}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
