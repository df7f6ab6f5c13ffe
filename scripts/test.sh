#!/usr/bin/env bash
# Set up a fresh machine and run the test suite (CPU): the pinned versions of
# requirements/test-lock.txt, ruff (lint and format), then pytest on every core (one test file
# per worker, so a file's shared runs stay in one process). Extra arguments go to pytest ("-n 0"
# runs serially).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh test
python -m ruff check .
python -m ruff format --check .
python -m pytest -q -n auto --dist loadfile "$@"
