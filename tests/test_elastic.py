"""The elastic control plane: a region's capacity changes or a region fails mid-run, the coordinator
re-plans the inter-region level from the current state, and the run completes with every region's
every round applied exactly once (model averaging: every region's record of each meet names the
same contributions, and every contribution a region wrote is in them; ASGD-GA: every push claimed
one global version). A region that stops answering holds the others up no longer than the region
timeout."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from cloudless.ir import protocol
from cloudless.ir.protocol import Invocation, global_key, global_owner, namespace
from cloudless.ir.workflow import round_ends, round_meets
from cloudless.runtimes.controller import Controller
from cloudless.runtimes.elastic import CapacityChange, RegionFailure, fit_replicas, share_iterations, slowdown
from cloudless.runtimes.region_sync import weighted_mean
from cloudless.runtimes.run import main as run_main
from cloudless.runtimes.run_state import RunSettings
from cloudless.runtimes.staging import trained_state
from cloudless.runtimes.storage import DirectoryChannel
from cloudless.runtimes.tensors import unpack
from tests.conftest import TWO_STAGE_ITERATIONS
from tests.runtime_cases import write_training_data
from tests.test_geo_run import REGIONS, compile_geo, rewrite_workflow, run_geo
from tests.test_protocol import ThreadInvoker

US, EU = REGIONS.split(",")


# --- the re-plan's pieces -------------------------------------------------------------------------


def test_capacity_changes_and_failures_parse_or_say_what_was_expected() -> None:
    assert CapacityChange.parse("aws-eu-west-1@40=2") == CapacityChange("aws-eu-west-1", 40, 2)
    assert RegionFailure.parse("aws-eu-west-1@7") == RegionFailure("aws-eu-west-1", 7)
    for bad in ("aws-eu-west-1", "aws-eu-west-1@x=2", "@4=1", "r@4=-1"):
        with pytest.raises(ValueError, match="REGION@ITERATION=FUNCTIONS"):
            CapacityChange.parse(bad)
    with pytest.raises(ValueError, match="REGION@ITERATION"):
        RegionFailure.parse("aws-eu-west-1@")


def test_replicas_shrink_to_the_capacity_from_the_widest_stage() -> None:
    assert fit_replicas([2, 4, 1], 7) == (2, 4, 1)
    assert fit_replicas([2, 4, 1], 5) == (2, 2, 1)
    assert fit_replicas([3, 3], 4) == (2, 2)
    assert fit_replicas([2, 4, 1], 3) == (1, 1, 1)
    assert fit_replicas([2, 4, 1], 2) is None  # three stages need three functions
    assert slowdown(8, [2, 4], [2, 2]) == 1.0  # the first stage's 4 micro-batches per replica bound both
    assert slowdown(8, [2, 4], [1, 1]) == 2.0


def test_remaining_iterations_follow_the_regions_pace_with_one_per_round_left() -> None:
    # twice as fast: twice the iterations, so both reach the meets together
    assert share_iterations(90, {"a": 0.01, "b": 0.02}, {"a": 3, "b": 3}) == {"a": 60, "b": 30}
    # a slow region still gets one iteration per round left
    assert share_iterations(100, {"a": 0.001, "b": 1.0}, {"a": 5, "b": 5}) == {"a": 95, "b": 5}
    # fewer left than rounds need: each gets its least
    assert share_iterations(3, {"a": 0.01, "b": 0.01}, {"a": 2, "b": 2}) == {"a": 2, "b": 2}


def test_a_replanned_region_keeps_its_round_indices_from_where_it_was_cut() -> None:
    assert round_meets(20, 4) == {5: 0, 10: 1, 15: 2, 20: 3}
    # cut at 7 (round 1 under way), 13 more iterations over rounds 1..3
    assert round_meets(20, 4, since=7, first_round=1) == {11: 1, 15: 2, 20: 3}
    assert set(round_meets(20, 4, since=7, first_round=1)) <= set(range(8, 21))
    assert tuple(round_meets(12, 3)) == round_ends(12, 3)


def test_the_payload_carries_the_coordinators_plan_and_checks_it() -> None:
    event = Invocation(
        3, 9, 1, run="r", since=3, first_round=1, replicas=(1, 2), weight=0.25, region_timeout=5.0, iterations=20
    )
    assert Invocation.from_json(json.loads(json.dumps(event.to_json()))) == event
    for field, bad in (("replicas", [0, 1]), ("replicas", []), ("weight", 1.5), ("region_timeout", -1), ("since", -2)):
        with pytest.raises(ValueError, match=field):
            Invocation.from_json({"start": 0, "stop": 1, field: bad})


def test_a_meet_averages_the_contributions_it_has() -> None:
    x, y = {"w": torch.tensor([1.0, 3.0])}, {"w": torch.tensor([5.0, 7.0])}
    assert torch.equal(weighted_mean([(0.25, x), (0.75, y)])["w"], 0.25 * x["w"] + 0.75 * y["w"])
    # a region left: the weights present are normalised
    assert torch.equal(weighted_mean([(0.25, x)])["w"], x["w"])
    assert torch.allclose(weighted_mean([(0.2, x), (0.2, y)])["w"], torch.tensor([3.0, 5.0]))


# --- runs -----------------------------------------------------------------------------------------


def check_every_contribution_applied_once(out: Path, metrics: dict[str, Any], run: str, stages: int) -> None:
    """Model averaging: for each stage and round, every region's record of what it averaged is the same,
    and it holds exactly the regions whose contribution (not a LEFT_MARK) is in their storage."""
    records: dict[tuple[int, int], list[dict[str, float]]] = {}
    for row in metrics["rounds"]:
        records.setdefault((row["stage"], row["round"]), []).append(row["members"])
    assert records, "no meet recorded what it averaged"
    rounds = 1 + max(k for _, k in records)
    for stage in range(stages):
        for k in range(rounds):
            seen = records.get((stage, k), [])
            assert seen, f"stage {stage} round {k}: no region recorded the meet"
            assert all(members == seen[0] for members in seen), f"stage {stage} round {k}: {seen}"
            wrote = set()
            for region in (US, EU):
                key = protocol.round_key(namespace(run, region), "model-average", stage, k, "model")
                data = DirectoryChannel(out / "storage" / region).try_get(key)
                if data is not None and data != protocol.LEFT_MARK:
                    wrote.add(region)
            assert set(seen[0]) == wrote, f"stage {stage} round {k}: averaged {sorted(seen[0])}, written {wrote}"


def final_states(out: Path, metrics: dict[str, Any], run: str) -> dict[str, dict[str, torch.Tensor]]:
    """Each region's stage 0 checkpoint where it ended."""
    states = {}
    for region, entry in metrics["regions"].items():
        key = protocol.state_key(namespace(run, region), 0, entry["iterations"])
        data = DirectoryChannel(out / "storage" / region).try_get(key)
        if data is not None:
            states[region] = protocol.module_values(unpack(data))
    return states


def two_replicas_in(region: str):
    def change(workflow: dict[str, Any]) -> None:
        for entry in workflow["regions"]:
            if entry["name"] == region:
                for function in entry["functions"]:
                    function["replicas"] = 2
        for step in workflow["steps"]:
            if step["id"].startswith(f"{region}/"):
                step["replicas"] = 2

    return change


@pytest.mark.slow
def test_a_capacity_change_shrinks_the_region_and_moves_its_work(compile_cli, tmp_path: Path) -> None:
    build = tmp_path / "build"
    compile_geo(compile_cli, build, "model-average")
    workflow = rewrite_workflow(build, two_replicas_in(US))
    planned = sum(r["iterations"] for r in workflow["regions"])
    out = tmp_path / "run"
    metrics = run_geo(build, out, "--run-id", "c", "--keep-storage", "--capacity-change", f"{US}@30=1")
    events = metrics["elastic"]
    assert events[0] == {**events[0], "event": "capacity", "region": US, "iteration": 30, "replicas": [1]}
    replan = next(e for e in events if e["event"] == "replan")
    # the shrunk region is half as fast: the other takes more of the rest than its planned share
    assert replan["iterations"][EU] - 30 > next(r["iterations"] for r in workflow["regions"] if r["name"] == EU) - 30
    assert sum(entry["iterations"] for entry in metrics["regions"].values()) == planned  # plan = run
    check_every_contribution_applied_once(out, metrics, "c", 1)
    states = final_states(out, metrics, "c")
    assert sorted(states) == sorted([US, EU])
    for name, value in states[US].items():  # the last meet ends both: the same bits
        assert torch.equal(value, states[EU][name]), name
    assert metrics["test"]["accuracy"] > 0.9


@pytest.mark.slow
def test_a_region_that_stops_answering_holds_the_others_up_no_longer_than_the_region_timeout(
    compile_cli, tmp_path: Path
) -> None:
    build = tmp_path / "build"
    workflow = compile_geo(compile_cli, build, "model-average")
    planned = sum(r["iterations"] for r in workflow["regions"])
    out = tmp_path / "run"
    timeout = 4.0
    options = ["--run-id", "f", "--keep-storage", "--fail-region", f"{EU}@30", "--region-timeout", str(timeout)]
    metrics = run_geo(build, out, *options)
    assert metrics["status"] == "done"
    assert "stopped answering" in metrics["regions"][EU]["left"]
    check_every_contribution_applied_once(out, metrics, "f", 1)
    # us-east waited for the silent region at one meet, for the timeout and not much longer
    trace = json.loads((out / "trace.json").read_text())["traceEvents"]
    meets = sorted(e["dur"] / 1e6 for e in trace if e["ph"] == "X" and e["name"] == "model-average")
    assert timeout - 0.5 <= meets[-1] < timeout + 10, meets[-3:]
    assert meets[-2] < timeout  # once: from then on the departure is known
    # its work moved: the survivor ran the planned iterations minus what the failed region applied
    applied = max(row["round"] for row in metrics["rounds"] if row["region"] == US and EU in row["members"])
    assert metrics["regions"][US]["iterations"] == planned - metrics["regions"][EU]["round_ends"][applied]
    assert metrics["test"]["accuracy"] > 0.9


@pytest.mark.slow
def test_a_region_whose_capacity_cannot_hold_its_stages_leaves_at_once(compile_cli, tmp_path: Path) -> None:
    build = tmp_path / "build"
    compile_geo(compile_cli, build, "model-average")
    out = tmp_path / "run"
    # A long region timeout: the coordinator tells the others, so nobody waits for it.
    options = ["--run-id", "z", "--capacity-change", f"{EU}@20=0", "--region-timeout", "600"]
    metrics = run_geo(build, out, "--keep-storage", *options)
    assert "cannot hold" in metrics["regions"][EU]["left"]
    assert metrics["regions"][EU]["iterations"] == 20
    check_every_contribution_applied_once(out, metrics, "z", 1)
    trace = json.loads((out / "trace.json").read_text())["traceEvents"]
    assert max(e["dur"] / 1e6 for e in trace if e["ph"] == "X" and e["name"] == "model-average") < 60


@pytest.mark.slow
def test_asgd_ga_survives_a_failure_and_a_capacity_change_applying_each_push_once(compile_cli, tmp_path: Path) -> None:
    build = tmp_path / "build"
    workflow = compile_geo(compile_cli, build, "asgd-ga")
    server = workflow["sync"]["server"]
    failing = next(r["name"] for r in workflow["regions"] if r["name"] != server)  # the store stays up
    rewrite_workflow(build, two_replicas_in(server))
    out = tmp_path / "run"
    options = ["--run-id", "a", "--keep-storage", "--fail-region", f"{failing}@20", "--region-timeout", "4"]
    metrics = run_geo(build, out, *options, "--capacity-change", f"{server}@40=1")
    assert [e["event"] for e in metrics["elastic"]].count("replan") == 2
    channel = DirectoryChannel(out / "storage" / server)
    owners = []
    version = 1
    while (owner := channel.try_get(global_key(namespace("a", server), 0, version, "owner"))) is not None:
        owners.append(owner.decode())
        version += 1
    assert len(owners) == len(set(owners))  # no update applied twice
    rounds = len(metrics["regions"][server]["round_ends"])
    assert {global_owner(server, k).decode() for k in range(rounds)} <= set(owners)  # the survivor's every round
    theirs = sorted(int(o.rsplit("round", 1)[1]) for o in owners if o.startswith(failing))
    assert theirs == list(range(len(theirs))) and theirs  # the failed region's rounds up to its failure
    assert metrics["test"]["accuracy"] > 0.9


@pytest.mark.slow
def test_elastic_options_are_checked(compile_cli, tmp_path: Path, capsys) -> None:
    build = tmp_path / "build"
    compile_geo(compile_cli, build, "model-average")
    capsys.readouterr()
    for options, expected in (
        (["--capacity-change", "eu@x"], "expected REGION@ITERATION=FUNCTIONS"),
        (["--capacity-change", "nowhere@3=1"], "nowhere: no such region"),
        (["--fail-region", "nowhere@3"], "nowhere: no such region"),
        (["--region-timeout", "0"], "--region-timeout 0.0: expected a positive number of seconds"),
        (["--resume", "r", "--fail-region", f"{EU}@3"], "--resume cannot replay"),
    ):
        assert run_main([str(build), "--out", str(tmp_path / "run"), *options]) == 2
        assert expected in capsys.readouterr().err
        assert not (tmp_path / "run" / "metrics.json").exists()


def test_a_deployed_region_may_mark_only_a_peers_missing_contribution_and_departure(
    compile_cli, tmp_path: Path
) -> None:
    """Model averaging across regions: a function may write in a peer's bucket only the marks that let
    the others go on without it (the contribution it missed and its departure)."""
    build = tmp_path / "build"
    compile_geo(compile_cli, build, "model-average")
    for name, peer in ((US, EU), (EU, US)):
        template = yaml.safe_load((build / "regions" / name / "template.yaml").read_text())
        functions = [r for r in template["Resources"].values() if r["Type"] == "AWS::Serverless::Function"]
        for resource in functions:
            statements = {st["Sid"]: st for st in resource["Properties"]["Policies"][0]["Statement"]}
            marks = statements["DepartureMarks"]
            assert marks["Action"] == "s3:PutObject"
            parameter = "PeerBucket" + "".join(p.title() for p in peer.split("-"))
            assert [r["Fn::Sub"] for r in marks["Resource"]] == [
                f"arn:${{AWS::Partition}}:s3:::${{{parameter}}}/mlp-digits-geo/*/{peer}/model-average/*/model",
                f"arn:${{AWS::Partition}}:s3:::${{{parameter}}}/mlp-digits-geo/*/{peer}/left",
            ]


@pytest.mark.slow
def test_synchronous_sgd_goes_on_without_a_failed_region(compile_cli, tmp_path: Path) -> None:
    """Under `sync` every iteration is a meet: the survivor marks the failed region's gradient sums of
    one iteration, and from then on takes its own alone (weights normalised)."""
    build = tmp_path / "build"
    workflow = compile_geo(compile_cli, build, "sync")
    out = tmp_path / "run"
    options = ["--run-id", "s", "--keep-storage", "--fail-region", f"{EU}@20", "--region-timeout", "3"]
    metrics = run_geo(build, out, *options)
    assert "stopped answering" in metrics["regions"][EU]["left"]
    assert metrics["regions"][US]["iterations"] == workflow["run"]["iterations"]  # nothing moves under sync
    channel = DirectoryChannel(out / "storage" / EU)
    sums = [channel.try_get(protocol.cross_key(namespace("s", EU), i, 0, "sums")) for i in range(60)]
    marked = [i for i, data in enumerate(sums) if data == protocol.LEFT_MARK]
    assert len(marked) == 1 and marked[0] >= 20  # one meet marked; later ones not even waited for
    assert all(data is not None for data in sums[: marked[0]])  # every earlier iteration's sums met
    assert all(data is None for data in sums[marked[0] + 1 :])
    assert metrics["test"]["accuracy"] > 0.9


def test_a_one_region_build_says_there_is_nothing_to_re_plan(two_stages, tmp_path: Path, capsys) -> None:
    build, workflow, _ = two_stages
    region = workflow.regions[0].name
    for options in (["--fail-region", f"{region}@3"], ["--region-timeout", "5"]):
        assert run_main([str(build), "--out", str(tmp_path / "run"), *options]) == 2
        assert "several regions" in capsys.readouterr().err


def test_a_pipeline_with_fewer_replicas_than_planned_trains_the_same_model(two_stages, tmp_path: Path) -> None:
    """The replicas a capacity change leaves (here (1, 1) for the planned (2, 1)): every stage's
    micro-batches, 1F1B windows and progress follow the invocation's counts, and the model trained
    equals the planned pipeline's (the same sums, in another order)."""
    build, workflow, result = two_stages
    region = workflow.regions[0].name
    assert [f.replicas for f in workflow.regions[0].functions] == [2, 1]
    states = []
    for replicas in ((2, 1), (1, 1)):
        storage = tmp_path / f"storage{replicas[0]}"
        write_training_data(result, DirectoryChannel(storage), region)
        settings = RunSettings(iterations=TWO_STAGE_ITERATIONS, run_id="p", key_timeout_s=60.0, retries=0)
        controller = Controller(workflow, DirectoryChannel(storage), ThreadInvoker(build, storage, region), settings)
        controller.plans[region].replicas = replicas
        record = controller.run()[region]
        assert [p.iteration for p in record.progress] == list(range(TWO_STAGE_ITERATIONS))
        assert {(r.function, r.replica) for r in record.results} == {
            (f.name, k) for f, count in zip(workflow.regions[0].functions, replicas, strict=True) for k in range(count)
        }
        states.append(trained_state(DirectoryChannel(storage), namespace("p", region), 2, TWO_STAGE_ITERATIONS))
    for name, value in states[0].items():
        assert torch.allclose(value, states[1][name], atol=1e-6), name
