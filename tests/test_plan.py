"""The planning pass: plan.json, baselines never better than the plan, catalog and infeasibility errors;
the typed plan (ir/plan.py) against plan.json's bytes and its schema."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import types
import typing
from collections.abc import Mapping
from dataclasses import fields
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import pytest

from cloudless.compiler.frontend.model_file import load_model_file
from cloudless.compiler.planner.cost_model import OutOfRange
from cloudless.compiler.planner.plan import PlanInfeasible, PlanOptions, plan_training
from cloudless.compiler.planner.plan_record import plan_ir
from cloudless.compiler.planner.simulate import simulate
from cloudless.ir import Block, BlockChain, MachineInfo
from cloudless.ir import plan as ir_plan
from cloudless.ir.catalog import AWS_REGIONS, aws_region_of, load_catalog
from cloudless.ir.files import load_plan, load_workflow, plan_text, save_plan
from cloudless.ir.graph import dumps
from cloudless.ir.plan import HEADER_KEYS, BaselinePlan, TrainingPlan, document_classes, json_key
from cloudless.ir.schema import SchemaError, load_schema, read_yaml, validate

from .conftest import MODELS, SAMPLES

GOLDEN_PLANS = sorted((Path(__file__).resolve().parent / "golden").glob("*/plan.json"))


@pytest.mark.parametrize(
    "flags",
    [
        pytest.param(["--objective", "cost"], marks=pytest.mark.slow),
        ["--objective", "time"],
        pytest.param(["--deadline", "100000"], marks=pytest.mark.slow),
        ["--objective", "time", "--budget", "10"],
    ],
)
def test_plan_is_no_worse_than_any_feasible_baseline(flags, compile_cli, tmp_path: Path) -> None:
    out = tmp_path / "build"
    code, stdout, stderr = compile_cli(str(SAMPLES / "mlp_digits.py"), "-o", str(out), "--repeats", "1", *flags)
    assert code == 0, stderr
    plan = load_plan(out / "plan.json")
    assert "  plan        aws-us-east-1" in stdout and "baseline    data-parallel" in stdout
    feasible = [b for b in plan.baselines if b.feasible]
    assert {b.name for b in plan.baselines} == {"data-parallel", "equal-parameters", "time-balanced"}
    assert feasible
    for baseline in feasible:
        ratio = baseline.time_ratio if plan.objective.startswith("time") else baseline.cost_ratio
        assert ratio is not None and ratio <= 1 + 1e-9, baseline
    assert plan.micro_batches * plan.micro_batch == plan.global_batch == 64
    assert plan.predicted.per_run.iterations == 200
    assert plan.predicted.per_epoch is not None
    assert plan.predicted.per_epoch.iterations == 23  # 1437 training digits / 64
    stages = plan.stages
    assert stages[0].blocks[0] == 0 and stages[-1].blocks[1] == 4
    solver = plan.solver
    assert solver.status in ("optimal", "feasible") and solver.time_limit_s > 0
    assert solver.gap is None or solver.gap >= 0
    if solver.status == "optimal":
        assert solver.gap == 0


def synthetic_chain(param_gb: float, blocks: int = 4) -> BlockChain:
    per_block = int(param_gb * 2**30 / blocks)
    return BlockChain(
        model="huge.py",
        batch_size=1,
        blocks=[
            Block(i, i, i, [f"n{i}"], [f"layer{i}"], 10**9, per_block, 0, 10**7, 10**6, 10**6, [], 0.5, 1.0)
            for i in range(blocks)
        ],
        shared_params={},
        machine=MachineInfo(100.0, 2, 2, "test"),
        profile_repeats=1,
    )


def plan_for(chain: BlockChain, **options) -> None:
    plan_training(chain, load_model_file(MODELS / "tricky.py"), PlanOptions(**options))


def test_model_far_above_ten_functions_of_ten_gb_is_one_clear_error() -> None:
    with pytest.raises(
        PlanInfeasible,
        match=r"parameters, gradients and optimizer state need 400.0 GB, but 10 "
        r"functions of 10240 MB hold 96.1 GB.*allow more functions",
    ):
        plan_for(synthetic_chain(200, blocks=40), max_functions=10)


def test_block_larger_than_any_function_names_the_block() -> None:
    chain = synthetic_chain(1, blocks=20)
    chain.blocks[3].param_bytes = 8 * 2**30  # 16 GB with its gradients: no function holds it
    with pytest.raises(PlanInfeasible, match=r"block 3 alone needs \d+ MB on the largest function \(10240 MB"):
        plan_for(chain)


def test_deadline_below_the_fastest_plan_names_both() -> None:
    with pytest.raises(PlanInfeasible, match=r"the fastest plan takes .* above --deadline 0.001 s; raise the deadline"):
        plan_for(synthetic_chain(1), objective="cost-under-deadline", deadline=0.001)


def test_budget_below_the_cheapest_plan_names_both() -> None:
    with pytest.raises(PlanInfeasible, match=r"the cheapest plan costs .* above --budget 1e-09 USD"):
        plan_for(synthetic_chain(1), objective="time-under-budget", budget=1e-9)


def test_catalog_errors_name_file_and_key(tmp_path: Path, compile_cli) -> None:
    default = load_catalog()
    assert default.regions[0].name == "aws-us-east-1" and default.regions[0].max_memory_mb == 10240
    bad = tmp_path / "cloud.yaml"
    bad.write_text("apiVersion: cloudless/v1\nkind: RegionCatalog\nregions:\n  - name: r1\n    provider: aws\n")
    with pytest.raises(SchemaError, match=r"cloud.yaml: key regions/0: '\w+' is a required property"):
        load_catalog(bad)
    bad.write_text("regions: [\n")
    with pytest.raises(SchemaError, match=r"cloud.yaml:2: not valid YAML"):
        load_catalog(bad)
    # Numbers a schema's minimum lets through: NaN and infinity (YAML's .nan, .inf), by key.
    text = resources.files("cloudless.ir").joinpath("catalogs", "default.yaml").read_text()
    for old, new, key in (
        ("gb_second: 0.0000166667", "gb_second: .nan", "regions/0/prices/gb_second: nan"),
        ("max_mb_per_s: 90", "max_mb_per_s: .inf", "regions/0/network/max_mb_per_s: inf"),
    ):
        assert old in text, old
        bad.write_text(text.replace(old, new, 1))
        with pytest.raises(SchemaError, match=f"cloud.yaml: key {key}; expected a finite number"):
            load_catalog(bad)
    # An alias bomb is refused before it expands (nine levels of ten: a billion strings).
    bomb = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [{','.join(['*' + chr(97 + i)] * 10)}]\n" for i in range(8)
    )
    bad.write_text(bomb)
    with pytest.raises(SchemaError, match=r"cloud.yaml:2: YAML aliases \(\*name\) are not accepted"):
        load_catalog(bad)
    # Refused before any pass: the model is never built (its build_model() would leave a mark).
    model = tmp_path / "marked.py"
    marker = tmp_path / "built"
    mark = f"def build_model() -> nn.Module:\n    open({str(marker)!r}, 'w').close()"
    model.write_text((MODELS / "tricky.py").read_text().replace("def build_model() -> nn.Module:", mark))
    assert "open(" in model.read_text()
    for option in ("--region", "--regions"):
        code, _, stderr = compile_cli(str(model), "-o", str(tmp_path / "b"), "--repeats", "1", option, "mars-1")
        assert code == 2 and "no region 'mars-1'; the catalog has aws-us-east-1, aws-eu-west-1" in stderr
        assert not (tmp_path / "b").exists() and not marker.exists()


def _default_catalog_text() -> str:
    return resources.files("cloudless.ir").joinpath("catalogs", "default.yaml").read_text()


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("min_mb_per_s: 50", "min_mbps: 50", "key regions/0/network/min_mbps: renamed to min_mb_per_s"),
        ("max_mb_per_s: 90", "max_mbps: 90", "key regions/0/network/max_mbps: renamed to max_mb_per_s"),
        (
            "{min_mb_per_s: 50, max_mb_per_s: 90,",
            "{min_mb_per_s: 50, max_mbps: 90,",
            "key regions/1/network/max_mbps: renamed to max_mb_per_s",
        ),
        ("default: {mb_per_s: 100,", "default: {mbps: 100,", "key wan/default/mbps: renamed to mb_per_s"),
        (
            "wan:",
            "wan:\n  links: [{between: [aws-us-east-1, aws-eu-west-1], mbps: 50, latency_s: 0.1}]\n ",
            "key wan/links/0/mbps: renamed to mb_per_s",
        ),
    ],
)
def test_catalog_keys_in_megabits_spelling_are_renamed_with_a_clear_error(
    old: str, new: str, message: str, tmp_path: Path, compile_cli
) -> None:
    """Bandwidths are megabytes per second, named *_mb_per_s; the old *mbps keys (which read as megabits)
    get their own message, not the schema's generic one, also through the CLI (exit 2, before any pass)."""
    text = _default_catalog_text()
    assert old in text, old
    bad = tmp_path / "cat.yaml"
    bad.write_text(text.replace(old, new, 1))
    with pytest.raises(SchemaError, match=rf"^{bad}: {message} \(megabytes per second\)$"):
        load_catalog(bad)
    code, stdout, stderr = compile_cli(str(MODELS / "tricky.py"), "-o", str(tmp_path / "b"), "-c", str(bad))
    assert code == 2 and stdout == ""
    assert stderr == f"cloudless-compile: error: {bad}: {message} (megabytes per second)\n"
    assert not (tmp_path / "b").exists()


def test_catalog_bandwidths_are_megabytes_per_second() -> None:
    catalog = load_catalog()
    region = catalog.regions[0]
    assert (region.min_mb_per_s, region.max_mb_per_s) == (50, 90)
    assert region.bandwidth_bps(min(region.tiers_mb)) == 50e6 and region.bandwidth_bps(max(region.tiers_mb)) == 90e6
    assert catalog.link(*(r.name for r in catalog.regions)).bandwidth_bps == 100e6
    properties = load_schema("catalog")["$defs"]["link"]["properties"]
    assert "mb_per_s" in properties and "mbps" not in properties


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (
            "name: aws-us-east-1",
            "name: my-cloud",
            "key regions/0/name: 'my-cloud' is not an AWS region name; aws regions are named aws-<region>, "
            "e.g. aws-us-east-1",
        ),
        ("name: aws-eu-west-1", "name: aws-mars-1", "key regions/1/name: 'aws-mars-1' is not an AWS region name"),
        (
            "max_memory_mb: 10240               #",
            "max_memory_mb: 20480  #",
            "key regions/0/limits/max_memory_mb: 20480 MB",
        ),
        ("timeout_s: 900                     #", "timeout_s: 901  #", "key regions/0/limits/timeout_s: 901 s; Lambda"),
        ("timeout_s: 900                     #", "timeout_s: 0.5  #", "key regions/0/limits/timeout_s: 0.5 is less"),
    ],
)
def test_catalog_values_a_generated_build_would_reject_are_catalog_errors(
    old: str, new: str, message: str, tmp_path: Path, compile_cli
) -> None:
    """An aws region deploys to the AWS region its name gives (samconfig.toml) within Lambda's limits: a
    catalog that breaks them is refused at load time naming its key, not by the build's own check after
    the compile (which reports a Cloudless bug)."""
    text = _default_catalog_text()
    assert old in text, old
    bad = tmp_path / "cat.yaml"
    bad.write_text(text.replace(old, new, 1))
    with pytest.raises(SchemaError, match=re.escape(f"{bad}: {message}")):
        load_catalog(bad)
    code, stdout, stderr = compile_cli(str(MODELS / "tricky.py"), "-o", str(tmp_path / "b"), "-c", str(bad))
    assert code == 2 and stdout == "" and stderr.startswith(f"cloudless-compile: error: {bad}: {message}")
    assert stderr.count("\n") == 1 and not (tmp_path / "b").exists()


def test_a_key_given_twice_is_an_error_naming_both_lines(tmp_path: Path, compile_cli) -> None:
    """YAML's last-wins for a repeated key is refused: a catalog whose second gb_second is 1000x the first
    is one error naming the file, the second line and the first, through the CLI too (exit 2, before any
    pass); a workflow.yaml read back is held to the same rule."""
    text = _default_catalog_text()
    first = "      gb_second: 0.0000166667\n"
    assert first in text
    bad = tmp_path / "catalog.yaml"
    bad.write_text(text.replace(first, first + "      gb_second: 0.0166667\n", 1))
    line = text[: text.index(first)].count("\n") + 1
    message = f"{bad}:{line + 1}: key 'gb_second' given twice (first at line {line})"
    with pytest.raises(SchemaError, match=f"^{re.escape(message)}$"):
        load_catalog(bad)
    code, stdout, stderr = compile_cli(str(MODELS / "tricky.py"), "-o", str(tmp_path / "b"), "-c", str(bad))
    assert (code, stdout, stderr) == (2, "", f"cloudless-compile: error: {message}\n")
    assert not (tmp_path / "b").exists()
    # nested mappings and flow style alike; a key repeated in different mappings is no repeat
    nested = tmp_path / "nested.yaml"
    nested.write_text("a: {x: 1, y: 2}\nb:\n  x: 1\n  c: {z: 1, z: 2}\n")
    with pytest.raises(SchemaError, match=f"^{re.escape(str(nested))}:4: key 'z' given twice \\(first at line 4\\)$"):
        read_yaml(nested.read_text(), str(nested))
    workflow = tmp_path / "workflow.yaml"
    workflow.write_text("apiVersion: cloudless/v1\nkind: Workflow\nkind: Workflow\n")
    with pytest.raises(SchemaError, match=f"^{re.escape(str(workflow))}:3: key 'kind' given twice"):
        load_workflow(workflow)


def test_non_aws_regions_may_have_any_name(tmp_path: Path) -> None:
    text = _default_catalog_text().replace(
        "name: aws-us-east-1\n    provider: aws", "name: my-cloud\n    provider: openfaas"
    )
    path = tmp_path / "cat.yaml"
    path.write_text(text.replace("max_memory_mb: 10240 ", "max_memory_mb: 20480 ", 1))
    assert load_catalog(path).regions[0].name == "my-cloud"


def test_aws_region_list_is_the_one_cfn_lint_checks_templates_for() -> None:
    """The catalog's list of AWS regions (which the build's check also uses) is cfn-lint's: a region cfn-lint
    did not know could not be linted for, and one it knows should not be refused."""
    from cfnlint.helpers import REGIONS

    assert AWS_REGIONS == set(REGIONS)
    assert aws_region_of("aws-us-east-1") == "us-east-1" and aws_region_of("aws-mars-1") is None
    assert aws_region_of("us-east-1") is None


def _catalog_with_prices(tmp_path: Path, value: str, only: tuple[str, ...] | None = None) -> Path:
    text = _default_catalog_text()
    keys = only or (
        "gb_second",
        "per_million_requests",
        "storage_put_per_1000",
        "storage_get_per_1000",
        "egress_per_gb",
        "state_transition_per_1000",
    )
    text = re.sub(rf"\b({'|'.join(keys)}): [0-9.]+", rf"\g<1>: {value}", text)
    path = tmp_path / f"prices-{value}.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("objective", "limits"),
    [("cost", {}), ("time", {}), ("time-under-budget", {"budget": 1.0}), ("cost-under-deadline", {"deadline": 1e5})],
)
def test_zero_prices_give_a_plan_whose_cost_ratios_are_null(objective: str, limits: dict, tmp_path: Path) -> None:
    """A free platform: every cost is 0, so no baseline has a cost ratio (null in plan.json), and no
    figure is infinite or NaN (plan.json would not be JSON)."""
    options = PlanOptions(catalog=_catalog_with_prices(tmp_path, "0"), objective=objective, **limits)
    chain = synthetic_chain(0.01)
    result = plan_training(chain, load_model_file(MODELS / "tricky.py"), options)
    document = plan_ir(result, chain, options, simulate(result.problem, result.solution.plan))
    text = plan_text(document)  # checked against its schema
    assert "Infinity" not in text and "NaN" not in text
    assert document.predicted.cost_usd == 0
    feasible = [b for b in document.baselines if b.feasible]
    assert feasible and all(b.cost_ratio is None and b.time_ratio is not None for b in feasible)


@pytest.mark.slow
def test_zero_prices_compile_and_extreme_ones_are_one_line(tmp_path: Path, compile_cli) -> None:
    """Through the CLI: a free catalog compiles (the baselines' cost ratios printed n/a), one with one price
    zero too; prices of 1e300 end with one line naming the region (exit 2, nothing written)."""
    profile = Path(__file__).resolve().parent / "golden" / "mlp_digits" / "ir" / "blocks.json"
    model = str(SAMPLES / "mlp_digits.py")
    free = _catalog_with_prices(tmp_path, "0")
    code, stdout, stderr = compile_cli(model, "-o", str(tmp_path / "free"), "-c", str(free), "--profile", str(profile))
    assert code == 0, stderr
    assert "n/a cost)" in stdout and "inf" not in stdout.lower()
    plan = load_plan(tmp_path / "free" / "plan.json")
    assert [b.cost_ratio for b in plan.baselines if b.feasible] == [None] * len(plan.baselines)
    report = (tmp_path / "free" / "report.md").read_text()
    assert "| n/a |" in report and "n/a: the baseline's figure is 0" in report
    one = _catalog_with_prices(tmp_path, "0", ("gb_second",))
    code, _, stderr = compile_cli(
        model, "-o", str(tmp_path / "one"), "-c", str(one), "--profile", str(profile), "-q", "--objective", "time"
    )
    assert code == 0, stderr
    huge = _catalog_with_prices(tmp_path, "1.0e+300")
    code, stdout, stderr = compile_cli(model, "-o", str(tmp_path / "huge"), "-c", str(huge), "--profile", str(profile))
    assert code == 2 and stdout == "" and stderr.count("\n") == 1
    assert stderr.startswith("cloudless-compile: error: catalog region aws-us-east-1: its prices make one iteration ")
    assert not (tmp_path / "huge").exists()


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        (
            "min_mb_per_s: 50 ",
            "min_mb_per_s: 1.0e-300 ",
            "regions/0/network/min_mb_per_s: 1e-300 is less than the minimum",
        ),
        ("default: {mb_per_s: 100,", "default: {mb_per_s: 0.0001,", "wan/default/mb_per_s: 0.0001 is less than"),
        (
            "runtime_overhead_mb: 400 ",
            "runtime_overhead_mb: 1.0e+300 ",
            "regions/0/memory/runtime_overhead_mb: 1e+300 MB leaves no memory for the model in the largest tier",
        ),
    ],
)
def test_catalog_figures_no_build_could_hold_are_catalog_errors(
    old: str, new: str, message: str, tmp_path: Path
) -> None:
    """A bandwidth below what workflow.yaml records (0.001 MB/s), a runtime larger than every function."""
    text = _default_catalog_text()
    assert old in text, old
    bad = tmp_path / "cat.yaml"
    bad.write_text(text.replace(old, new, 1))
    with pytest.raises(SchemaError, match=re.escape(f"{bad}: key {message}")):
        load_catalog(bad)


def test_extreme_wan_figures_are_one_clear_error(tmp_path: Path) -> None:
    """Between regions: a link or an egress price that puts one transfer beyond any schedule is refused
    naming it, rather than leaving the schedule's MILP without an answer."""
    text = _default_catalog_text()
    chain = synthetic_chain(0.01)
    model_file = load_model_file(SAMPLES / "mlp_digits_geo.py")
    for old, new, message in (
        ("latency_s: 0.08}", "latency_s: 1.0e+300}", "catalog wan link aws-us-east-1 <-> aws-eu-west-1: one transfer"),
        ("egress_per_gb: 0.02 ", "egress_per_gb: 1.0e+300 ", "catalog region aws-us-east-1: sending"),
    ):
        path = tmp_path / "cat.yaml"
        path.write_text(text.replace(old, new, 1))
        options = PlanOptions(catalog=path, regions=("aws-us-east-1", "aws-eu-west-1"))
        with pytest.raises(OutOfRange, match=re.escape(message)):
            plan_training(chain, model_file, options)


@pytest.mark.slow
def test_plan_json_has_the_same_shape_when_profiled_again(compile_cli, tmp_path: Path) -> None:
    docs = []
    for name in ("a", "b"):
        assert compile_cli(str(MODELS / "tricky.py"), "-o", str(tmp_path / name), "--repeats", "1", "-q")[0] == 0
        docs.append(json.loads((tmp_path / name / "plan.json").read_text()))
    # Measured block times differ between runs; the structure of the plan may follow them, but the
    # document's shape and the solver's proof do not.
    assert docs[0].keys() == docs[1].keys()
    assert docs[0]["solver"]["status"] == docs[1]["solver"]["status"] == "optimal"


# --- the typed plan --------------------------------------------------------------------------------


@pytest.mark.parametrize("path", GOLDEN_PLANS, ids=lambda p: p.parent.name)
def test_golden_plan_reads_back_to_the_same_object_and_bytes(path: Path, tmp_path: Path) -> None:
    text = path.read_text()
    plan = load_plan(path)
    assert isinstance(plan, TrainingPlan)
    assert TrainingPlan.from_json(plan.to_json()) == plan
    assert dumps(plan.to_json()) == plan_text(plan) == text  # the file as the compiler writes it
    save_plan(plan, tmp_path / "plan.json")
    assert (tmp_path / "plan.json").read_text() == text
    # Keys in the order the compiler has always written them (the file itself sorts them).
    assert list(plan.to_json())[:4] == ["apiVersion", "kind", "model", "region"]


def test_the_golden_plans_cover_both_forms() -> None:
    plans = [load_plan(path) for path in GOLDEN_PLANS]
    several = [p for p in plans if p.regions is not None]
    assert several and len(several) < len(plans)
    assert "regions" not in plans[plans.index(next(p for p in plans if p.regions is None))].to_json()
    assert any(p.regions is not None and p.regions.moves for p in several)


def test_an_infeasible_baseline_and_no_epoch_round_trip() -> None:
    plan = load_plan(GOLDEN_PLANS[0])
    infeasible = BaselinePlan("too-big", "cannot fit", False, "block 3 needs 20000 MB", None, (), None, None, None)
    changed = dataclasses.replace(
        plan,
        baselines=(*plan.baselines, infeasible),
        predicted=dataclasses.replace(plan.predicted, per_epoch=None),
        deadline_s=100.0,
        solver=dataclasses.replace(plan.solver, gap=None),
    )
    document = changed.to_json()
    validate(document, "plan")
    assert document["baselines"][-1]["predicted"] is None and document["predicted"]["per_epoch"] is None
    assert TrainingPlan.from_json(json.loads(dumps(document))) == changed


def test_a_document_of_another_kind_is_refused() -> None:
    document = load_plan(GOLDEN_PLANS[0]).to_json()
    with pytest.raises(ValueError, match="not a cloudless/v1 Plan"):
        TrainingPlan.from_json({**document, "kind": "Workflow"})
    del document["solver"]
    with pytest.raises(ValueError, match="key 'solver' missing"):
        TrainingPlan.from_json(document)


def _resolve(node: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if ref is None:
        return node
    assert ref.startswith("#/$defs/"), ref
    return load_schema("plan")["$defs"][ref.removeprefix("#/$defs/")]


def _check_type(hint: Any, node: dict[str, Any], where: str) -> None:
    """The schema `node` admits exactly the values of the type `hint` (as far as JSON tells them apart)."""
    node = _resolve(node)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        if "oneOf" in node:
            assert len(node["oneOf"]) == 2 and {"type": "null"} in node["oneOf"], where
            (other,) = [n for n in node["oneOf"] if n != {"type": "null"}]
            _check_type(inner, other, where)
        else:
            kinds = node["type"]
            assert isinstance(kinds, list) and "null" in kinds and len(kinds) == 2, where
            _check_type(inner, {**node, "type": next(k for k in kinds if k != "null")}, where)
        return
    if typing.get_origin(hint) is Literal:
        assert set(node.get("enum", [node.get("const")])) == set(args), where
        return
    if origin is tuple:
        assert node["type"] == "array", where
        if len(args) == 2 and args[1] is Ellipsis:
            _check_type(args[0], node["items"], f"{where}[]")
        else:
            assert node["minItems"] == node["maxItems"] == len(args), where
            for arg in args:
                _check_type(arg, node["items"], f"{where}[]")
        return
    if origin in (dict, Mapping):
        assert node["type"] == "object" and args[0] is str, where
        _check_type(args[1], node["additionalProperties"], f"{where}{{}}")
        return
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        _check_object(hint, node, where)
        return
    expected = {int: "integer", float: "number", str: "string", bool: "boolean"}[hint]
    assert node["type"] == expected, (where, node, hint)


def _check_object(cls: type, node: dict[str, Any], where: str) -> None:
    assert node["type"] == "object" and node["additionalProperties"] is False, where
    header = HEADER_KEYS if cls is TrainingPlan else ()
    keys = [*header, *(json_key(f) for f in fields(cls))]
    assert set(node["properties"]) == set(keys), (where, cls.__name__)
    optional = {json_key(f) for f in fields(cls) if f.metadata.get("omit_none")}
    assert set(node["required"]) == set(keys) - optional, (where, cls.__name__)
    hints = typing.get_type_hints(cls)
    for item in fields(cls):
        hint = hints[item.name]
        if item.metadata.get("omit_none"):  # None is an absent key, not a null
            (hint,) = [a for a in typing.get_args(hint) if a is not type(None)]
        _check_type(hint, node["properties"][json_key(item)], f"{where}/{json_key(item)}")


def test_schema_and_dataclasses_agree() -> None:
    """Every schema property is a field of the matching dataclass and every field a property, with the
    same type and the same required keys, recursively from the document's top."""
    schema = load_schema("plan")
    _check_object(TrainingPlan, schema, "")
    assert schema["properties"]["apiVersion"] == {"const": "cloudless/v1"}
    assert schema["properties"]["kind"] == {"const": "Plan"}
    # Every class of the module is part of the document (none left unchecked).
    defined = {
        value
        for value in vars(ir_plan).values()
        if isinstance(value, type) and dataclasses.is_dataclass(value) and value.__module__ == ir_plan.__name__
    }
    assert defined == set(document_classes())


def test_ir_plan_and_timeline_import_the_standard_library_only() -> None:
    code = (
        "import sys; before = set(sys.modules); "
        "import cloudless.ir.plan, cloudless.ir.timeline; "
        "print('\\n'.join(sorted(set(sys.modules) - before)))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.split()
    foreign = [
        name
        for name in loaded
        if name.split(".")[0] not in sys.stdlib_module_names
        and name not in ("cloudless", "cloudless.ir")
        and not name.startswith(("cloudless.ir.", "__editable__"))
    ]
    assert foreign == []


def test_a_region_of_another_provider_gets_openfaas_files_only(compile_cli, tmp_path: Path) -> None:
    """SAM deploys to AWS only: with the default --target both, an OpenFaaS region gets its stack and
    no template or samconfig entry (these used to fail the build's own check, "a Cloudless bug")."""
    text = resources.files("cloudless.ir").joinpath("catalogs", "default.yaml").read_text()
    text = text.replace("name: aws-us-east-1\n    provider: aws", "name: of-us-east-1\n    provider: openfaas", 1)
    catalog = tmp_path / "cloud.yaml"
    catalog.write_text(text)
    root = Path(__file__).resolve().parent.parent
    build = tmp_path / "build"
    profile = root / "tests/golden/mlp_digits/ir/blocks.json"
    sample = str(root / "samples/mlp_digits.py")
    code, _, err = compile_cli(sample, "-o", str(build), "-c", str(catalog), "--profile", str(profile), "-q")
    assert code == 0, err
    assert (build / "regions/of-us-east-1/stack.yaml").is_file()
    assert not (build / "regions/of-us-east-1/template.yaml").exists()
    assert not (build / "samconfig.toml").exists()
    assert compile_cli("--check", str(build))[0] == 0
