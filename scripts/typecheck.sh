#!/usr/bin/env bash
# Type-check the four packages with mypy under their import names (cloudless.ir, ...). The folders sit
# at the repository's top level and install through setuptools' package-dir, which mypy cannot follow,
# so a temporary tree of symlinks gives it the `cloudless/<layer>` layout.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
mkdir "$tree/cloudless"
for layer in ir compiler codegen runtimes; do
  ln -s "$root/$layer" "$tree/cloudless/$layer"
done
cd "$tree"
"$root/.venv/bin/mypy" --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" \
  -p cloudless.ir -p cloudless.compiler -p cloudless.codegen -p cloudless.runtimes
# the ir, which every other layer reads, under --strict too
"$root/.venv/bin/mypy" --config-file "$root/pyproject.toml" --cache-dir "$root/.mypy_cache" --strict \
  --allow-subclassing-any -p cloudless.ir  # PyYAML ships no type stubs: its Dumper is Any
