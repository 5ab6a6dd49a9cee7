"""The workflow's rules about itself (cloudless.ir.workflow_rules), called on a Workflow without a build folder:
the golden workflows break none, and an edited one gets the key and the message `cloudless-compile --check`
prints (tests/test_check.py checks them through a build)."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from cloudless.ir import workflow_rules as rules
from cloudless.ir.workflow import Workflow

GOLDEN = Path(__file__).resolve().parent / "golden"


def golden(name: str) -> tuple[dict[str, Any], Workflow]:
    document = yaml.safe_load((GOLDEN / name / "workflow.yaml").read_text())
    return document, Workflow.from_json(document)


def with_function(workflow: Workflow, r: int, stage: int, **changes: Any) -> Workflow:
    """The workflow with region `r`'s function of `stage` changed."""
    region = workflow.regions[r]
    functions = tuple(replace(f, **changes) if f.stage == stage else f for f in region.functions)
    regions = list(workflow.regions)
    regions[r] = replace(region, functions=functions)
    return replace(workflow, regions=tuple(regions))


def every_problem(workflow: Workflow, document: dict[str, Any]) -> list[rules.WorkflowProblem | None]:
    regions = range(len(workflow.regions))
    return [
        rules.step_replicas_problem(document),
        rules.batch_problem(workflow),
        *(rules.stage_problem(workflow, document, r) for r in regions),
        *(rules.partition_problem(workflow, r) for r in regions),
        *(rules.stage_inputs_problem(workflow, document, r) for r in regions),
        rules.samples_problem(workflow),
        rules.sync_problem(workflow),
        rules.optimizer_problem(workflow),
    ]


@pytest.mark.parametrize("name", ["mlp_digits", "mlp_digits_geo", "wide_mlp_time", "tricky_time"])
def test_golden_workflows_break_no_rule(name: str) -> None:
    document, workflow = golden(name)
    assert [str(p) for p in every_problem(workflow, document) if p is not None] == []


def test_batch_sizes_that_do_not_multiply_name_all_three_keys() -> None:
    _, workflow = golden("mlp_digits")
    problem = rules.batch_problem(replace(workflow, run=replace(workflow.run, micro_batch=4)))
    assert problem is not None
    assert problem.keys == ["run/micro_batch", "run/micro_batches", "run/global_batch"]
    assert problem.message.startswith("micro_batch 4 x micro_batches 4 = 16, but global_batch is 64:")
    assert problem.message_at("run/global_batch") == problem.message
    assert problem.note_compiled


def test_a_gap_between_stages_names_both_by_their_place_in_the_document() -> None:
    document, workflow = golden("mlp_digits")
    document["regions"][0]["functions"].reverse()  # the keys follow the document, not the stages
    problem = rules.stage_problem(with_function(workflow, 0, 1, blocks=(4, 4)), document, 0)
    assert problem is not None
    assert problem.keys == ["regions/0/functions/0/blocks", "regions/0/functions/1/blocks"]
    assert problem.message.startswith("stage 0 has blocks [0, 2] and stage 1 [4, 4]: the stages must tile")


def test_blocks_out_of_order_and_a_misplaced_package() -> None:
    document, workflow = golden("mlp_digits")
    problem = rules.stage_problem(with_function(workflow, 0, 1, blocks=(4, 3)), document, 0)
    assert problem is not None
    assert (problem.key, problem.message, problem.others) == (
        "regions/0/functions/1/blocks",
        "[4, 3]: the first block is after the last",
        (),
    )
    problem = rules.stage_problem(with_function(workflow, 0, 0, package="elsewhere"), document, 0)
    assert str(problem) == "key regions/0/functions/0/package: 'elsewhere'; expected " + repr(
        "regions/aws-us-east-1/functions/mlp-digits-s0"
    )


def test_a_stage_input_the_stage_before_does_not_send() -> None:
    document, workflow = golden("mlp_digits")
    problem = rules.stage_inputs_problem(with_function(workflow, 0, 1, inputs=("relu_9",)), document, 0)
    assert problem is not None
    assert problem.keys == ["regions/0/functions/1/inputs", "regions/0/functions/0/outputs"]
    assert problem.message == "stage 1 takes ['relu_9'], which stage 0 does not send (its outputs are ['linear_1'])"
    problem = rules.stage_inputs_problem(with_function(workflow, 0, 0, inputs=("pixels",)), document, 0)
    assert problem is not None and problem.keys == ["regions/0/functions/0/inputs", "data/inputs"]


def test_step_replicas_have_a_message_for_either_side() -> None:
    document, _ = golden("mlp_digits")
    edited = copy.deepcopy(document)
    step = edited["steps"][0]
    step["replicas"] += 1
    function_key = next(
        f"regions/0/functions/{f}/replicas"
        for f, function in enumerate(edited["regions"][0]["functions"])
        if function["name"] == step["function"]
    )
    replicas = step["replicas"] - 1
    problem = rules.step_replicas_problem(edited)
    assert problem is not None and problem.keys == ["steps/0/replicas", function_key]
    assert problem.message == f"{replicas + 1}, but function {step['function']!r} has {replicas} ({function_key})"
    assert problem.message_at(function_key) == f"{replicas}, but its steps (steps/0) have {replicas + 1}"


def test_partition_and_data_sources_of_a_second_region() -> None:
    _, workflow = golden("mlp_digits_geo")
    problem = rules.partition_problem(with_function(workflow, 1, 0, blocks=(0, 3)), 1)
    assert problem is not None and problem.key == "regions/1/functions"
    assert problem.message.startswith("blocks [[0, 3]], but region 'aws-us-east-1' has [[0, 4]]")
    west = workflow.regions[1]
    sources = (west.data_sources[0], replace(west.data_sources[1], count=200))
    problem = rules.samples_problem(
        replace(workflow, regions=(workflow.regions[0], replace(west, data_sources=sources)))
    )
    assert problem is not None and problem.key == "regions/1/samples"
    counted = west.data_sources[0].count + 200
    assert problem.message == f"683, but its data_sources hold {counted}"
    assert problem.message_at("regions/1/data_sources/1/count") == (
        f"200, but the region's samples are 683 (its data_sources hold {counted})"
    )


def test_the_inter_region_settings() -> None:
    _, workflow = golden("mlp_digits_geo")
    east, west = workflow.regions
    problem = rules.sync_problem(replace(workflow, sync=replace(workflow.sync, inter_region=None)))
    assert str(problem) == "key sync/inter_region: null, but 2 regions train: their models must meet"
    assert west.weight is not None
    problem = rules.sync_problem(replace(workflow, regions=(replace(east, weight=1.25 - west.weight), west)))
    assert problem is not None and problem.keys == ["regions/0/weight", "regions/1/weight"]
    assert problem.message.startswith("the regions' weights add up to 1.25, not 1")
    problem = rules.sync_problem(replace(workflow, regions=(east, replace(west, iterations=10))))
    assert problem is not None and problem.keys == ["sync/rounds", "regions/1/iterations"]
    assert problem.message.startswith("region 'aws-eu-west-1': 20 rounds over 10 iterations")
    problem = rules.sync_problem(replace(workflow, sync=replace(workflow.sync, inter_region="sync")))
    assert problem is not None and problem.keys == ["regions/0/iterations", "run/iterations"]
    assert problem.message.startswith("region 'aws-us-east-1': iterations 105, but run/iterations 200")


def test_the_optimizer_is_built_as_the_workers_build_it() -> None:
    _, workflow = golden("mlp_digits")
    spec = workflow.optimizer
    problem = rules.optimizer_problem(replace(workflow, optimizer=replace(spec, class_name="Adamm")))
    assert str(problem) == "key optimizer/class: 'Adamm' is not a torch.optim optimizer"
    assert problem is not None and problem.note_compiled
    problem = rules.optimizer_problem(
        replace(workflow, optimizer=replace(spec, options={**spec.options, "betas": (0.9, 0.99)}))
    )
    assert problem is not None and problem.key == "optimizer/options"
    assert problem.message.startswith("torch.optim.SGD refuses them:") and "betas" in problem.message
    problem = rules.optimizer_problem(replace(workflow, optimizer=replace(spec, learning_rates=(0.1,) * 3)))
    assert str(problem) == "key optimizer/learning_rates: 3 rates; expected one per iteration of run/iterations (200)"


def test_a_function_key_follows_the_document() -> None:
    document, _ = golden("wide_mlp_time")
    assert rules.function_key(document, 0, "wide-mlp-s1") == "regions/0/functions/1"
    with pytest.raises(KeyError):
        rules.function_key(document, 0, "no-such-function")
