#!/usr/bin/env bash
# Set up (first run only) and run the test suite. Extra arguments go to pytest
# (e.g. `scripts/test.sh -m slow` for the soak test).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/python -m pytest "$@"
