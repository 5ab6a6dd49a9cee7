#!/usr/bin/env bash
# Set everything up (system services included), then run the linter, the type checker and the fast
# test suite (one or two cases of every layer, a couple of minutes); `--all` (what CI runs) adds the
# tests marked slow: the large models, the long end-to-end and elastic runs, every parameter. The ten
# slowest tests are listed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/system-deps.sh
bash scripts/setup.sh
.venv/bin/ruff check .
bash scripts/typecheck.sh
# Bytecode caches on: the tests' rewritten asserts and the compiled sources are then made once and reused
# by both test workers and every process a test starts (a function's replica, a CLI run).
unset PYTHONDONTWRITEBYTECODE
if [ "${1:-}" = "--all" ]; then
  shift
  .venv/bin/python -m pytest -q -n 2 --durations=10 "$@"
else
  # A test module's fixtures (its compiled builds) are made once, on the one worker that runs the module.
  .venv/bin/python -m pytest -q -n 2 --dist loadscope --durations=10 -m "not slow" "$@"
fi
