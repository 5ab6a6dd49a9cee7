"""Platform limits are planning constraints: the catalog carries them (OpenFaaS CE or Pro, Lambda's
concurrency as limits.max_functions, Step Functions' Map concurrency), the planner keeps every plan within
the limits of the deployment files it builds (PlanOptions.targets), an error names the limit that binds and
how to lift it, and every plan it returns is emitted: above 40 workers as a Distributed Map."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

import pytest
import yaml

from cloudless.compiler.errors import CompileError
from cloudless.compiler.frontend.model_file import load_model_file
from cloudless.compiler.planner.plan import PlanInfeasible, PlanOptions, plan_training
from cloudless.ir import BlockChain
from cloudless.ir.catalog import (
    DISTRIBUTED_MAP_MAX_CONCURRENCY,
    OPENFAAS_CE_MAX_FUNCTIONS,
    OPENFAAS_CE_MAX_REPLICAS,
    load_catalog,
    platform_limits,
)
from cloudless.ir.schema import SchemaError

from .conftest import MODELS
from .test_plan import synthetic_chain

GOLDEN = Path(__file__).resolve().parent / "golden"
SAM, OPENFAAS, BOTH = frozenset({"sam"}), frozenset({"openfaas"}), frozenset({"openfaas", "sam"})


def catalog(tmp_path: Path, **region: object) -> Path:
    """The default catalog with these keys set on its first region (aws-us-east-1)."""
    document = yaml.safe_load(resources.files("cloudless.ir").joinpath("catalogs", "default.yaml").read_text())
    for key, value in region.items():
        if key.startswith("limits."):
            document["regions"][0]["limits"][key.removeprefix("limits.")] = value
        else:
            document["regions"][0][key] = value
    path = tmp_path / f"cloud-{len(list(tmp_path.glob('cloud-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def plan(chain=None, **options):  # type: ignore[no-untyped-def]
    """A plan of the compute-heavy wide MLP (its golden profile: its fastest plan replicates), or of `chain`."""
    if chain is None:
        chain = BlockChain.from_json(json.loads((GOLDEN / "wide_mlp_time" / "ir" / "blocks.json").read_text()))
        return plan_training(chain, load_model_file(MODELS / "wide_mlp.py"), PlanOptions(**options))
    return plan_training(chain, load_model_file(MODELS / "tricky.py"), PlanOptions(**options))


def workers(result) -> int:  # type: ignore[no-untyped-def]
    return sum(c.replicas for c in result.solution.plan.stages)


# --- the catalog ---------------------------------------------------------------------------------------


def test_the_catalog_carries_each_platforms_limits(tmp_path: Path) -> None:
    region = load_catalog().region("aws-us-east-1")
    assert (region.openfaas_edition, region.registry) == ("ce", None)  # the defaults
    both = platform_limits(region, BOTH)
    assert both.workers is not None and both.workers.value == DISTRIBUTED_MAP_MAX_CONCURRENCY == 10_000
    assert both.replicas is not None and both.replicas.value == OPENFAAS_CE_MAX_REPLICAS == 5
    assert both.stages is not None and both.stages.value == OPENFAAS_CE_MAX_FUNCTIONS == 15
    assert platform_limits(region, SAM).replicas is None and platform_limits(region, OPENFAAS).workers is None
    pro = load_catalog(catalog(tmp_path, openfaas_edition="pro", registry="ghcr.io/acme")).region("aws-us-east-1")
    assert (pro.openfaas_edition, pro.registry) == ("pro", "ghcr.io/acme")
    assert platform_limits(pro, OPENFAAS) == platform_limits(pro, frozenset())
    # an OpenFaaS region gets no Step Functions limit, whatever the targets: SAM deploys to AWS only
    other = load_catalog(catalog(tmp_path, name="of-local", provider="openfaas")).region("of-local")
    assert platform_limits(other, BOTH).workers is None and platform_limits(other, BOTH).replicas is not None


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("openfaas_edition", "enterprise", "key regions/0/openfaas_edition: 'enterprise' is not one of ['ce', 'pro']"),
        ("registry", "https://ghcr.io/acme", "key regions/0/registry: 'https://ghcr.io/acme': a registry host and"),
        ("registry", "ghcr.io/Acme", "key regions/0/registry: 'ghcr.io/Acme': 'Acme' is not a repository path"),
        ("registry", "", "key regions/0/registry: '' should be non-empty"),
    ],
)
def test_bad_platform_keys_name_the_key(tmp_path: Path, key: str, value: str, message: str) -> None:
    with pytest.raises(SchemaError, match="cloud-0.yaml: " + message.replace("[", r"\[").replace("]", r"\]")):
        load_catalog(catalog(tmp_path, **{key: value}))


# --- the planner -----------------------------------------------------------------------------------------


def test_openfaas_ce_bounds_replicas_and_stages_when_its_files_are_built(tmp_path: Path) -> None:
    """The fastest plan wants many replicas; with the OpenFaaS files built for a CE cluster it gets at most
    5 per stage and 15 stages, with SAM alone (or OpenFaaS Pro) as many as the time objective likes."""
    options = {"objective": "time", "replicas": (1, 2, 4, 8, 16, 32)}
    ce = plan(targets=BOTH, **options)
    assert max(c.replicas for c in ce.solution.plan.stages) <= 5
    assert len(ce.solution.plan.stages) <= 15 and ce.problem.max_stages <= 15
    assert ce.problem.replicas == (1, 2, 4)
    for baseline in ce.baselines:
        assert baseline.plan is None or max(c.replicas for c in baseline.plan.stages) <= 5
    for free in (
        plan(targets=SAM, **options),
        plan(targets=BOTH, catalog=catalog(tmp_path, openfaas_edition="pro"), **options),
    ):
        assert max(c.replicas for c in free.solution.plan.stages) > 5
        assert free.solution.evaluation.iteration_s < ce.solution.evaluation.iteration_s


def test_sam_plans_more_than_40_workers(tmp_path: Path) -> None:
    """The inline Map's 40 is no limit of the plan any more (a Distributed Map runs them); Lambda's concurrency
    (limits.max_functions) and the Distributed Map's 10,000 are."""
    result = plan(targets=SAM, objective="time", replicas=(48,))
    assert workers(result) >= 48
    assert result.problem.function_limit == 1000  # the default catalog's Lambda concurrency quota
    big = catalog(tmp_path, **{"limits.max_functions": 50_000})
    assert plan(targets=SAM, catalog=big, replicas=(1, 2)).problem.function_limit == DISTRIBUTED_MAP_MAX_CONCURRENCY


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"replicas": (8,)},
            r"every replica count of --replicas 8 exceeds OpenFaaS CE's 5 replicas per function "
            r"\(com.openfaas.scale.max\) in aws-us-east-1; use replica counts of at most 5, or set "
            r"openfaas_edition: pro for region aws-us-east-1 in the catalog if its cluster runs OpenFaaS Pro, or "
            r"build --target sam only$",
        ),
        (
            {"replicas": (4, 8), "max_functions": 2, "targets": SAM},
            r"every replica count of --replicas 4,8 exceeds --max-functions 2; use replica counts of at most 2$",
        ),
        (
            {"replicas": (2000,), "targets": SAM},
            r"exceeds the catalog's limits.max_functions 1000 of aws-us-east-1; use replica counts of at most 1000$",
        ),
        (
            {"replicas": (20_000,), "targets": SAM, "limits.max_functions": 50_000},
            r"exceeds the 10000 workers a Step Functions Distributed Map runs at once \(an iteration of "
            r"aws-us-east-1 runs all its workers together\) \(use fewer replicas or stages\); use replica counts",
        ),
    ],
    ids=["openfaas-ce-replicas", "max-functions", "lambda-concurrency", "distributed-map"],
)
def test_no_replica_count_fits_names_the_limit(tmp_path: Path, options: dict, message: str) -> None:  # type: ignore[type-arg]
    limits = {k: options.pop(k) for k in list(options) if k.startswith("limits.")}
    if limits:
        options["catalog"] = catalog(tmp_path, **limits)
    with pytest.raises(CompileError, match=message):
        plan(**options)


def test_a_model_too_big_for_the_stages_names_openfaas_ce_not_max_functions() -> None:
    """400 GB of state in at most 15 functions of 10 GB: the limit is OpenFaaS CE's function count, which
    --max-functions cannot lift; with SAM alone it is --max-stages."""
    chain = synthetic_chain(200, blocks=40)
    with pytest.raises(PlanInfeasible) as caught:
        plan(chain, targets=BOTH)
    message = str(caught.value)
    assert "but 15 functions of 10240 MB hold" in message, message
    assert (
        "allow more functions (now the catalog's limits.max_functions 1000 of aws-us-east-1) or stages (now "
        "OpenFaaS CE's 15 functions (one per stage) in aws-us-east-1 (set openfaas_edition: pro" in message
    ), message
    with pytest.raises(PlanInfeasible, match=r"but 16 functions .* or stages \(now --max-stages 16\)"):
        plan(chain, targets=SAM)


# --- every plan is emitted -------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_sam_build_of_more_than_40_workers_compiles_and_checks(compile_cli, tmp_path: Path) -> None:
    """The compile that used to die in codegen (an inline Map runs at most 40): the wide MLP's fastest plan
    with 48 replicas a stage, built for SAM only, runs its workers as a Distributed Map, and --check passes."""
    out = tmp_path / "b"
    code, stdout, stderr = compile_cli(
        str(MODELS / "wide_mlp.py"),
        "-o",
        str(out),
        "--objective",
        "time",
        "--blocks",
        "8",
        "--replicas",
        "48",
        "--target",
        "sam",
        "--profile",
        str(GOLDEN / "wide_mlp_time" / "ir" / "blocks.json"),
        "-q",
    )
    assert code == 0, stderr
    assert "Traceback" not in stderr
    workflow = yaml.safe_load((out / "workflow.yaml").read_text())
    total = sum(f["replicas"] for f in workflow["regions"][0]["functions"])
    assert total > 40
    definition = json.loads((out / "regions" / "aws-us-east-1" / "statemachine.asl.json").read_text())
    iteration = definition["States"]["Iteration"]
    assert iteration["ItemProcessor"]["ProcessorConfig"] == {"Mode": "DISTRIBUTED", "ExecutionType": "STANDARD"}
    assert iteration["MaxConcurrency"] == total
    assert not (out / "regions" / "aws-us-east-1" / "stack.yaml").exists()
    code, _, stderr = compile_cli("--check", str(out))
    assert code == 0, stderr


def test_the_registry_comes_from_the_catalog_unless_given(compile_cli, tmp_path: Path) -> None:
    """A region's catalog registry prefixes its images; --registry overrides it; both are checked before any
    work (a bad one is one line and exit status 2)."""
    blocks = str(GOLDEN / "mlp_digits" / "ir" / "blocks.json")
    model = str(Path(__file__).resolve().parents[1] / "samples" / "mlp_digits.py")
    cloud = catalog(tmp_path, registry="registry.example.com:5000/team")
    images = {}
    for name, flags in (("catalog", []), ("flag", ["--registry", "docker.io/someone"])):
        out = tmp_path / name
        code, _, stderr = compile_cli(model, "-o", str(out), "-c", str(cloud), "--profile", blocks, "-q", *flags)
        assert code == 0, stderr
        assert "no registry" not in stderr
        stack = yaml.safe_load((out / "regions" / "aws-us-east-1" / "stack.yaml").read_text())
        images[name] = stack["functions"]["mlp-digits-s0"]["image"]
    assert images["catalog"].startswith("registry.example.com:5000/team/mlp-digits-s0:sha-")
    assert images["flag"].startswith("docker.io/someone/mlp-digits-s0:sha-")
    assert images["catalog"].rsplit(":", 1)[1] == images["flag"].rsplit(":", 1)[1]  # same package, same tag
    code, stdout, stderr = compile_cli(model, "-o", str(tmp_path / "bad"), "--registry", "ghcr.io/acme/")
    assert code == 2 and stderr.count("\n") == 1 and "--registry 'ghcr.io/acme/': without a trailing '/'" in stderr
    assert not (tmp_path / "bad").exists()
