#!/usr/bin/env bash
# Install and run the whole test suite (the README's test command; .ci/run calls it).
# Installs everything the tests need on a fresh machine: Gyre with its test extras and
# SmolLM2 (ops/install.sh --test), headless Chromium for the report test
# (ops/install_chromium.sh) and kcat for the event-schema test (ops/install_kcat.sh); both
# with apt, as root or with sudo, and no-ops when already there.
# Kafka-protocol brokers (noida-db, Tansu) are started by the tests on loopback unless
# GYRE_TEST_NOIDA / GYRE_TEST_TANSU name running ones (as .ci/run does).
set -euo pipefail
cd "$(dirname "$0")/.."
bash ops/install.sh --test
bash ops/install_chromium.sh
bash ops/install_kcat.sh
# Two pytest workers (pytest-xdist; GYRE_TEST_WORKERS=0 runs in one process): most tests wait
# on brokers, subprocesses and sockets, so two share the two cores of the CI machine well.
VENV="${GYRE_VENV:-.venv}"
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider --durations=15 \
  -n "${GYRE_TEST_WORKERS:-2}" "$@"
