"""The elastic control plane: a region's capacity changes or a region fails mid-run, the coordinator
re-plans the inter-region level from the current state, and the run completes with every region's
every round applied exactly once (model averaging: every region's record of each meet names the
same contributions, and every contribution a region wrote is in them; ASGD-GA: every push claimed
one global version). A region that stops answering holds the others up no longer than the region
timeout."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from cloudless.ir import protocol
from cloudless.ir.files import load_workflow
from cloudless.ir.protocol import Invocation, global_key, global_owner, namespace
from cloudless.ir.workflow import Region, round_ends, round_meets
from cloudless.runtimes.cli import main as run_main
from cloudless.runtimes.control.controller import Controller
from cloudless.runtimes.control.elastic import (
    CapacityChange,
    RegionFailure,
    extra_rounds,
    fit_replicas,
    share_iterations,
    slowdown,
)
from cloudless.runtimes.control.run import final_model
from cloudless.runtimes.control.run_state import RunSettings
from cloudless.runtimes.control.staging import trained_state
from cloudless.runtimes.function.region_sync import weighted_mean
from cloudless.runtimes.storage.channels import DirectoryChannel
from cloudless.runtimes.storage.tensors import pack, unpack
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


def test_iterations_no_region_has_a_round_left_for_get_new_rounds_of_the_plans_length() -> None:
    # the plan: 20 rounds over 200 iterations, 10 per round
    assert extra_rounds(35, 1, 20, 200) == 4
    assert extra_rounds(5, 1, 20, 200) == 1  # at least one
    assert extra_rounds(3, 2, 20, 200) == 1
    assert extra_rounds(40, 2, 100, 200) == 20  # at most one per iteration of each region


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


def applied_iterations(metrics: dict[str, Any], region: str) -> int:
    """The iterations of a region that left which the others applied, from what the meets recorded: up
    to the end of its last round averaged in (model averaging) or pushed (ASGD-GA)."""
    if metrics["inter_region"] == "asgd-ga":
        rounds = {p["round"] for p in metrics["asgd_pushes"] if p["region"] == region}
    else:
        rounds = {row["round"] for row in metrics["rounds"] if row["region"] != region and region in row["members"]}
    assert rounds == set(range(len(rounds))), rounds  # its rounds from the first on, none skipped
    return metrics["regions"][region]["round_ends"][len(rounds) - 1] if rounds else 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sync", "leaving", "option"),
    [
        # aws-us-east-1 (140 iterations) fails at 100 (its functions may run a few iterations past it
        # before they are killed), long after aws-eu-west-1 (60) finished
        ("asgd-ga", US, f"--fail-region={US}@100"),
        ("asgd-ga", US, f"--capacity-change={US}@130=0"),
        # aws-eu-west-1 (95) leaves in the last round (iterations 90..94): aws-us-east-1's range has no
        # meet left to cut it at (its last round: 99..104), so it runs its plan to the end first
        ("model-average", EU, f"--capacity-change={EU}@93=0"),
    ],
)
def test_a_region_leaving_after_the_others_finished_has_its_iterations_trained_by_them(
    compile_cli, tmp_path: Path, sync: str, leaving: str, option: str
) -> None:
    """Iterations are never lost: what the leaving region had not trained (its rounds nobody applied)
    is re-planned onto the region that had finished its plan (or had no meet left to be cut at), which
    is invoked again with new rounds, so the run trains the plan's every iteration. (The coordinator's
    part, deterministic: `test_a_finished_region_is_re_planned_with_new_rounds_where_it_stands`.)"""
    build = tmp_path / "build"
    workflow = compile_geo(compile_cli, build, sync)
    planned = {r["name"]: r["iterations"] for r in workflow["regions"]}
    staying = next(name for name in planned if name != leaving)
    out = tmp_path / "run"
    metrics = run_geo(build, out, "--run-id", "late", "--keep-storage", "--region-timeout", "3", option)
    assert metrics["status"] == "done"
    regions = metrics["regions"]
    assert regions[leaving]["left"] and staying not in [n for n, r in regions.items() if "left" in r]
    applied = applied_iterations(metrics, leaving)
    assert 0 < applied < planned[leaving]
    # the region that stayed trained the rest: the run trained the plan's total, every iteration once
    assert regions[staying]["iterations"] == sum(planned.values()) - applied > planned[staying]
    assert applied + regions[staying]["iterations"] == metrics["iterations"] == workflow["run"]["iterations"]
    assert regions[leaving]["applied_iterations"] == applied  # metrics.json says what counted
    replan = [e for e in metrics["elastic"] if e["event"] == "replan"]
    assert replan and replan[-1]["iterations"] == {staying: regions[staying]["iterations"]}
    rounds, ends = workflow["sync"]["rounds"], regions[staying]["round_ends"]
    assert ends[-1] == regions[staying]["iterations"]
    # With no round left (finished, or in its last round with no meet left to cut it at: always so
    # under model averaging's barrier here; under ASGD-GA unless a loaded machine kept aws-eu-west-1
    # under way that long, and then it is cut at a meet instead), it met (averaged alone, or pushed)
    # at the run's new rounds, in a range from where its plan had ended.
    if sync == "model-average" or replan[-1]["rounds"] > rounds:
        assert replan[-1]["rounds"] == len(ends) > rounds
        assert ends[:rounds] == list(round_ends(planned[staying], rounds))
        starts = sorted({i["start"] for i in regions[staying]["invocation_log"]})
        assert starts[-1] == planned[staying]  # invoked again from where its plan had ended
    else:
        assert len(ends) == rounds
    if sync == "asgd-ga":
        server = workflow["sync"]["server"]
        channel = DirectoryChannel(out / "storage" / server)
        owners, version = [], 1
        while (owner := channel.try_get(global_key(namespace("late", server), 0, version, "owner"))) is not None:
            owners.append(owner.decode())
            version += 1
        assert len(owners) == len(set(owners))  # no update applied twice
        assert {global_owner(staying, k).decode() for k in range(len(ends))} <= set(owners)  # every round, new ones too
    else:
        check_every_contribution_applied_once(out, metrics, "late", 1)
    losses = [p["loss"] for p in regions[staying]["progress"]]
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    assert metrics["test"]["accuracy"] > 0.9


@pytest.mark.slow
def test_a_finished_region_is_re_planned_with_new_rounds_where_it_stands(compile_cli, tmp_path: Path) -> None:
    """The coordinator alone: aws-eu-west-1 finished its 60 iterations and waits at its end when
    aws-us-east-1 (the ASGD-GA server, 140 iterations) leaves with 15 of its 20 rounds pushed (105
    iterations): the 35 left go to aws-eu-west-1 at once, over new rounds (the plan's 10 iterations per
    round), from where it stands; its next range carries them."""
    build = tmp_path / "build"
    compile_geo(compile_cli, build, "asgd-ga")
    workflow = load_workflow(build / "workflow.yaml")
    assert workflow.sync.server == US and workflow.sync.rounds == 20
    assert {r.name: r.iterations for r in workflow.regions} == {US: 140, EU: 60}
    storage = tmp_path / "storage"
    settings = RunSettings(iterations=workflow.run.iterations, run_id="u")
    controller = Controller(workflow, DirectoryChannel(storage), ThreadInvoker(build, storage, US), settings)
    for k in range(15):
        key = global_key(namespace("u", US), 0, 1 + k, "owner")
        DirectoryChannel(storage).put(key, global_owner(US, k))
    eu = workflow.regions[1]

    def range_ended(region: Region, at: int) -> None:  # as the region's thread does
        with controller.lock:
            controller.ranges.pop(region.name)
            controller._range_ended(region, at)

    assert controller._next_stop(EU, 0) == 60
    range_ended(eu, 60)
    assert controller._next_stop(US, 0) == 140
    with controller.lock:
        controller._leave(US, "gone", tell=False)
    plan = controller.plans[EU]
    assert plan.end == 95  # the 200 - 105 - 60 left, at once
    assert controller.applied_iterations(US) == 105
    assert (plan.end, plan.rounds, plan.since, plan.first_round, plan.weight) == (95, 24, 60, 20, 1.0)
    assert controller.round_ends(EU) == (*round_ends(60, 20), *(60 + end for end in round_ends(35, 4)))
    assert controller._next_stop(EU, 60) == 95  # invoked again: the rest of the plan
    event = controller._event(eu.functions[0], 0, 60, 95, 0)
    assert (event.iterations, event.rounds, event.since, event.first_round) == (95, 24, 60, 20)
    range_ended(eu, 95)
    assert controller._next_stop(EU, 95) is None  # nobody else trains: the run is over
    replan = controller.events[-1]
    assert replan["event"] == "replan" and replan["iterations"] == {EU: 95} and replan["rounds"] == 24


def test_asgd_gas_model_is_the_newest_global_version_even_one_a_region_wrote_before_leaving(
    compile_cli, tmp_path: Path
) -> None:
    """aws-us-east-1 (the server) pushed the newest versions and left with its iterations all applied:
    the model is that version (the stage's newest written one), not the stale one aws-eu-west-1
    holds."""
    build = tmp_path / "build"
    compile_geo(compile_cli, build, "asgd-ga")
    workflow = load_workflow(build / "workflow.yaml")
    function = workflow.regions[1].functions[0]
    initial = unpack((build / function.package / "weights.safetensors").read_bytes())
    channel = DirectoryChannel(tmp_path / "storage")
    stale = {protocol.MODULE_PREFIX + k: torch.zeros_like(v) for k, v in initial.items()}
    channel.put(protocol.state_key(namespace("g", EU), 0, 60), pack({**stale, protocol.BASE_VERSION: torch.tensor(2)}))
    versions = {3: pack({k: torch.full_like(v, 3.0) for k, v in initial.items()}), 4: protocol.LEFT_MARK}
    for version in range(1, 5):
        channel.put(global_key(namespace("g", US), 0, version, "owner"), global_owner(US, version))
        channel.put(global_key(namespace("g", US), 0, version, "model"), versions.get(version, b"older"))
    state = final_model(build, channel, workflow, "g", {EU: 60})
    assert sorted(state) == sorted(initial)
    assert all(torch.equal(state[k], torch.full_like(v, 3.0)) for k, v in initial.items())  # v4 was voided


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
            parameter = "PeerBucket" + "".join(p.title() for p in peer.split("-"))
            # a peer's rights hold once its bucket is given (Fn::If on HasPeerBucket<Region>)
            conditional = [st["Fn::If"] for st in resource["Properties"]["Policies"][0]["Statement"] if "Fn::If" in st]
            assert {condition for condition, _, _ in conditional} == {f"Has{parameter}"}
            statements = {granted["Sid"]: granted for _, granted, _ in conditional}
            marks = statements["DepartureMarks" + parameter.removeprefix("PeerBucket")]
            assert marks["Action"] == "s3:PutObject"
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
