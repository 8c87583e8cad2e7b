#!/usr/bin/env bash
# kcat, a Kafka client that is not Gyre's, for tests/test_event_schema.py (it reads a run's
# events off a broker and decodes them against `gyre schema`); ops/test.sh calls it.
# Idempotent and quick: does nothing when `kcat` is on PATH. Otherwise installs Debian's
# `kcat` package with apt (as root, or through sudo); fails loudly if it cannot.
set -euo pipefail
if command -v kcat >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install_kcat: installing Debian's kcat (apt) for the event-schema test"
$SUDO apt-get update -q
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends kcat
kcat -V | head -n 4
