#!/usr/bin/env bash
# Set up a fresh machine and run the test suite (CPU). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/setup_env.sh test
python -m ruff check .
python -m pytest -q "$@"
