"""Several regions deployed: the geo sample trained here and through both rehearsals, faults included.

    python bench/rehearsal_bench.py [--repeats 1] [--out DIR]

The job is samples/mlp_digits_geo.py across aws-us-east-1 and aws-eu-west-1 (the golden's block times,
the time objective), compiled once per strategy (model averaging, ASGD-GA). Each case runs with
`cloudless-run --invoker local`, `--invoker lambda --rehearse` (every region's SAM stack deployed into
moto's server, the peers' buckets by a second deploy, each range an execution of the region's state
machine, each invocation through awslambdaric) and `--invoker openfaas --rehearse` (a gateway per region,
one process per replica behind the python3-http template's index.py), each a fresh process:

- model averaging, aws-us-east-1 stops answering at its iteration 50 (`--fail-region`);
- model averaging, aws-eu-west-1 loses every function at its iteration 30 (`--capacity-change ...=0`);
- ASGD-GA, aws-us-east-1 stops answering at 100, after aws-eu-west-1 finished its 60 (started again).

Printed per run: the final test accuracy (360 samples), each region's iterations (the one that left:
those the others applied), whether the regions' iterations add up to the plan's (no iteration lost), the
coordinator's re-plans, and the wall time of the whole command (start-up, the rehearsal's deploys and
the evaluation included). Then per case the accuracy's difference to the local run (issue 30's target:
within 1 point). ASGD-GA has no barrier: its pushes interleave as the regions' pace has it, so its
accuracy varies from run to run (`--repeats` shows by how much).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MODEL = ROOT / "samples" / "mlp_digits_geo.py"
PROFILE = ROOT / "tests" / "golden" / "mlp_digits_geo" / "ir" / "blocks.json"
REGIONS = "aws-us-east-1,aws-eu-west-1"
CASES = (
    ("model-average", "--fail-region=aws-us-east-1@50"),
    ("model-average", "--capacity-change=aws-eu-west-1@30=0"),
    ("asgd-ga", "--fail-region=aws-us-east-1@100"),
)
INVOKERS = (
    ("local", []),
    ("lambda", ["--invoker", "lambda", "--rehearse"]),
    ("openfaas", ["--invoker", "openfaas", "--rehearse"]),
)


def compile_build(sync: str, folder: Path) -> Path:
    build = folder / sync
    command = [str(BIN / "cloudless-compile"), str(MODEL), "-o", str(build), "-q", "--profile", str(PROFILE)]
    command += ["--regions", REGIONS, "--objective", "time", "--sync", sync]
    subprocess.run(command, check=True, capture_output=True)
    return build


def run(build: Path, out: Path, options: list[str]) -> tuple[dict[str, Any], float]:
    command = [str(BIN / "cloudless-run"), str(build), "--out", str(out), "-q", "--region-timeout", "10", *options]
    began = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True)
    seconds = time.monotonic() - began
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{done.stderr}")
    return json.loads((out / "metrics.json").read_text()), seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--out", type=Path, default=None, help="keep the builds and runs here")
    args = parser.parse_args()
    folder = args.out or Path(tempfile.mkdtemp(prefix="rehearsal-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    builds = {sync: compile_build(sync, folder) for sync in sorted({sync for sync, _ in CASES})}
    print(
        f"{'case':<52} {'invoker':<9} {'accuracy':>8} {'iterations (left: applied)':<34} "
        f"{'lost':>4} {'replans':>7} {'wall s':>7}"
    )
    summary: list[str] = []
    for sync, fault in CASES:
        planned = yaml.safe_load((builds[sync] / "workflow.yaml").read_text())
        accuracies: dict[str, list[float]] = {}
        for repeat in range(args.repeats):
            for invoker, options in INVOKERS:
                out = folder / "runs" / f"{sync}-{fault.split('=')[0].strip('-')}-{invoker}-{repeat}"
                metrics, seconds = run(builds[sync], out, [*options, fault])
                regions = metrics["regions"]
                counted = {
                    name: entry.get("applied_iterations", entry["iterations"])
                    if "left" in entry
                    else entry["iterations"]
                    for name, entry in regions.items()
                }
                shown = ", ".join(
                    f"{name.removeprefix('aws-')} {counted[name]}{' (left)' if 'left' in regions[name] else ''}"
                    for name in regions
                )
                lost = planned["run"]["iterations"] - sum(counted.values())
                replans = [e["event"] for e in metrics.get("elastic", [])].count("replan")
                accuracy = metrics["test"]["accuracy"]
                accuracies.setdefault(invoker, []).append(accuracy)
                case = f"{sync} {fault}"
                print(
                    f"{case:<52} {invoker:<9} {accuracy:>8.1%} {shown:<34} {lost:>4} {replans:>7} {seconds:>7.1f}",
                    flush=True,
                )
        local = statistics.median(accuracies["local"])
        for invoker in ("lambda", "openfaas"):
            difference = statistics.median(accuracies[invoker]) - local
            summary.append(f"{sync} {fault}: {invoker} median accuracy - local's = {difference * 100:+.1f} points")
    print()
    print("\n".join(summary))


if __name__ == "__main__":
    main()
