#!/usr/bin/env bash
# Install and run the main job: a real training run on the embedded bus (no server needed).
# Installs only what `gyre run` needs (ops/install.sh without --test).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ops/install.sh
VENV="${GYRE_VENV:-.venv}"
RUN_DIR="${1:-runs/quickstart}"
exec "$VENV/bin/gyre" run ops/configs/quickstart.toml --run-dir "$RUN_DIR"
