#!/usr/bin/env bash
# Set everything up (system services included), then run the linter, the type checker and the fast
# test suite; `--all` (what CI runs) adds the slow cases (the large sample models).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/system-deps.sh
bash scripts/setup.sh
.venv/bin/ruff check .
bash scripts/typecheck.sh
if [ "${1:-}" = "--all" ]; then
  shift
  .venv/bin/python -m pytest -q -n 2 "$@"
else
  .venv/bin/python -m pytest -q -n 2 -m "not slow" "$@"
fi
