#!/usr/bin/env bash
# Create .venv (if missing) and install Cloudless with its test tools, every version pinned and hashed by
# requirements/lock.txt (refresh it with scripts/lock.sh): running it again puts back any package that
# was upgraded or downgraded in the venv. torch is the explicit CPU build (pip resolving plain `torch`
# takes a CUDA build of several GB), installed after the locked packages so that its own dependencies
# are the locked ones. A venv that already holds exactly that (scripts/venv_matches.py: every locked version,
# torch's, and this clone's editable install of this pyproject.toml) is left as it is, without a pip call.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
TORCH_VERSION=2.13.0
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
elif .venv/bin/python scripts/venv_matches.py "$TORCH_VERSION"; then
  exit 0
fi
pip=(.venv/bin/python -m pip --quiet)
"${pip[@]}" install --require-hashes --no-deps -r requirements/lock.txt
"${pip[@]}" install "torch==$TORCH_VERSION"
# Built with the locked setuptools, not one fetched for an isolated build. setuptools says, as a warning,
# that an editable install of folders mapped to package names uses an import hook: known, and silenced.
PYTHONWARNINGS="ignore:Editable installation.:Warning" \
  "${pip[@]}" install --no-deps --no-build-isolation -e .
"${pip[@]}" check >/dev/null || { "${pip[@]}" check; exit 1; }
sha256sum pyproject.toml | cut -d' ' -f1 >.venv/cloudless-pyproject.sha256  # what venv_matches.py compares
