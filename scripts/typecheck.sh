#!/usr/bin/env bash
# Type-check the four packages with mypy under their import names (cloudless.ir, ...). Inside the
# package every import of our own is relative (`from ..ir import plan`), which pyright, editors and
# import-graph tools resolve from the files' paths alone. mypy names a module by its folders instead,
# and the repository root is the `cloudless` package (pyproject's package-dir), so mypy is run beside
# a single link of that name to the clone (a clone in a folder named `cloudless` needs none). The link
# stays in .venv between runs, and each of the two checks keeps its own cache: mypy's cache holds only
# for the same paths and options, and a check without it takes a minute here.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
here="$root/.venv/typecheck"
mkdir -p "$here"
ln -sfn "$root" "$here/cloudless"
cd "$here"
mypy=("$root/.venv/bin/mypy" --config-file "$root/pyproject.toml")
"${mypy[@]}" --cache-dir "$root/.mypy_cache/all" -p cloudless.ir -p cloudless.compiler -p cloudless.codegen \
  -p cloudless.runtimes
# the ir, which every other layer reads, under --strict too (PyYAML ships no type stubs: its Dumper is Any)
"${mypy[@]}" --cache-dir "$root/.mypy_cache/strict-ir" --strict --allow-subclassing-any -p cloudless.ir
