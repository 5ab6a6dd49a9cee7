#!/usr/bin/env bash
# Refresh requirements/lock.txt, the pinned and hashed versions of everything scripts/setup.sh installs,
# from pyproject.toml (the package, its `test`, `samples` and `rehearse` extras) and requirements/tools.in (pip and
# the build back end). Run it after changing a dependency: bash scripts/lock.sh
# torch stays out of the lock: setup.sh installs the explicit CPU build (torch==2.13.0) itself.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
tools=$(mktemp -d)
trap 'rm -rf "$tools"' EXIT
"$PYTHON" -m venv "$tools"
"$tools/bin/python" -m pip install --quiet "pip==25.3" "pip-tools==7.6.2"
CUSTOM_COMPILE_COMMAND="bash scripts/lock.sh" "$tools/bin/pip-compile" --quiet pyproject.toml requirements/tools.in --extra test --extra samples --extra rehearse \
  --generate-hashes --strip-extras --unsafe-package torch --no-emit-index-url --no-emit-find-links \
  --output-file requirements/lock.txt
