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
# An install under the distribution's former name ("cockpit", editable) would put another
# checkout's src/ on the path ahead of this one: remove it (only if it is this project).
if python -m pip show cockpit 2>/dev/null | grep -q "^Summary: A visual and statistical debugger"; then
  python -m pip uninstall -y -q cockpit
fi
python -m pip install -q -c constraints.txt -e ".[test]"
ruff check src tests benchmarks examples
# the public modules' type hints (the package ships py.typed)
python -m mypy src/cockpit/__init__.py src/cockpit/__main__.py src/cockpit/_extras.py \
  src/cockpit/cli.py src/cockpit/schedules.py src/cockpit/configurations.py \
  src/cockpit/integrations src/cockpit/store/__init__.py src/cockpit/store/sinks.py \
  src/cockpit/cockpit.py src/cockpit/engine/engine_view.py src/cockpit/engine/capture/activations.py \
  src/cockpit/step src/cockpit/loop_checks src/cockpit/arguments.py src/cockpit/store/metadata.py \
  src/cockpit/quantities/descriptor.py src/cockpit/engine/statistics
python -m pytest -p no:cacheprovider "$@"
# only for the whole suite, not when arguments pick tests: the instruments' and the
# curvature's tests again on the accelerator paths forced on the CPU (what a GPU runs: every
# value against the same references; docs/architecture.md), then a subset on the oldest
# torch the package supports
if [ "$#" -eq 0 ]; then
  python -m pytest -p no:cacheprovider --accelerator-path tests/quantities tests/curvature \
    tests/test_reliability.py
  bash scripts/test_oldest_torch.sh
fi
