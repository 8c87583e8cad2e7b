"""vLLM backend, checked for real (run by ops/check_vllm.sh inside its own vllm virtualenv).

1. Load SmolLM2-135M (converted once into the cache) into the vLLM backend and into the
   torch backend (HFPolicy).
2. Act for a few steps in TextWorldExpress with vLLM (temperature 1, top-p 1, so behaviour
   and raw log-probs coincide); score every sampled token with the torch backend.
3. Train the torch policy one Adam step (raise the log-prob of the sampled actions), publish it
   as policy version 1 in a Gyre checkpoint store, and reload that checkpoint into the
   running vLLM engine (hash checked, weights swapped in place).
4. Act again on the same contexts; vLLM's log-probs must agree with the *updated* torch
   policy within TOLERANCE, and differ from the old one (proof the reload took effect).
5. Sample at temperature 0.7 / top-p 0.9 and compare vLLM's processed log-probs with the
   torch backend's behaviour log-probs of the same tokens.
6. Validation with ``evaluator.engine = "sampler"``: an evaluator with its own vLLM engine
   loads version 1 from the store and plays greedy episodes; torch plays the same ones, and
   the two must agree (success, score, length).

Prints one line per figure; the last line is a JSON summary. Exit status 1 on disagreement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TOLERANCE = 2e-3
"""Largest allowed |vLLM - torch| log-prob of a sampled token, in nats. Both run float32;
what remains is kernel order (attention, matmul blocking) across 30 layers."""


def log(msg: str) -> None:
    print(f"[check_vllm] {msg}", flush=True)


async def play(env_name: str, env_config: dict, vllm_policy, builder, params, n_envs: int,
               n_steps: int):
    """Act ``n_steps`` times in ``n_envs`` games with vLLM; return (contexts, actions)."""
    from gyre_async.envs import make_env

    envs = [make_env(env_name, **env_config) for _ in range(n_envs)]
    observations = [await e.reset(f"{env_name}:{i}", i) for i, e in enumerate(envs)]
    history: list[list[tuple[str, str]]] = [[] for _ in envs]
    contexts, actions = [], []
    try:
        for step in range(n_steps):
            ctx = [builder.build(o, h) for o, h in zip(observations, history)]
            acted = vllm_policy.act_batch(ctx, params, seed=step)
            for i, (env, a) in enumerate(zip(envs, acted)):
                result = await env.step(a.text)
                log(f"step {step} env {i}: action {a.text!r} -> {result.observation[:70]!r}")
                history[i].append((observations[i], a.text))
                observations[i] = result.observation
                if result.done or result.truncated:
                    observations[i] = await env.reset(f"{env_name}:{i}", 100 + step)
                    history[i] = []
            contexts += ctx
            actions += acted
    finally:
        for env in envs:
            await env.close()
    return contexts, actions


def compare(torch_policy, contexts, actions, behaviour_params=None):
    """Per-token |vLLM - torch| log-prob differences (raw, or behaviour under params)."""
    import torch

    from gyre_async.policy.torch_policy import _behaviour_logp

    tokens = [a.tokens for a in actions]
    with torch.no_grad():
        if behaviour_params is None:
            out = torch_policy.evaluate(contexts, tokens)
            ref = [out.logprobs[i, :len(t)].tolist() for i, t in enumerate(tokens)]
        else:  # torch's behaviour distribution (temperature, top-p) of the same tokens
            ref = []
            for c, t in zip(contexts, tokens):
                hidden, _ = torch_policy._forward(torch.tensor([c + t]),
                                                  torch.ones(1, len(c) + len(t), dtype=bool))
                logits = torch_policy._logits(hidden[0, len(c) - 1:len(c) - 1 + len(t)]).float()
                logits = logits.masked_fill(~torch_policy.allowed, float("-inf"))
                logp = _behaviour_logp(logits, behaviour_params)
                ref.append(logp.gather(1, torch.tensor(t)[:, None]).squeeze(1).tolist())
    return [abs(v - r) for a, row in zip(actions, ref) for v, r in zip(a.logprobs, row)]


def validate_both(args, env_config: dict, learner, store, ref) -> dict:
    """Greedy validation of checkpoint ``ref`` by an evaluator whose engine is the sampler's
    (a vLLM engine, built by ``Evaluation.from_config``) and by the torch ``learner``: the
    (success rate, mean score, mean length) of each."""
    import msgspec

    from gyre_async.core.evaluation import Evaluation, evaluate
    from gyre_async.core.rollout import PolicyHolder
    from gyre_async.policy.vllm_policy import VLLMPolicy
    from schemas.config import Config, LoraSection

    s = msgspec.structs.replace
    cfg = Config()
    cfg = s(cfg, task=s(cfg.task, env=args.env, env_config=env_config),
            policy=s(cfg.policy, backend="vllm", model="smollm2",
                     context_tokens=args.context_tokens, history_turns=1,
                     max_action_tokens=args.action_tokens,
                     lora=LoraSection(rank=args.lora_rank), vllm_lora=args.lora_serving),
            evaluator=s(cfg.evaluator, seeds=list(range(args.envs)), engine="sampler"))
    evaluation = Evaluation.from_config(cfg)
    if not isinstance(evaluation.holder.policy, VLLMPolicy):
        raise SystemExit("evaluator.engine = 'sampler' did not give the evaluator a vLLM engine")
    evaluation.holder.load(ref.address, ref.sha256, 1)

    def figures(r: dict) -> list[float]:
        return [r["success_rate"], round(r["mean_score"], 6), r["mean_length"]]

    by_sampler = asyncio.run(evaluate(cfg, evaluation.holder, evaluation.builder, None, True))
    evaluation.holder.close()
    by_learner = asyncio.run(evaluate(cfg, PolicyHolder(learner, 1), evaluation.builder, None,
                                      True))
    return {"sampler": figures(by_sampler), "learner": figures(by_learner)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--env", default="twx")
    parser.add_argument("--env-config", default='{"game": "twc", "params": "numLocations=1,'
                        'numItemsToPutAway=1,includeDoors=0", "max_steps": 8, '
                        '"admissible": "snap"}')
    parser.add_argument("--envs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--context-tokens", type=int, default=192)
    parser.add_argument("--action-tokens", type=int, default=8)
    parser.add_argument("--lora-rank", type=int, default=0,
                        help="> 0: check LoRA instead of full weights: the learner trains "
                             "peft adapters and each version reaches vLLM as a new adapter")
    parser.add_argument("--lora-serving", default="adapter", choices=["adapter", "merged"],
                        help="with --lora-rank: versions reach vLLM as LoRA adapters, or "
                             "merged into the base weights and reloaded in place")
    parser.add_argument("--compiled", action="store_true",
                        help="run the engine as the loop does (torch.compile, no "
                             "enforce_eager): a reload must reach compiled code too")
    parser.add_argument("--learning-rate", type=float, default=None,
                        help="the one Adam step (default 1e-4 full weights, 1e-3 adapters)")
    args = parser.parse_args()
    t0 = time.monotonic()

    import torch

    from gyre_async.policy.base import SamplingParams
    from gyre_async.policy.context import ContextBuilder
    from gyre_async.policy.factory import load_weights, save_weights
    from gyre_async.policy.hf_policy import HFPolicy
    from gyre_async.policy.smollm2 import ensure_converted
    from gyre_async.policy.vllm_policy import VLLMPolicy
    from gyre_async.storage.checkpoints import CheckpointStore
    from schemas.config import LoraSection

    model_dir = ensure_converted()
    log(f"model directory {model_dir} ({time.monotonic() - t0:.0f}s)")
    lora = LoraSection(rank=args.lora_rank) if args.lora_rank > 0 else None
    learning_rate = args.learning_rate or (1e-3 if lora else 1e-4)
    learner = HFPolicy.from_pretrained(model_dir, seed=0, lora=lora)
    tok = learner.tokenizer
    started = time.monotonic()
    sampler = VLLMPolicy(model_dir, tok, seed=0,
                         max_model_len=args.context_tokens + args.action_tokens + 1,
                         enforce_eager=not args.compiled, lora=lora,
                         lora_serving=args.lora_serving)
    engine_s = time.monotonic() - started
    log(f"vLLM engine up in {engine_s:.0f}s")
    builder = ContextBuilder(tok, args.context_tokens, history_turns=1)
    raw = SamplingParams(temperature=1.0, top_p=1.0, max_action_tokens=args.action_tokens)
    env_config = json.loads(args.env_config)

    contexts, actions = asyncio.run(play(args.env, env_config, sampler, builder, raw,
                                         args.envs, args.steps))
    diff_v0 = compare(learner, contexts, actions)
    log(f"version 0: {len(diff_v0)} sampled tokens, max |vLLM - torch| log-prob "
        f"{max(diff_v0):.2e}, mean {sum(diff_v0) / len(diff_v0):.2e}")

    # One learner step: raise the log-prob of what was sampled (a stand-in for a PPO update;
    # Adam at 1e-4 moves log-probs by tenths of a nat and keeps the model sane; a much larger
    # step wrecks it, and in a wrecked model's huge logits float32 noise alone exceeds 1e-3).
    before = {k: v.detach().clone() for k, v in learner.state_dict().items()}
    optimizer = torch.optim.Adam(learner.parameters(), lr=learning_rate)
    out = learner.evaluate(contexts, [a.tokens for a in actions])
    (-(out.logprobs.sum()) / out.mask.sum()).backward()
    optimizer.step()
    learner.model.zero_grad(set_to_none=True)
    checkpoints = tempfile.TemporaryDirectory(prefix="gyre-check-vllm-ckpt-")
    store = CheckpointStore(checkpoints.name)
    ref = save_weights(store, learner, 1, {"reason": "check_vllm"})
    started = time.monotonic()
    load_weights(sampler, ref.address, ref.sha256)  # sha256 verified, reloaded in place
    reload_s = time.monotonic() - started
    log(f"reloaded policy version 1 ({ref.address}) into vLLM in {reload_s:.1f}s")
    try:
        load_weights(sampler, ref.address, "0" * 64)
        refused = False
    except Exception as exc:  # noqa: BLE001 - any refusal is what we want
        refused = "sha256" in str(exc)
    log(f"a checkpoint with the wrong sha256 is refused: {refused}")
    if lora is not None:  # an adapter made for another base model must be refused too
        from gyre_async.policy.base import CheckpointMismatch

        tensors, meta = store.load(ref.address, ref.sha256)
        try:
            sampler.load_checkpoint(tensors, {**meta, "base_model": "0" * 16}, ref.address)
            refused = False
        except CheckpointMismatch as exc:
            log(f"an adapter for another base is refused: {exc}")
            refused = refused and "base model" in str(exc)

    actions_v1 = sampler.act_batch(contexts, raw, seed=1000)
    diff_v1 = compare(learner, contexts, actions_v1)
    updated = {k: v.detach().clone() for k, v in learner.state_dict().items()}
    learner.load_state_dict(before)
    diff_old = compare(learner, contexts, actions_v1)
    learner.load_state_dict(updated)
    log(f"version 1: {len(diff_v1)} sampled tokens, max |vLLM - torch v1| log-prob "
        f"{max(diff_v1):.2e}, mean {sum(diff_v1) / len(diff_v1):.2e}; "
        f"against the old weights: max {max(diff_old):.2e}")

    tempered = SamplingParams(temperature=0.7, top_p=0.9, max_action_tokens=args.action_tokens)
    actions_t = sampler.act_batch(contexts, tempered, seed=2000)
    diff_t = compare(learner, contexts, actions_t, tempered)
    log(f"temperature 0.7, top-p 0.9: max |vLLM - torch| behaviour log-prob {max(diff_t):.2e}")

    # 6. Validation through the sampler's engine (evaluator.engine = "sampler"): the
    # evaluator's own vLLM engine loads version 1 from the store as the evaluator does, and
    # plays greedy validation episodes; the torch policy (v1) plays the same ones. Equal
    # log-probs within TOLERANCE give equal greedy actions, hence equal episodes.
    validation = validate_both(args, env_config, learner, store, ref)
    log(f"greedy validation of version 1, {args.envs} games: vLLM engine "
        f"{validation['sampler']}, torch {validation['learner']}")
    same_validation = validation["sampler"] == validation["learner"]

    worst = max(max(diff_v0), max(diff_v1), max(diff_t))
    ok = (worst <= TOLERANCE and max(diff_old) > 10 * TOLERANCE and refused
          and same_validation)
    summary = {
        "ok": ok, "tolerance": TOLERANCE, "max_abs_logprob_diff": worst,
        "v0_max": max(diff_v0), "v1_max": max(diff_v1), "tempered_max": max(diff_t),
        "v1_vs_old_weights_max": max(diff_old), "tokens_compared":
        len(diff_v0) + len(diff_v1) + len(diff_t), "engine_start_s": round(engine_s, 1),
        "reload_s": round(reload_s, 1), "wall_s": round(time.monotonic() - t0, 1),
        "lora_rank": args.lora_rank, "lora_serving": args.lora_serving,
        "compiled": args.compiled,
        "validation": validation,
        "same_validation": same_validation,
    }
    log(f"log-prob agreement: max |vLLM - torch| = {worst:.2e} nats over "
        f"{summary['tokens_compared']} tokens (tolerance {TOLERANCE:.0e}): "
        f"{'PASS' if ok else 'FAIL'}")
    print(json.dumps(summary))
    sampler.close()
    checkpoints.cleanup()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
