#!/usr/bin/env bash
# Set up (first run only), lint and type-check app/, and run the test suite. Extra
# arguments go to pytest (e.g. `scripts/test.sh -m slow` for the soak tests).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
.venv/bin/ruff check app
.venv/bin/mypy
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/python -m pytest "$@"
