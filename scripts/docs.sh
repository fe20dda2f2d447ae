#!/usr/bin/env bash
# Set up (first run only, with the test tools, which include mkdocs-material) and serve the
# documentation site on http://127.0.0.1:8001, rebuilt on every change to docs/ or mkdocs.yml.
# Extra arguments go to `mkdocs serve` (e.g. -a 127.0.0.1:9000).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
NO_MKDOCS_2_WARNING=1 exec .venv/bin/mkdocs serve -a 127.0.0.1:8001 "$@"
