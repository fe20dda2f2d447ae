#!/usr/bin/env bash
# Set up (first run only) and serve the embedded default model on 127.0.0.1:8000.
# Extra arguments go to `tandem serve` (e.g. --port 8080 --mem 512).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m app serve "$@"
