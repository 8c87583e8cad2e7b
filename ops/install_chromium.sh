#!/usr/bin/env bash
# Headless Chromium for tests/test_report.py (renders `gyre report` pages offline); ops/test.sh
# calls it. Idempotent and quick: does nothing when the browser the test uses ($GYRE_CHROMIUM,
# default /usr/bin/chromium) is already executable. Otherwise installs Debian's `chromium`
# package with apt (as root, or through sudo); fails loudly if it cannot.
set -euo pipefail
CHROMIUM="${GYRE_CHROMIUM:-/usr/bin/chromium}"
if [ -x "$CHROMIUM" ]; then
  exit 0
fi
if [ "$CHROMIUM" != /usr/bin/chromium ]; then
  echo "install_chromium: GYRE_CHROMIUM=$CHROMIUM is not an executable; unset it to install" \
       "Debian's chromium at /usr/bin/chromium" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
echo "install_chromium: installing Debian's chromium (apt) for the report test"
$SUDO apt-get update -q
$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium
/usr/bin/chromium --version
