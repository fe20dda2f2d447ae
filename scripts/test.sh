#!/usr/bin/env bash
# Set up (first run only), build the docs site (--strict: a broken link or a reference table
# the code cannot fill fails), lint and type-check app/, and run the test suite. Extra
# arguments go to pytest (e.g. `scripts/test.sh -m slow -n 0` for the soak tests,
# one at a time). Two workers by default (TANDEM_TEST_WORKERS), each taking whole
# test files: most tests wait on a server's single MLX thread, so two overlap well
# even on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
# The dashboard's browser test drives the system's Chromium (it skips, saying so, without one).
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null && command -v apt-get >/dev/null; then
  sudo=""; [ "$(id -u)" = 0 ] || sudo="sudo -n"
  { $sudo apt-get install -y -q chromium || { $sudo apt-get update -q && $sudo apt-get install -y -q chromium; }; } \
    >/dev/null 2>&1 || echo "chromium could not be installed: the browser test will skip" >&2
fi
site_dir="$(mktemp -d)"
trap 'rm -rf "$site_dir"' EXIT
# Not -q: it hides the warnings that --strict counts. The log is shown only when the build fails.
if ! docs_log="$(NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict -d "$site_dir" 2>&1)"; then
  echo "$docs_log" >&2
  exit 1
fi
rm -rf "$site_dir"
.venv/bin/ruff check app
.venv/bin/mypy
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
exec .venv/bin/python -m pytest -n "${TANDEM_TEST_WORKERS:-2}" --dist loadfile "$@"
