#!/usr/bin/env bash
# Set everything up, compile a sample (the MLP on scikit-learn's digits, split verified), then train
# it on this machine with cloudless-run: the generated functions as local processes, storage a folder.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/cloudless-compile samples/mlp_digits.py -o build/mlp_digits "$@"
.venv/bin/cloudless-run build/mlp_digits
