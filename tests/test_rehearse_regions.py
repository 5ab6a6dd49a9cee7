"""Several regions deployed: the geo sample (two regions, model averaging) trained through the Lambda
rehearsal (every region's SAM stack deployed into moto, a second deploy with the peers' buckets, each
range an execution of the region's state machine, each invocation through awslambdaric) reaches the
accuracy of its local run, with a region failure and a capacity change re-planned by the same
coordinator, and no iteration lost: the regions that stayed trained the plan's iterations minus what the
others applied of the region that left."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from cloudless.compiler.cli import main as compile_main
from cloudless.runtimes.cli import main as run_main
from tests.test_geo_run import GEO, PROFILE, REGIONS

US, EU = REGIONS.split(",")


@pytest.fixture(scope="module")
def geo_builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The geo build of each inter-region strategy, compiled once (the golden's block times)."""
    builds = {}
    for sync in ("model-average", "asgd-ga"):
        build = tmp_path_factory.mktemp(sync) / "build"
        options = ["--profile", str(PROFILE), "--regions", REGIONS, "--objective", "time", "--sync", sync]
        assert compile_main([str(GEO), "-o", str(build), "-q", *options]) == 0
        builds[sync] = build
    return builds


@pytest.fixture(scope="module")
def geo_build(geo_builds: dict[str, Path]) -> Path:
    return geo_builds["model-average"]


def trained(build: Path, out: Path, *options: str) -> dict[str, Any]:
    assert run_main([str(build), "--out", str(out), "-q", "--region-timeout", "10", *options]) == 0
    return json.loads((out / "metrics.json").read_text())


#: (strategy, fault, accuracy tolerance). Model averaging: aws-us-east-1 (105 iterations) stops answering
#: halfway (a deployed region's failure is seen as its progress is: within a round of its state
#: machine); aws-eu-west-1 (95) loses every function early and leaves at once. ASGD-GA: aws-us-east-1
#: (140) fails long after aws-eu-west-1 (60) finished, which is started again with new rounds. ASGD-GA has
#: no barrier: its pushes interleave as the regions' pace has it, and the same run's accuracy spreads
#: over a few points (local: 96.1-96.4 %, rehearsed with this fault: 94.2-96.9 %).
CASES = (
    ("model-average", f"--fail-region={US}@50", 0.01),
    ("model-average", f"--capacity-change={EU}@30=0", 0.01),
    ("asgd-ga", f"--fail-region={US}@100", 0.03),
)


@pytest.fixture(scope="module")
def local_runs(geo_builds: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """The local run of each case (`cloudless-run --invoker local`), once: what a rehearsal must reach."""
    return {
        f"{sync} {fault}": trained(geo_builds[sync], tmp_path_factory.mktemp("local"), fault)
        for sync, fault, _ in CASES
    }


@pytest.mark.slow
@pytest.mark.parametrize(("sync", "fault", "tolerance"), CASES, ids=["failure", "capacity", "asgd-ga-failure"])
@pytest.mark.parametrize("invoker", ["lambda", "openfaas"])
def test_the_geo_sample_trains_through_the_rehearsals_as_it_does_here(
    geo_builds: dict[str, Path],
    local_runs: dict[str, dict[str, Any]],
    tmp_path: Path,
    invoker: str,
    sync: str,
    fault: str,
    tolerance: float,
) -> None:
    build = geo_builds[sync]
    planned = yaml.safe_load((build / "workflow.yaml").read_text())
    local = local_runs[f"{sync} {fault}"]
    rehearsed = trained(build, tmp_path / invoker, "--invoker", invoker, "--rehearse", fault)
    assert rehearsed["status"] == "done" and rehearsed["invoker"] == invoker
    # the same coordinator re-planned the deployed run: a region left, the other took its work
    assert [e["event"] for e in rehearsed["elastic"]].count("replan") >= 1
    (left,) = [name for name, entry in rehearsed["regions"].items() if "left" in entry]
    (stayed,) = [name for name in rehearsed["regions"] if name != left]
    assert left == next(name for name, entry in local["regions"].items() if "left" in entry)
    applied = rehearsed["regions"][left]["applied_iterations"]
    assert rehearsed["regions"][stayed]["iterations"] + applied == planned["run"]["iterations"]  # none lost
    own = next(r["iterations"] for r in planned["regions"] if r["name"] == stayed)
    assert rehearsed["regions"][stayed]["iterations"] > own  # it trained the leaver's remaining iterations
    if invoker == "lambda":  # every range an execution of the region's state machine, with its plan now
        executions = rehearsed["regions"][stayed]["executions"]
        assert all(e["input"]["max_rounds"] == 1 for e in executions)
        assert executions[-1]["input"]["plan"]["iterations"] == rehearsed["regions"][stayed]["iterations"]
    assert abs(rehearsed["test"]["accuracy"] - local["test"]["accuracy"]) <= tolerance


@pytest.mark.slow  # the geo compile
def test_fault_injection_needs_a_rehearsal_and_each_region_its_gateway(
    geo_build: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A region failure is injected by taking its functions down, which only a rehearsal (or the local
    invoker) can; several regions' OpenFaaS runs name each region's gateway."""
    out = str(tmp_path / "out")
    token = tmp_path / "token"
    token.write_text("0123456789abcdef" * 4 + "\n")
    fault = f"--fail-region={US}@50"
    gateways = ["--gateway", f"{US}=http://a", "--gateway", f"{EU}=http://b", "--token-file", str(token)]
    for invoker in (["--invoker", "openfaas", *gateways], ["--invoker", "lambda", "--stack", f"{US}=a"]):
        assert run_main([str(geo_build), "--out", out, *invoker, fault]) == 2
        assert capsys.readouterr().err == (
            "cloudless-run: --fail-region: fault injection takes a region's functions down: only with --rehearse "
            "or local\n"
        )
    for gateways, expected in (
        (["http://a"], f"--gateway http://a: several regions ({US}, {EU}): give REGION=URL"),
        ([f"{US}=http://a"], f"--gateway: no gateway for {EU}; give --gateway REGION=URL for each region"),
        ([f"{US}=http://a", "aws-xx-1=http://b"], "--gateway aws-xx-1=http://b: no region 'aws-xx-1' in the workflow"),
        ([f"{US}=http://a", f"{EU}=b"], f"--gateway {EU}=b: expected an http(s) URL"),
    ):
        argv = [str(geo_build), "--out", out, "--invoker", "openfaas", *(f"--gateway={g}" for g in gateways)]
        assert run_main([*argv, "--token-file", str(token)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"cloudless-run: {expected}") and err.count("\n") == 1, err
