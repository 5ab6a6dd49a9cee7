#!/usr/bin/env bash
# Set everything up, compile a sample (the MLP on scikit-learn's digits) into a pipeline of two stages,
# split verified, then train it on this machine with cloudless-run: the generated functions as local
# processes, storage a folder. Extra arguments go to cloudless-compile (e.g. --objective time).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/cloudless-compile samples/mlp_digits.py -o build/mlp_digits --stages 2 "$@"
.venv/bin/cloudless-run build/mlp_digits
cat <<'WHERE'

Where to look:
  build/mlp_digits/report.md             the plan, why it won, what it costs, how to deploy it
  build/mlp_digits/report/schedule.svg   the pipeline's predicted schedule
  build/mlp_digits/run/trace.json        the run's timeline: open it in ui.perfetto.dev
  build/mlp_digits/run/metrics.json      losses, throughput, test accuracy
WHERE
