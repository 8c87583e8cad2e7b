"""How a LoRA version should reach a vLLM engine: as an adapter, or merged into the weights.

Run it in the vllm virtualenv (``source ops/vllm_venv.sh; $PY ops/bench/vllm_lora.py
--run-dir RUN_DIR``) on a finished LoRA run: it takes the run's newest checkpoint and up to
``--contexts`` prompts from the run's own segments, starts one engine per way of serving
(``policy.vllm_lora = "adapter"``: vLLM's LoRA support; ``"merged"``: the adapter folded
into the base weights and reloaded in place), loads the version into each (timed), and
acts greedily on the same prompts with each, in alternated rounds (the best of each kept).
Side by side, the raw tool: the same engines' own ``LLM.generate`` on the same prompts (with
the adapter's ``LoRARequest`` for the adapter engine). Also the share of prompts on which
the two ways chose the same greedy action (they compute the same function up to float
rounding). Last line, one JSON object.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import msgspec  # noqa: E402 - after the offline switch
from _common import alternate, print_result  # noqa: E402
from llm import run_pairs  # noqa: E402  (ops/bench/llm.py: the run's own prompts)

from gyre_async.compose import build_tokenizer  # noqa: E402
from gyre_async.policy.base import SamplingParams  # noqa: E402
from gyre_async.policy.factory import load_weights, model_path  # noqa: E402
from schemas.config import Config  # noqa: E402


def newest_checkpoint(run_dir: Path) -> tuple[str, str, int]:
    """(address, sha256, version) of the run's newest checkpoint (``v<version>-<sha>``)."""
    files = sorted((run_dir / "checkpoints").glob("v*-*.safetensors"))
    if not files:
        raise SystemExit(f"{run_dir}/checkpoints holds no checkpoint: give a finished run")
    version, sha = files[-1].stem.split("-", 1)
    return f"file://{files[-1]}", sha, int(version.lstrip("v") or 0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run-dir", required=True, help="a finished run with [policy.lora]")
    p.add_argument("--contexts", type=int, default=64, help="prompts per batch")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()

    from gyre_async.policy.vllm_policy import VLLMPolicy

    run_dir = Path(args.run_dir)
    cfg = msgspec.json.decode((run_dir / "config.json").read_bytes(), type=Config)
    if cfg.policy.lora.rank < 1:
        raise SystemExit(f"{run_dir} is not a LoRA run (policy.lora.rank = 0)")
    address, sha, version = newest_checkpoint(run_dir)
    contexts, _, _ = run_pairs(f"{run_dir}/segments.zarr", args.contexts)
    tokenizer = build_tokenizer(cfg)
    shape = cfg.policy
    engines, reload_s = {}, {}
    for mode in ("adapter", "merged"):
        engines[mode] = VLLMPolicy(model_path(cfg), tokenizer, seed=cfg.run.seed,
                                   max_model_len=shape.context_tokens
                                   + shape.max_action_tokens + 1,
                                   lora=shape.lora, lora_serving=mode)
        started = time.perf_counter()
        load_weights(engines[mode], address, sha)
        reload_s[mode] = round(time.perf_counter() - started, 2)
        print(f"[vllm_lora] {mode}: version {version} loaded in {reload_s[mode]} s", flush=True)
    import vllm

    params = SamplingParams(max_action_tokens=shape.max_action_tokens, greedy=True)
    prompts = [{"prompt_token_ids": list(c)} for c in contexts]
    chosen: dict[str, list[list[int]]] = {}

    def gyre(mode: str) -> float:
        started = time.perf_counter()
        acts = engines[mode].act_batch(contexts, params, seed=0)
        chosen[mode] = [a.tokens for a in acts]
        return sum(len(a.tokens) for a in acts) / (time.perf_counter() - started)

    def raw(mode: str) -> float:
        engine = engines[mode]
        raw_params = vllm.SamplingParams(temperature=0.0, max_tokens=shape.max_action_tokens,
                                         stop_token_ids=engine.stop_token_ids)
        started = time.perf_counter()
        outs = engine.llm.generate(prompts, raw_params, use_tqdm=False,
                                   lora_request=engine.lora_request)
        return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - started)

    def report(_round: int, row: dict[str, float]) -> None:
        print("[vllm_lora] round: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items())
              + " new tokens/s", flush=True)

    # the same engine's path and generate, in turn; warm-up: the first requests pay for
    # lazy set-up
    side = alternate({f"{mode}_{kind}": (lambda f=f, mode=mode: f(mode)) for mode in engines
                      for kind, f in (("gyre", gyre), ("raw", raw))},
                     args.rounds, warmup=True, after_round=report)
    best = {k: side.best(k) for k in side.rounds[0]}
    same = sum(a == b for a, b in zip(chosen["adapter"], chosen["merged"])) / len(contexts)
    for engine in engines.values():
        engine.close()
    print_result({
        "bench": "vllm_lora", "run_dir": str(run_dir), "version": version,
        "prompts": len(contexts), "lora_rank": shape.lora.rank,
        "adapter_tokens_per_s": round(best["adapter_gyre"], 2),
        "adapter_generate_tokens_per_s": round(best["adapter_raw"], 2),
        "merged_tokens_per_s": round(best["merged_gyre"], 2),
        "merged_generate_tokens_per_s": round(best["merged_raw"], 2),
        "merged_vs_adapter": round(best["merged_gyre"] / best["adapter_gyre"], 2),
        "adapter_vs_raw": round(best["adapter_gyre"] / best["adapter_raw"], 3),
        "merged_vs_raw": round(best["merged_gyre"] / best["merged_raw"], 3),
        "load_s": reload_s, "same_greedy_actions": round(same, 3),
        "rounds": [{k: round(v, 2) for k, v in r.items()} for r in side.rounds]})
    return 0


if __name__ == "__main__":
    sys.exit(main())
