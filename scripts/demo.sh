#!/usr/bin/env bash
# Set everything up, then compile a sample (the MLP on scikit-learn's digits) and check the split.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/cloudless-compile samples/mlp_digits.py -o build/mlp_digits --verify "$@"
