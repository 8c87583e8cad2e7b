#!/usr/bin/env bash
# Check the vLLM policy backend for real on this CPU-only machine (see ops/check_vllm.py):
# SmolLM2-135M served by vLLM acts in TextWorldExpress, reloads a Gyre checkpoint in place,
# and its log-probs must agree with the torch backend's. Not part of CI (a ~3.4 GB virtualenv
# and a ~2 min engine start); run it by hand:  bash ops/check_vllm.sh [check_vllm.py args]
# (--lora-rank 8: the learner trains peft adapters, each version reaches vLLM as an adapter)
set -euo pipefail
cd "$(dirname "$0")/.."
source ops/vllm_venv.sh

# The engine runs in this process (one model copy, no pickled RPC).
export VLLM_ENABLE_V1_MULTIPROCESSING=0
exec "$PY" ops/check_vllm.py "$@"
