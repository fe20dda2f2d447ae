#!/usr/bin/env bash
# Set up (first run only), lint and type-check app/, and run the test suite. Extra
# arguments go to pytest (e.g. `scripts/test.sh -m slow -n 0` for the soak tests,
# one at a time). Two workers by default (TANDEM_TEST_WORKERS), each taking whole
# test files: most tests wait on a server's single MLX thread, so two overlap well
# even on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
.venv/bin/ruff check app
.venv/bin/mypy
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/python -m pytest -n "${TANDEM_TEST_WORKERS:-2}" --dist loadfile "$@"
