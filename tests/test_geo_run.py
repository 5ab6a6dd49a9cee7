"""Several regions end to end: compile the digits sample whose data lies in two regions, run it with
`cloudless-run`, and check the training against plain PyTorch (model averaging) or against the
protocol's invariants (ASGD-GA: every region's every round applied to the global model once)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from cloudless.compiler.model_file import load_model_file
from cloudless.ir.protocol import InvocationResult, global_key, global_owner, namespace
from cloudless.ir.workflow import Workflow
from cloudless.runtimes.run import main as run_main
from cloudless.runtimes.storage import DirectoryChannel
from tests.reference import plain_model_average
from tests.runtime_cases import check_step_order

GEO = Path(__file__).resolve().parent.parent / "samples" / "mlp_digits_geo.py"
REGIONS = "aws-us-east-1,aws-eu-west-1"
PROFILE = Path(__file__).resolve().parent / "golden" / "mlp_digits_geo" / "ir" / "blocks.json"


def compile_geo(compile_cli, build: Path, sync: str) -> dict:
    code, out, err = compile_cli(
        # The golden's block times: which regions train depends on them, so a loaded machine's
        # measurement must not change the plan under test.
        *(str(GEO), "-o", str(build), "--profile", str(PROFILE), "--regions", REGIONS),
        *("--objective", "time", "--sync", sync),
    )
    assert code == 0, err
    assert "regions     " + sync in out
    workflow = yaml.safe_load((build / "workflow.yaml").read_text())
    assert [r["name"] for r in workflow["regions"]] == REGIONS.split(",")
    kind = "asgd-ga-push" if sync == "asgd-ga" else "model-average"
    assert {s["kind"] for s in workflow["steps"]} >= {"compute", "optimizer-step", "checkpoint", kind}
    plan = json.loads((build / "plan.json").read_text())
    assert plan["regions"]["sync"] == sync and len(plan["regions"]["baselines"]) == 3
    # Each region trains on the slices planned for it; together they are all the data, once.
    held = {r["name"]: sum(s["count"] for s in r["data_sources"]) for r in workflow["regions"]}
    assert sum(held.values()) == sum(site["data_samples"] for site in plan["regions"]["sites"])
    return workflow


def test_model_average_across_regions_matches_plain_pytorch(compile_cli, tmp_path: Path) -> None:
    build = tmp_path / "build"
    workflow = compile_geo(compile_cli, build, "model-average")
    assert run_main([str(build), "--out", str(tmp_path / "run"), "--iterations", "20", "-q"]) == 0
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    rounds = max(1, round(workflow["sync"]["rounds"] * 20 / workflow["run"]["iterations"]))
    for region in workflow["regions"]:
        assert metrics["regions"][region["name"]]["iterations"] == rounds * region["round_iterations"]
    expected = plain_model_average(load_model_file(GEO), Workflow.from_json(workflow), rounds)
    got = load_file(tmp_path / "run" / "model.safetensors")
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)
    # The first region's timeline: each replica ran its function's steps, model averaging included,
    # in the order of the workflow's steps.
    typed = Workflow.from_json(workflow)
    region = typed.regions[0]
    trace = json.loads((tmp_path / "run" / "trace.json").read_text())["traceEvents"]
    ran = set()
    for function in region.functions:
        for replica in range(function.replicas):
            mine = [e for e in trace if e["ph"] == "X" and e["pid"] == function.stage and e["tid"] == replica]
            assert sum(e["cat"] == "invocation" for e in mine) == 1  # one invocation: spans from 0 on
            spans = tuple((e["name"], e["ts"], e["ts"] + e["dur"]) for e in sorted(mine, key=lambda e: e["ts"]))
            stop = rounds * region.round_iterations
            result = InvocationResult("done", function.name, replica, 0, resumed=0, stop=stop, spans=spans)
            iterations = check_step_order(typed, region.name, result)
            ran |= {kind for iteration in iterations for kind, _, _ in iteration}
    assert "model-average" in ran


@pytest.mark.parametrize("faults", ["0", pytest.param("0.3", marks=pytest.mark.slow)])
def test_asgd_ga_applies_every_regions_every_round_once(compile_cli, tmp_path: Path, faults: str) -> None:
    build = tmp_path / "build"
    workflow = compile_geo(compile_cli, build, "asgd-ga")
    server = workflow["sync"]["server"]
    assert server in REGIONS.split(",")
    out = tmp_path / "run"
    options = ["--iterations", "40", "--run-id", "r", "-q", "--inject-faults", faults, "--fault-seed", "3"]
    assert run_main([str(build), "--out", str(out), "--keep-storage", *options]) == 0
    metrics = json.loads((out / "metrics.json").read_text())
    rounds = max(1, round(workflow["sync"]["rounds"] * 40 / workflow["run"]["iterations"]))
    channel = DirectoryChannel(out / "storage")
    for stage in range(len(workflow["regions"][0]["functions"])):
        owners = []
        version = 1
        while (owner := channel.try_get(global_key(namespace("r", server), stage, version, "owner"))) is not None:
            owners.append(owner.decode())
            version += 1
        wanted = sorted(global_owner(r["name"], j).decode() for r in workflow["regions"] for j in range(rounds))
        assert sorted(owners) == wanted  # each round of each region, applied once
    losses = [p["loss"] for p in metrics["progress"]]
    assert losses[-1] < losses[0]
    if faults != "0":
        assert sum(r["faults_injected"] for r in metrics["regions"].values()) >= 1


def test_one_region_training_on_moved_data_reads_every_slice(compile_cli, tmp_path: Path) -> None:
    """When the cheapest schedule trains one region on all the data, the data moved to it is in its
    workflow entry (before: only multi-region entries listed their sources, so it trained on its own)."""
    build = tmp_path / "build"
    code, out, err = compile_cli(
        *(str(GEO), "-o", str(build), "--profile", str(PROFILE), "--regions", REGIONS),
        *("--objective", "cost", "--sync", "model-average"),
    )
    assert code == 0, err
    workflow = yaml.safe_load((build / "workflow.yaml").read_text())
    plan = json.loads((build / "plan.json").read_text())
    assert len(workflow["regions"]) == 1
    region = workflow["regions"][0]
    sources = {s["region"] for s in region["data_sources"]}
    assert sources == set(REGIONS.split(","))
    total = sum(site["data_samples"] for site in plan["regions"]["sites"])
    assert sum(s["count"] for s in region["data_sources"]) == region["samples"] == total
