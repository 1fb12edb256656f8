#!/usr/bin/env bash
# Set up and run Cockpit's test suite on a fresh machine (README quickstart, .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
# Headless Chromium for the live view's browser test (Debian packages; skipped if unavailable).
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
  SUDO=""; [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1 && SUDO="sudo"
  { $SUDO apt-get update -qq && $SUDO apt-get install -y -qq chromium chromium-driver >/dev/null; } \
    || echo "note: could not install chromium; the browser test of the live view will be skipped"
fi
python -m pip install -q -c constraints.txt -e ".[test]"
ruff check src tests benchmarks examples
python -m pytest -p no:cacheprovider "$@"
