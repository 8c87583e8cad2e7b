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
echo "installed into $VENV"
