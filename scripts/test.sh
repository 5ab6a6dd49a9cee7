#!/usr/bin/env bash
# Set everything up (system services included), then run the linter and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/system-deps.sh
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q -n 2 "$@"
