#!/usr/bin/env bash
# Install and run the whole test suite (the README's test command; .ci/run calls it).
# Kafka-protocol brokers (noida-db, Tansu) are started by the tests on loopback unless
# GYRE_TEST_NOIDA / GYRE_TEST_TANSU name running ones (as .ci/run does).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ops/install.sh
VENV="${GYRE_VENV:-.venv}"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=15 "$@"
