#!/usr/bin/env bash
# Headless Chromium for tests/test_report.py (renders `gyre report` pages offline).
# Idempotent: does nothing when /usr/bin/chromium exists. Debian/Ubuntu (apt), run as root.
set -euo pipefail
if [ -x /usr/bin/chromium ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
$SUDO apt-get update
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends chromium
/usr/bin/chromium --version
