"""Several regions end to end: compile the digits sample whose data lies in two regions, run it with
`cloudless-run` (each region its own storage folder), and check the training against plain PyTorch
(model averaging, synchronous SGD) or against the protocol's invariants (ASGD-GA: every region's
every round applied to the global model once, each push's staleness recorded)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from cloudless.compiler.frontend.model_file import load_model_file
from cloudless.ir import protocol
from cloudless.ir.protocol import InvocationResult, global_key, global_owner, namespace
from cloudless.ir.workflow import Workflow, round_ends
from cloudless.runtimes.cli import main as run_main
from cloudless.runtimes.storage.channels import DirectoryChannel
from cloudless.runtimes.storage.tensors import unpack
from tests.reference import plain_model_average, plain_sync
from tests.runtime_cases import check_step_order

GEO = Path(__file__).resolve().parent.parent / "samples" / "mlp_digits_geo.py"
REGIONS = "aws-us-east-1,aws-eu-west-1"
PROFILE = Path(__file__).resolve().parent / "golden" / "mlp_digits_geo" / "ir" / "blocks.json"


def compile_geo(compile_cli, build: Path, sync: str) -> dict:
    """A geo build. `sync`: the strategy to run; one the compiler cannot write yet ("sync") is a
    model-averaging build rewritten to the workflow contract (`as_sync`)."""
    compiled = sync if sync != "sync" else "model-average"
    code, out, err = compile_cli(
        # The golden's block times: which regions train depends on them, so a loaded machine's
        # measurement must not change the plan under test.
        *(str(GEO), "-o", str(build), "--profile", str(PROFILE), "--regions", REGIONS),
        *("--objective", "time", "--sync", compiled),
    )
    if code != 0 and sync == "sync":
        pytest.skip(f"the compiler cannot write this geo build: {err.strip().splitlines()[-1]}")
    assert code == 0, err
    workflow = yaml.safe_load((build / "workflow.yaml").read_text())
    assert [r["name"] for r in workflow["regions"]] == REGIONS.split(",")
    if sync == "sync" and workflow["sync"]["inter_region"] != "sync":
        workflow = rewrite_workflow(build, as_sync)
    kind = {"asgd-ga": "asgd-ga-push", "model-average": "model-average", "sync": "cross-region-reduce"}[sync]
    assert {s["kind"] for s in workflow["steps"]} >= {"compute", "optimizer-step", "checkpoint", kind}
    # Each region trains on the slices planned for it; together they are all the data, once.
    plan = json.loads((build / "plan.json").read_text())
    held = {r["name"]: sum(s["count"] for s in r["data_sources"]) for r in workflow["regions"]}
    assert sum(held.values()) == sum(site["data_samples"] for site in plan["regions"]["sites"])
    return workflow


#: builds `rewrite_workflow` edited: no longer what the compile wrote, `run_geo` runs them with --no-verify-build
EDITED: set[Path] = set()


def rewrite_workflow(build: Path, change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """Apply `change` to the build's workflow: workflow.yaml and every package's function.json."""
    EDITED.add(build.resolve())
    workflow = yaml.safe_load((build / "workflow.yaml").read_text())
    change(workflow)
    (build / "workflow.yaml").write_text(yaml.safe_dump(workflow, sort_keys=False))
    for spec_file in build.glob("regions/*/functions/*/function.json"):
        spec = json.loads(spec_file.read_text())
        spec["workflow"] = workflow
        spec_file.write_text(json.dumps(spec, indent=1, sort_keys=True))
    return workflow


def as_sync(workflow: dict[str, Any]) -> None:
    """A model-averaging workflow as synchronous cross-region SGD (the contract): every region the
    same iterations, a round per iteration, each stage's cross-region reduce before its step."""
    iterations = min(r["iterations"] for r in workflow["regions"])
    workflow["sync"].update(inter_region="sync", rounds=iterations, server=None)
    workflow["run"]["iterations"] = iterations
    for region in workflow["regions"]:
        region["iterations"] = iterations
    steps = []
    for step in workflow["steps"]:
        if step["kind"] == "model-average":
            continue
        if step["kind"] == "optimizer-step":
            cross = {**step, "id": step["id"].replace("optimizer-step", "cross-region-reduce")}
            cross["kind"] = "cross-region-reduce"
            steps.append(cross)
            step = {**step, "depends_on": [cross["id"]]}
        if step["kind"] == "checkpoint":
            step = {**step, "depends_on": [step["id"].replace("checkpoint", "optimizer-step")]}
        steps.append(step)
    workflow["steps"] = steps


def run_geo(build: Path, out: Path, *options: str) -> dict[str, Any]:
    edited = ["--no-verify-build"] if build.resolve() in EDITED else []
    assert run_main([str(build), "--out", str(out), "-q", *options, *edited]) == 0
    return json.loads((out / "metrics.json").read_text())


def check_regions_ran_their_steps(workflow: Workflow, out: Path, metrics: dict[str, Any], kind: str) -> None:
    """The first region's timeline: each replica ran its function's steps, the inter-region sync
    included at the run's round ends, in the order of the workflow's steps."""
    region = workflow.regions[0]
    trace = json.loads((out / "trace.json").read_text())["traceEvents"]
    # the generated handler's local entry point answers with the whole result, spans included
    assert any(e.get("cat") != "invocation" for e in trace if e["ph"] == "X"), "trace.json holds no worker spans"
    ran = set()
    stop = metrics["regions"][region.name]["iterations"]
    ends = tuple(metrics["regions"][region.name]["round_ends"])
    for function in region.functions:
        for replica in range(function.replicas):
            mine = [e for e in trace if e["ph"] == "X" and e["pid"] == function.stage and e["tid"] == replica]
            assert sum(e["cat"] == "invocation" for e in mine) == 1  # one invocation: spans from 0 on
            spans = tuple((e["name"], e["ts"], e["ts"] + e["dur"]) for e in sorted(mine, key=lambda e: e["ts"]))
            result = InvocationResult("done", function.name, replica, 0, resumed=0, stop=stop, spans=spans)
            iterations = check_step_order(workflow, region.name, result, round_ends=ends)
            ran |= {k for iteration in iterations for k, _, _ in iteration}
    assert kind in ran


def check_costed(metrics: dict[str, Any], workflow: dict[str, Any]) -> None:
    """metrics.json has each region's measured cost and the bytes each way between the regions."""
    cost = metrics["cost"]
    names = [r["name"] for r in workflow["regions"]]
    assert sorted(cost["regions"]) == sorted(names)
    for name in names:
        entry = cost["regions"][name]
        assert entry["invocations"] >= 1 and entry["gb_seconds"] > 0 and entry["storage_puts"] > 0
        assert entry["usd"]["total"] > 0 and entry["egress_bytes"] > 0
    assert sum(pair["gets"] for pair in cost["wan"].values()) > 0
    assert cost["total_usd"] == pytest.approx(sum(e["usd"]["total"] for e in cost["regions"].values()), rel=1e-6)


@pytest.mark.slow
def test_model_average_across_regions_matches_plain_pytorch(compile_cli, tmp_path: Path) -> None:
    build, out = tmp_path / "build", tmp_path / "run"
    workflow = compile_geo(compile_cli, build, "model-average")
    metrics = run_geo(build, out, "--iterations", "40")
    typed = Workflow.from_json(workflow)
    # --iterations scales every region's planned iterations, and the rounds alike
    scale = 40 / workflow["run"]["iterations"]
    iterations = {r["name"]: max(1, round(r["iterations"] * scale)) for r in workflow["regions"]}
    rounds = max(1, round(workflow["sync"]["rounds"] * scale))
    for name, count in iterations.items():
        assert metrics["regions"][name]["iterations"] == count
        assert metrics["regions"][name]["round_ends"] == list(round_ends(count, rounds))
    expected = plain_model_average(load_model_file(GEO), typed, iterations, rounds)
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(expected)
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)
    check_regions_ran_their_steps(typed, out, metrics, "model-average")
    # Each region in its own storage; every read of a peer's model crossed the WAN, counted.
    assert sorted(p.name for p in (out / "storage").iterdir() if p.is_dir()) == sorted(REGIONS.split(","))
    check_costed(metrics, workflow)
    a, b = REGIONS.split(",")
    assert metrics["cost"]["wan"][f"{a}->{b}"]["gets"] >= rounds  # at least one read per round


@pytest.mark.slow
@pytest.mark.parametrize("clip", [None, 0.05])
def test_sync_across_regions_matches_plain_pytorch_and_every_region_holds_the_same_bits(
    compile_cli, tmp_path: Path, clip: float | None
) -> None:
    """With TRAINING["max_grad_norm"], each region clips the cross-region mean gradient by its global
    norm (every stage's, after the reduce), as one process clips the mean gradient."""
    build, out = tmp_path / "build", tmp_path / "run"
    workflow = compile_geo(compile_cli, build, "sync")
    if clip is not None:
        workflow = rewrite_workflow(build, lambda w: w["run"].update(max_grad_norm=clip))
    iterations = 12  # of the plan's, every region alike (run.iterations is a region's under sync)
    metrics = run_geo(build, out, "--iterations", str(iterations), "--run-id", "s", "--keep-storage")
    typed = Workflow.from_json(workflow)
    for region in typed.regions:
        assert metrics["regions"][region.name]["iterations"] == iterations
    expected = plain_sync(load_model_file(GEO), typed, iterations)
    got = load_file(out / "model.safetensors")
    for name, value in expected.items():
        torch.testing.assert_close(got[name], value, rtol=1e-5, atol=1e-6)
    if clip is not None:  # the clipping bites: without it, the parameters differ
        unclipped = plain_sync(
            load_model_file(GEO), replace(typed, run=replace(typed.run, max_grad_norm=None)), iterations
        )
        assert any(not torch.allclose(got[name], unclipped[name], rtol=1e-3, atol=1e-5) for name in unclipped)
    # Every region took the same steps: bit-identical parameters in each region's own storage.
    states = []
    for region in typed.regions:
        channel = DirectoryChannel(out / "storage" / region.name)
        key = protocol.state_key(namespace("s", region.name), 0, iterations)
        states.append(protocol.module_values(unpack(channel.get(key, 5))))
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    check_regions_ran_their_steps(typed, out, metrics, "cross-region-reduce")
    check_costed(metrics, workflow)
    a, b = REGIONS.split(",")
    assert metrics["cost"]["wan"][f"{a}->{b}"]["gets"] >= iterations  # one read of the peer's sums each


@pytest.mark.slow
@pytest.mark.parametrize("faults", ["0", "0.3"])
def test_asgd_ga_applies_every_regions_every_round_once(compile_cli, tmp_path: Path, faults: str) -> None:
    build = tmp_path / "build"
    workflow = compile_geo(compile_cli, build, "asgd-ga")
    server = workflow["sync"]["server"]
    assert server in REGIONS.split(",")
    out = tmp_path / "run"
    options = ["--iterations", "40", "--run-id", "r", "--inject-faults", faults, "--fault-seed", "3"]
    metrics = run_geo(build, out, "--keep-storage", *options)
    rounds = len(metrics["regions"][server]["round_ends"])
    assert all(len(r["round_ends"]) == rounds for r in metrics["regions"].values())
    channel = DirectoryChannel(out / "storage" / server)  # the global versions: in the server's storage
    pushes = metrics["asgd_pushes"]
    for stage in range(len(workflow["regions"][0]["functions"])):
        owners = []
        version = 1
        while (owner := channel.try_get(global_key(namespace("r", server), stage, version, "owner"))) is not None:
            owners.append(owner.decode())
            version += 1
        wanted = sorted(global_owner(r["name"], j).decode() for r in workflow["regions"] for j in range(rounds))
        assert sorted(owners) == wanted  # each round of each region, applied once
        # ... and each push's staleness reported: versions its base lagged, and how it was scaled
        mine = sorted((p for p in pushes if p["stage"] == stage), key=lambda p: p["version"])
        assert [p["version"] for p in mine] == list(range(1, version))
        for push in mine:
            assert push["staleness"] == push["version"] - 1 - push["base"] >= 0
            assert push["rebased"] == (push["staleness"] > workflow["sync"]["staleness_bound"])
            weight = next(r["weight"] for r in workflow["regions"] if r["name"] == push["region"])
            assert 0 < push["scale"] <= weight + 1e-9
    assert metrics["asgd_staleness"]["max"] == max(p["staleness"] for p in pushes)
    losses = [p["loss"] for p in metrics["progress"]]
    assert losses[-1] < losses[0]
    check_costed(metrics, workflow)
    other = next(r["name"] for r in workflow["regions"] if r["name"] != server)
    assert metrics["cost"]["wan"][f"{other}->{server}"]["puts"] >= 2 * rounds  # a claim and a model per push
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


SEEDS = (0, 1, 2, 3, 4)


def with_seed(seed: int) -> Callable[[dict[str, Any]], None]:
    def change(workflow: dict[str, Any]) -> None:
        workflow["run"]["seed"] = seed

    return change


@pytest.mark.slow
def test_asgd_ga_and_model_averaging_reach_synchronous_sgds_accuracy(compile_cli, tmp_path: Path) -> None:
    """In every one of 5 seeded runs of the geo sample (its whole plan), ASGD-GA (bounded staleness,
    each push scaled by its region's weight) and model averaging reach within 1 point of synchronous
    cross-region SGD's test accuracy (pushing the full update diverged: 55.8 to 93.1%). The sample's
    learning-rate schedule lets the runs settle: at a constant rate `sync` alone spread over 6 points
    of seeds, wider than the bar (360 test samples: 1 point is 3.6 of them)."""
    accuracy: dict[str, list[float]] = {}
    for sync in ("sync", "asgd-ga", "model-average"):
        build = tmp_path / sync / "build"
        compile_geo(compile_cli, build, sync)
        for seed in SEEDS:
            rewrite_workflow(build, with_seed(seed))
            metrics = run_geo(build, tmp_path / sync / f"run{seed}")
            accuracy.setdefault(sync, []).append(metrics["test"]["accuracy"])
    print("test accuracy per seed:", json.dumps(accuracy))
    for seed, baseline in enumerate(accuracy["sync"]):
        assert baseline > 0.9, f"seed {seed}: synchronous SGD reached only {baseline:.1%}"
        for sync in ("asgd-ga", "model-average"):
            assert accuracy[sync][seed] >= baseline - 0.01, f"seed {seed}: {sync} {accuracy[sync][seed]:.1%}"


@pytest.mark.slow
def test_a_killed_run_of_several_regions_resumes_to_the_same_parameters(compile_cli, tmp_path: Path, capsys) -> None:
    """SIGKILL of the controller once both regions passed a checkpoint, then --resume: each region
    resumes from its own newest whole checkpoint, and the model is the one of a run never
    interrupted, bit for bit (model averaging is deterministic)."""
    build = tmp_path / "build"
    compile_geo(compile_cli, build, "model-average")
    run_geo(build, tmp_path / "whole")
    out = tmp_path / "killed"
    command = [sys.executable, "-m", "cloudless.runtimes.cli", str(build), "--out", str(out), "--log-every", "1"]
    process = subprocess.Popen([*command, "--run-id", "k"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    checkpoint_every = yaml.safe_load((build / "workflow.yaml").read_text())["run"]["checkpoint_every"]
    reached: dict[str, int] = {}
    for line in process.stdout:
        words = line.split()
        if len(words) > 2 and words[1] == "iteration":
            reached[words[0]] = int(words[2].split("/")[0])
            if len(reached) == 2 and min(reached.values()) > checkpoint_every + 2:
                break
    process.kill()
    process.communicate(timeout=30)
    capsys.readouterr()
    assert run_main([str(build), "--out", str(out), "--resume", "k", "-q"]) == 0
    assert "resuming run k: " in capsys.readouterr().out
    whole, resumed = load_file(tmp_path / "whole" / "model.safetensors"), load_file(out / "model.safetensors")
    assert whole.keys() == resumed.keys()
    assert all(torch.equal(whole[name], resumed[name]) for name in whole)


@pytest.mark.slow
def test_regions_keep_their_keys_in_their_own_redis_prefix(compile_cli, tmp_path: Path, redis_url: str) -> None:
    """One plain --storage URL for several regions: each region under its own prefix of it (Redis
    here), the functions reaching the other region's prefix as their peer's storage."""
    import redis

    build = tmp_path / "build"
    workflow = compile_geo(compile_cli, build, "model-average")
    location = f"{redis_url}#geo-{tmp_path.name}"
    metrics = run_geo(build, tmp_path / "run", "--iterations", "20", "--storage", location, "--keep-storage")
    names = [r["name"] for r in workflow["regions"]]
    assert metrics["storage"] == {name: f"{location}/{name}" for name in names}
    a, b = names
    assert metrics["cost"]["wan"][f"{a}->{b}"]["gets"] > 0 and metrics["cost"]["wan"][f"{b}->{a}"]["gets"] > 0
    client = redis.Redis.from_url(redis_url)
    try:
        for name in names:  # each region's round models under its own prefix
            run_keys = [k.decode() for k in client.scan_iter(match=f"geo-{tmp_path.name}/{name}/*model-average*")]
            assert run_keys and all(f"/{name}/model-average/" in key for key in run_keys)
    finally:
        client.close()
