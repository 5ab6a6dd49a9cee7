"""Deployment files (OpenFaaS stack, SAM template, state machine, samconfig.toml) and their offline checks.

Real tools throughout: statelint, cfn-lint, and moto executing the state machine against fake Lambda
functions (moto's own faking: with use_docker False it answers invocations without running code).
"""

from __future__ import annotations

import io
import json
import re
import shutil
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from statelint.linter import Linter

from cloudless.codegen.images import LAMBDA_BASE_IMAGE, OPENFAAS_BUILD_ARGS, PYTHON_VERSION
from cloudless.codegen.package import (
    PYPI_INDEX,
    PYPI_PINS,
    REQUIREMENT_FILES,
    TORCH_INDEX,
    TORCH_PAGE,
    render_function_package,
)
from cloudless.codegen.platforms import (
    EVENTS_PER_DISTRIBUTED_MAP,
    EVENTS_PER_ROUND,
    EVENTS_PER_WORKER,
    LAMBDA_RETRY_ERRORS,
    S3_OBJECT_ACTIONS,
    aws_region,
    lambda_function_name,
    logical_id,
    render_region,
    render_samconfig,
    rounds_per_execution,
    state_machine_name,
    workers,
)
from cloudless.codegen.validate import BuildCheckError, check_deployment, deployment_warnings, substitute_arns
from cloudless.compiler.lower import region_steps
from cloudless.ir.deployment import peer_condition, peer_parameter
from cloudless.ir.files import check_workflow, dump_yaml, workflow_text
from cloudless.ir.schema import SchemaError
from cloudless.ir.workflow import (
    DataSpec,
    Function,
    OptimizerSpec,
    Region,
    RunSettings,
    StorageSpec,
    SyncSettings,
    Workflow,
)
from tests.iam import act_as_a_user_holding

EAST, WEST = "aws-us-east-1", "aws-eu-west-1"
RUN = "mlp-digits"


def _function(region: str, stage: int, replicas: int, memory_mb: int) -> Function:
    name = f"{RUN}-s{stage}"
    return Function(
        name=name,
        stage=stage,
        blocks=(2 * stage, 2 * stage + 2),
        memory_mb=memory_mb,
        cpu_millis=round(1000 * memory_mb / 1769),
        network_mb_per_s=50.0,
        replicas=replicas,
        timeout_s=900,
        package=f"regions/{region}/functions/{name}",
        inputs=("input_1",) if stage == 0 else (f"hidden_{stage}",),
        outputs=(f"hidden_{stage + 1}",),
        shared_parameters=(),
    )


def make_workflow(replicas: tuple[int, int, int] = (1, 2, 4)) -> Workflow:
    """Two regions: three stages with 1, 2 and 4 replicas in one, two stages in the other."""
    regions = {
        EAST: tuple(
            _function(EAST, s, r, m) for s, (r, m) in enumerate(zip(replicas, (1024, 1769, 3008), strict=True))
        ),
        WEST: (_function(WEST, 0, 1, 2048), _function(WEST, 1, 1, 2048)),
    }
    steps = [step for name, functions in regions.items() for step in region_steps(name, functions, {}, 50)]
    workflow = Workflow(
        model="mlp_digits.py",
        run=RunSettings(
            name=RUN,
            iterations=200,
            global_batch=64,
            micro_batch=16,
            micro_batches=4,
            schedule="gpipe",
            checkpoint_every=50,
            seed=0,
        ),
        optimizer=OptimizerSpec("SGD", {"lr": 0.1, "momentum": 0.9}),
        sync=SyncSettings("pipelined-scatter-reduce", 4194304, 16, "model-average", rounds=10),
        storage=StorageSpec("cloudless-mlp-digits", RUN),
        data=DataSpec("model.py", ("input_1",), 1, "loss"),
        regions=tuple(
            Region(name=name, provider="aws", samples=700, request_latency_s=0.02, functions=functions)
            for name, functions in regions.items()
        ),
        steps=tuple(steps),
    )
    check_workflow(workflow.to_json())
    return workflow


def render_all(workflow: Workflow, registry: str | None = "ghcr.io/acme") -> dict[str, str]:
    files = {"workflow.yaml": workflow_text(workflow), "samconfig.toml": render_samconfig(workflow)}
    for region in workflow.regions:
        files.update(render_region(workflow, region.name, {"openfaas", "sam"}, registry=registry))
    return files


def write_build(
    root: Path, workflow: Workflow, *, packages: bool = True, registry: str | None = "ghcr.io/acme"
) -> Path:
    for relative, text in render_all(workflow, registry).items():
        path = root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    if packages:
        # Minimal packages: the real ones are written by the package generator.
        for _, function in workflow.functions():
            package = root / function.package
            package.mkdir(parents=True, exist_ok=True)
            (package / "handler.py").write_text(
                "def handle(event, context):\n    return {'statusCode': 200, 'body': '{}'}\n\n\n"
                "def handler(event, context):\n    return {'status': 'done', **event}\n"
            )
            (package / "requirements.txt").write_text("")
            (package / "Dockerfile").write_text(
                'FROM public.ecr.aws/lambda/python:3.12\nCOPY . ${LAMBDA_TASK_ROOT}\nCMD ["handler.handler"]\n'
            )
    return root


@pytest.fixture(scope="module")
def good_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_build(tmp_path_factory.mktemp("good"), make_workflow())


@pytest.fixture
def build(good_build: Path, tmp_path: Path) -> Path:
    """A private copy of the good build, to break."""
    return Path(shutil.copytree(good_build, tmp_path / "build"))


def edit(path: Path, old: str, new: str, count: int = 1) -> None:
    text = path.read_text()
    assert old in text, f"{old!r} not in {path}"
    path.write_text(text.replace(old, new, count))


def failure(build: Path) -> str:
    with pytest.raises(BuildCheckError) as caught:
        check_deployment(build)
    return str(caught.value)


# --- the good build -------------------------------------------------------------------------------------


def test_rendered_build_passes_every_check(good_build: Path) -> None:
    check_deployment(good_build)


def test_statelint_and_cfn_lint_find_nothing(good_build: Path) -> None:
    import cfnlint.api

    for region, aws in ((EAST, "us-east-1"), (WEST, "eu-west-1")):
        definition = (good_build / "regions" / region / "statemachine.asl.json").read_text()
        assert Linter.validate(json.loads(substitute_arns(definition))) == []
        template = (good_build / "regions" / region / "template.yaml").read_text()
        errors = [m for m in cfnlint.api.lint(template, regions=[aws]) if m.rule.id.startswith("E")]
        assert errors == []


def test_stack_file_content(good_build: Path) -> None:
    stack = yaml.safe_load((good_build / "regions" / EAST / "stack.yaml").read_text())
    assert stack["version"] == 1.0
    assert stack["provider"] == {"name": "openfaas", "gateway": "http://127.0.0.1:8080"}
    assert stack["configuration"]["templates"] == [
        {"name": "python3-http-debian", "source": "https://github.com/openfaas/python-flask-template"}
    ]
    assert list(stack["functions"]) == [f"{RUN}-s0", f"{RUN}-s1", f"{RUN}-s2"]
    s2 = stack["functions"][f"{RUN}-s2"]
    assert s2["lang"] == "python3-http-debian"
    assert s2["handler"] == f"./functions/{RUN}-s2"
    assert (good_build / "regions" / EAST / s2["handler"] / "handler.py").is_file()
    # pushed to the registry, tagged by content: each function its own tag, a stable one
    assert re.fullmatch(rf"ghcr\.io/acme/{RUN}-s2:sha-[0-9a-f]{{12}}", s2["image"]), s2["image"]
    images = [f["image"] for f in stack["functions"].values()]
    assert len(set(images)) == 3
    assert images == [
        f["image"]
        for f in yaml.safe_load(render_all(make_workflow())[f"regions/{EAST}/stack.yaml"])["functions"].values()
    ]
    # several regions: one bucket per region, the other regions' storage in CLOUDLESS_PEERS
    assert s2["environment"]["CLOUDLESS_STORAGE"] == "s3://cloudless-mlp-digits-aws-us-east-1/mlp-digits"
    assert json.loads(s2["environment"]["CLOUDLESS_PEERS"]) == {
        WEST: "s3://cloudless-mlp-digits-aws-eu-west-1/mlp-digits"
    }
    assert s2["environment"]["exec_timeout"] == "900s"
    assert s2["environment"]["read_timeout"] == s2["environment"]["write_timeout"] == "910s"
    assert s2["secrets"] == ["cloudless-storage", "cloudless-token"]
    assert s2["limits"] == s2["requests"] == {"memory": "3008Mi", "cpu": "1700m"}
    assert s2["labels"] == {"com.openfaas.scale.min": "4", "com.openfaas.scale.max": "4"}
    # the template's base image runs the Python the pins are for, on Debian bookworm; no tox in the build
    assert (
        s2["build_args"]
        == OPENFAAS_BUILD_ARGS
        == {
            "PYTHON_VERSION": "3.12",
            "DEBIAN_OS": "slim-bookworm",
            "TEST_ENABLED": "false",
        }
    )
    assert deployment_warnings(good_build) == []


def test_a_stack_without_registry_builds_but_warns(tmp_path: Path) -> None:
    """No registry: the build is whole (faas-cli build works, SAM needs none), the images are `<fn>:<tag>`,
    and the stack file and --check say that faas-cli up cannot push them."""
    build = write_build(tmp_path, make_workflow(), registry=None)
    check_deployment(build)
    text = (build / "regions" / EAST / "stack.yaml").read_text()
    assert "The images have no registry prefix" in text
    images = [f["image"] for f in yaml.safe_load(text)["functions"].values()]
    assert all(re.fullmatch(rf"{RUN}-s\d:sha-[0-9a-f]{{12}}", image) for image in images), images
    warnings = deployment_warnings(build)
    assert [w.split(":")[0] for w in warnings] == [f"regions/{WEST}/stack.yaml", f"regions/{EAST}/stack.yaml"]
    assert "faas-cli up fails at the push; compile with --registry" in warnings[0]
    with pytest.raises(ValueError, match="registry 'https://ghcr.io/acme': a registry host and path, without"):
        render_region(make_workflow(), EAST, {"openfaas"}, registry="https://ghcr.io/acme")


def test_beyond_openfaas_ce_the_check_warns(build: Path) -> None:
    edit(build / "regions" / EAST / "stack.yaml", 'com.openfaas.scale.max: "4"', 'com.openfaas.scale.max: "6"')
    assert deployment_warnings(build) == [
        f"regions/{EAST}/stack.yaml: function {RUN}-s2 scales to 6 replicas; OpenFaaS CE allows at most 5 (this "
        "stack needs OpenFaaS Pro)"
    ]


def test_sam_template_content(good_build: Path) -> None:
    template = yaml.safe_load((good_build / "regions" / EAST / "template.yaml").read_text())
    assert template["Transform"] == "AWS::Serverless-2016-10-31"
    # nothing to fill in at deploy but, with several regions, the other regions' buckets (no name to guess)
    assert list(template.get("Parameters", {})) == ["PeerBucketAwsEuWest1"]
    resources = template["Resources"]
    # the run's bucket: a resource of the stack, named by CloudFormation, kept when the stack goes
    bucket = resources["RunBucket"]
    assert bucket["Type"] == "AWS::S3::Bucket" and "BucketName" not in bucket["Properties"]
    assert bucket["DeletionPolicy"] == bucket["UpdateReplacePolicy"] == "Retain"
    assert set(bucket["Properties"]["PublicAccessBlockConfiguration"].values()) == {True}
    function = resources["MlpDigitsS1Function"]
    assert function["Type"] == "AWS::Serverless::Function"
    properties = function["Properties"]
    assert properties["FunctionName"] == f"{RUN}-s1-{EAST}" == lambda_function_name(f"{RUN}-s1", EAST)
    assert (properties["PackageType"], properties["MemorySize"], properties["Timeout"]) == ("Image", 1769, 900)
    assert properties["ImageConfig"]["Command"] == ["handler.handler"]
    assert properties["Environment"]["Variables"]["CLOUDLESS_STORAGE"] == {"Fn::Sub": "s3://${RunBucket}/mlp-digits"}
    assert function["Metadata"]["Dockerfile"] == "Dockerfile"
    assert function["Metadata"]["DockerContext"] == f"functions/{RUN}-s1"
    assert re.fullmatch(r"sha-[0-9a-f]{12}", function["Metadata"]["DockerTag"])
    # the OpenFaaS image of the same package has the same tag
    stack = yaml.safe_load((good_build / "regions" / EAST / "stack.yaml").read_text())
    assert stack["functions"][f"{RUN}-s1"]["image"].endswith(":" + function["Metadata"]["DockerTag"])
    machine = resources["IterationStateMachine"]["Properties"]
    assert machine["Name"] == f"{RUN}-{EAST}" == state_machine_name(make_workflow(), EAST)
    assert machine["DefinitionUri"] == "statemachine.asl.json"
    assert machine["DefinitionSubstitutions"] == {
        f"MlpDigitsS{s}FunctionArn": {"Fn::GetAtt": [f"MlpDigitsS{s}Function", "Arn"]} for s in range(3)
    }
    assert machine["Policies"] == [
        {"LambdaInvokePolicy": {"FunctionName": {"Ref": f"MlpDigitsS{s}Function"}}} for s in range(3)
    ]
    # the outputs name the bucket, the state machine and every function, exported under the stack's name
    outputs = template["Outputs"]
    assert outputs["BucketName"]["Value"] == {"Ref": "RunBucket"}
    assert outputs["IterationStateMachineArn"]["Value"] == {"Ref": "IterationStateMachine"}
    for s in range(3):
        output = outputs[f"MlpDigitsS{s}FunctionName"]
        assert output["Value"] == {"Ref": f"MlpDigitsS{s}Function"}
        assert output["Export"] == {"Name": {"Fn::Sub": f"${{AWS::StackName}}-MlpDigitsS{s}FunctionName"}}


def test_state_machine_shape(good_build: Path) -> None:
    definition = json.loads((good_build / "regions" / EAST / "statemachine.asl.json").read_text())
    states = definition["States"]
    assert [w["replica"] for w in states["DefaultWorkers"]["Result"]] == [0, 0, 1, 0, 1, 2, 3]
    assert states["DefaultWorkers"]["Result"][0] == {"function": "${MlpDigitsS0FunctionArn}", "stage": 0, "replica": 0}
    iteration = states["Iteration"]
    assert iteration["Type"] == "Map" and iteration["MaxConcurrency"] == 7
    invoke = iteration["ItemProcessor"]["States"]["Invoke"]
    assert invoke["Resource"] == "arn:aws:states:::lambda:invoke"
    # Every invocation carries the run's name, attempt and time limit (a new run trains anew in the same
    # bucket) and the coordinator's plan of the region; several regions: also the region's iterations.
    assert invoke["Parameters"]["Payload"] == {
        "start.$": "$.start",
        "stop.$": "$.stop",
        "replica.$": "$.replica",
        "run.$": "$.run",
        "attempt.$": "$.attempt",
        "time_limit_s.$": "$.time_limit_s",
        "plan.$": "$.plan",
        "iterations.$": "$.iterations",
    }
    # the workers and the number of rounds an execution runs: the input's, else the deployed ones
    assert states["Continue"]["Choices"][0]["And"][1] == {"Variable": "$.round", "NumericLessThanPath": "$.max_rounds"}
    # a round's range: from the iteration to at most `span` more, clamped to the stop
    assert iteration["ItemSelector"]["start.$"] == "$.iteration" and iteration["ItemSelector"]["stop.$"] == "$.next"
    assert states["RangeEnd"]["Parameters"]["next.$"].startswith("States.MathAdd($.iteration, ")
    assert invoke["Retry"][0]["ErrorEquals"] == list(LAMBDA_RETRY_ERRORS)
    assert isinstance(invoke["Retry"][0]["BackoffRate"], float)
    assert invoke["Catch"][0]["ErrorEquals"] == ["States.ALL"]
    # the next round starts where the workers stopped (the range's end, or where the time limit cut it)
    assert states["Advance"]["Parameters"]["iteration.$"] == "States.ArrayGetItem($.reached, 0)"
    text = (good_build / "regions" / EAST / "statemachine.asl.json").read_text()
    assert text.endswith("}\n") and '\n  "States": {\n' in text


def test_samconfig_content(good_build: Path) -> None:
    import tomllib

    config = tomllib.loads((good_build / "samconfig.toml").read_text())
    assert config["version"] == 0.1
    assert sorted(k for k in config if k != "version") == sorted([EAST, WEST])
    deploy = config[WEST]["deploy"]["parameters"]
    assert deploy["region"] == "eu-west-1"
    assert deploy["stack_name"] == f"{RUN}-{WEST}"
    assert deploy["capabilities"] == "CAPABILITY_IAM"
    assert deploy["resolve_image_repos"] is True
    assert "parameter_overrides" not in deploy  # the bucket is the stack's own
    assert config[WEST]["build"]["parameters"]["template_file"] == f"regions/{WEST}/template.yaml"
    # deploy reads what sam build wrote for this region
    assert deploy["template_file"] == config[WEST]["build"]["parameters"]["build_dir"] + "/template.yaml"


def test_names() -> None:
    assert logical_id("mlp-digits-s0") == "MlpDigitsS0Function"
    assert aws_region("aws-us-east-1") == "us-east-1"
    assert aws_region("tencent-ap-guangzhou") == "tencent-ap-guangzhou"
    # a history of at most 25,000 events per execution; a Distributed Map's workers have histories of their own
    assert rounds_per_execution(40) * (EVENTS_PER_WORKER * 40 + EVENTS_PER_ROUND) <= 24_000
    assert rounds_per_execution(1) >= 700
    assert rounds_per_execution(41) == rounds_per_execution(10_000) == 24_000 // (10 + EVENTS_PER_ROUND)
    with pytest.raises(ValueError, match="a Step Functions Distributed Map runs at most 10000"):
        rounds_per_execution(10_001)
    # Lambda names: at most 64 characters; a longer one keeps its start and a digest, so it stays unique
    assert lambda_function_name("mlp-digits-s0", "aws-us-east-1") == "mlp-digits-s0-aws-us-east-1"
    long_names = {lambda_function_name(f"{'a' * 60}-s{s}", "aws-ap-southeast-1") for s in range(12)}
    assert len(long_names) == 12 and all(len(n) == 64 and re.fullmatch(r"[a-z0-9-]+", n) for n in long_names)


def test_rendering_is_deterministic() -> None:
    first, second = render_all(make_workflow()), render_all(Workflow.from_json(make_workflow().to_json()))
    assert first == second
    assert all(text.endswith("\n") for text in first.values())


def test_no_credentials_and_bucket_scoped_policies(good_build: Path) -> None:
    for path in sorted(good_build.rglob("*")):
        if path.suffix in {".yaml", ".json", ".toml"}:
            text = path.read_text()
            for pattern in (r"aws_secret_access_key", r"AKIA[0-9A-Z]{16}", r"(?i)password", r"(?i)secret_key"):
                assert not re.search(pattern, text), f"{pattern} in {path}"
    for region in (EAST, WEST):
        template = yaml.safe_load((good_build / "regions" / region / "template.yaml").read_text())
        for resource in template["Resources"].values():
            if resource["Type"] == "AWS::S3::Bucket":
                assert "BucketPolicy" not in resource["Properties"]
                continue
            policies = resource["Properties"].get("Policies", [])
            if resource["Type"] == "AWS::Serverless::StateMachine":
                assert all(list(policy) == ["LambdaInvokePolicy"] for policy in policies)
                continue
            # A function: one inline policy, no SAM policy template (S3CrudPolicy would allow deleting the
            # bucket's objects anywhere, its lifecycle rules and more).
            assert [list(policy) for policy in policies] == [["Statement"]], policies
            objects, listing, *conditional = policies[0]["Statement"]
            # several regions: read the peer's run prefix, and mark its missed meet there, only once the stack
            # is given the peer's bucket (an empty parameter grants nothing: no arn:aws:s3::: resource)
            peer = WEST if region == EAST else EAST
            assert all(
                list(st) == ["Fn::If"]
                and st["Fn::If"][0] == peer_condition(peer) == f"Has{peer_parameter(peer)}"
                and st["Fn::If"][2] == {"Ref": "AWS::NoValue"}
                for st in conditional
            ), conditional
            peers = [st["Fn::If"][1] for st in conditional]
            statements = [objects, listing, *peers]
            assert all(statement["Effect"] == "Allow" for statement in statements)
            suffix = peer_parameter(peer).removeprefix("PeerBucket")
            assert [p["Sid"] for p in peers] == [
                f"{sid}{suffix}" for sid in ("PeerObjects", "PeerBucketLookups", "DepartureMarks")
            ]
            marks = peers[2]["Resource"]
            assert all(m["Fn::Sub"].endswith(("/left", "/model-average/*/model")) for m in marks), marks
            assert objects["Action"] == list(S3_OBJECT_ACTIONS) == ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"]
            assert objects["Resource"] == {"Fn::Sub": "${RunBucket.Arn}/mlp-digits/*"}
            assert "Condition" not in objects
            assert listing["Action"] == "s3:ListBucket"
            assert listing["Resource"] == {"Fn::GetAtt": ["RunBucket", "Arn"]}
            # on the bucket, unconditioned: S3 answers a missing key 404 only to a holder of s3:ListBucket on it
            assert "Condition" not in listing and "Condition" not in peers[1]
            actions = [a for statement in statements for a in _as_list(statement["Action"])]
            assert all(re.fullmatch(r"s3:[A-Za-z]+", a) for a in actions), actions  # no wildcard: s3:*, s3:Get*
            for refused in (
                "DeleteBucket",
                "PutBucketAcl",
                "PutObjectAcl",
                "PutLifecycleConfiguration",
                "PutBucketPolicy",
            ):
                assert f"s3:{refused}" not in actions


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def test_the_policy_follows_the_storage_prefix() -> None:
    """The objects' ARN is the prefix S3Channel puts before every key."""
    workflow = make_workflow()
    for prefix, expected in (("runs/mlp", "runs/mlp/"), ("runs/mlp/", "runs/mlp/")):
        moved = Workflow.from_json({**workflow.to_json(), "storage": {"bucket": "b-1", "prefix": prefix}})
        template = yaml.safe_load(render_region(moved, EAST, {"sam"})[f"regions/{EAST}/template.yaml"])
        function = template["Resources"]["MlpDigitsS0Function"]["Properties"]
        objects, *_ = function["Policies"][0]["Statement"]
        assert objects["Resource"]["Fn::Sub"] == f"${{RunBucket.Arn}}/{expected}*"
        assert function["Environment"]["Variables"]["CLOUDLESS_STORAGE"] == {"Fn::Sub": f"s3://${{RunBucket}}/{prefix}"}


def _logical_lines(text: str) -> list[str]:
    """A requirements file's lines as pip reads them: continuations joined, comments and blanks dropped."""
    lines = re.sub(r"[ \t]*\\\n[ \t]*", " ", text).splitlines()
    return [line.split(" #")[0].strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_requirements_pin_every_package_to_one_index() -> None:
    """Every requirements file of a package has one index (no --extra-index-url, under which pip takes a
    name from whichever index offers the best version) and pins each requirement with ==; torch is the
    CPU build and comes from PyTorch's index only, everything else from PyPI, with hashes for Lambda."""
    from packaging.requirements import Requirement

    workflow = make_workflow()
    region = workflow.regions[0]
    function = region.functions[-1]
    files = render_function_package(
        workflow, region.name, function, stage_source="", weights={}, loss_source="", torch_version="2.13.0"
    )
    root = function.package
    requirement_files = {
        path.rsplit("/", 1)[1]: data.decode() for path, data in files.items() if "requirements" in path
    }
    assert sorted(requirement_files) == sorted(REQUIREMENT_FILES)
    pinned: dict[str, dict[str, str]] = {}
    for name, text in requirement_files.items():
        assert "--extra-index-url" not in text and "--trusted-host" not in text, name
        lines = _logical_lines(text)
        options = [line for line in lines if line.startswith("-")]
        indexes = [line for line in options if line.startswith(("--index-url", "-i ", "--no-index"))]
        assert len(indexes) == 1, (name, indexes)
        assert all(line.startswith(("--index-url ", "--find-links ")) for line in options), (name, options)
        requirements = {}
        for line in lines:
            if line.startswith("-"):
                continue
            spec, _, hashes = line.partition(" --hash=")
            requirement = Requirement(spec)
            (specifier,) = requirement.specifier  # exactly one: ==version, no wildcard
            assert specifier.operator == "==" and "*" not in specifier.version, line
            requirements[requirement.name] = specifier.version
            if name == "requirements-pypi.txt":  # hashes, so the Dockerfile may --require-hashes it
                assert re.fullmatch(r"sha256:[0-9a-f]{64}( --hash=sha256:[0-9a-f]{64})*", hashes), line
            else:
                assert not hashes
        pinned[name] = requirements
    # torch: the CPU build (+cpu: PyPI cannot have it), from PyTorch only
    assert pinned["requirements-torch.txt"] == {"torch": "2.13.0+cpu"}
    assert f"--index-url {TORCH_INDEX}" in _logical_lines(requirement_files["requirements-torch.txt"])
    others = {pin.name: pin.version for pin in PYPI_PINS}
    assert pinned["requirements-pypi.txt"] == others
    assert f"--index-url {PYPI_INDEX}" in _logical_lines(requirement_files["requirements-pypi.txt"])
    # OpenFaaS's single pip call: PyPI, and PyTorch's torch page for torch's +cpu build only
    assert pinned["requirements.txt"] == {"torch": "2.13.0+cpu", **others}
    options = [line for line in _logical_lines(requirement_files["requirements.txt"]) if line.startswith("-")]
    assert options == [f"--index-url {PYPI_INDEX}", f"--find-links {TORCH_PAGE}"]
    assert TORCH_PAGE.startswith(TORCH_INDEX) and TORCH_PAGE.endswith("/torch/")

    # The Dockerfile installs torch, then the rest with their hashes, then copies the code and weights.
    dockerfile = files[f"{root}/Dockerfile"].decode().splitlines()
    assert [line for line in dockerfile if line.startswith("FROM")] == ["FROM public.ecr.aws/lambda/python:3.12"]
    assert LAMBDA_BASE_IMAGE == f"public.ecr.aws/lambda/python:{PYTHON_VERSION}"
    assert dockerfile[-1] == 'CMD ["handler.handler"]'
    steps = [line for line in dockerfile if line.startswith(("COPY", "RUN"))]
    assert steps == [
        "COPY requirements-torch.txt ${LAMBDA_TASK_ROOT}/",
        "RUN pip install --no-cache-dir -r ${LAMBDA_TASK_ROOT}/requirements-torch.txt",
        "COPY requirements-pypi.txt ${LAMBDA_TASK_ROOT}/",
        "RUN pip install --no-cache-dir --require-hashes -r ${LAMBDA_TASK_ROOT}/requirements-pypi.txt",
        "COPY . ${LAMBDA_TASK_ROOT}/",
    ]


def test_the_pins_cover_every_dependency() -> None:
    """What the pinned packages require (their metadata here) on the images' Python is pinned too, so an
    image installs no version nobody chose (tests/test_images.py resolves the files with pip itself)."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement

    names = {pin.name for pin in PYPI_PINS}
    for pin in PYPI_PINS:
        try:
            declared = requires(pin.name) or []
        except PackageNotFoundError:
            continue  # async-timeout: not installed on this Python (3.11.3 or later)
        for line in declared:
            requirement = Requirement(line)
            for version in (f"{PYTHON_VERSION}.0", f"{PYTHON_VERSION}.99"):
                environment = {"python_version": PYTHON_VERSION, "python_full_version": version, "extra": ""}
                if requirement.marker is None or requirement.marker.evaluate(environment):
                    assert requirement.name in names, f"{pin.name} needs {requirement.name}, which is not pinned"


def test_unknown_target_and_region_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown targets"):
        render_region(make_workflow(), EAST, {"knative"})
    with pytest.raises(ValueError, match="no region"):
        render_region(make_workflow(), "aws-ap-south-1", {"sam"})


@pytest.mark.slow
def test_more_than_40_workers_run_as_a_distributed_map(tmp_path: Path) -> None:
    """Up to 40 workers an inline Map runs them at once; above, a Distributed Map (each worker a Standard child
    execution, the state machine allowed to start and follow them); above 10,000 nothing can."""
    for replicas, mode in (((1, 2, 37), "INLINE"), ((1, 2, 38), "DISTRIBUTED"), ((1, 2, 9997), "DISTRIBUTED")):
        workflow = make_workflow(replicas=replicas)
        files = render_region(workflow, EAST, {"sam"})
        definition = json.loads(files[f"regions/{EAST}/statemachine.asl.json"])
        iteration = definition["States"]["Iteration"]
        assert iteration["ItemProcessor"]["ProcessorConfig"]["Mode"] == mode
        assert iteration["MaxConcurrency"] == len(workers(workflow, EAST)) == sum(replicas)
        assert Linter.validate(json.loads(substitute_arns(files[f"regions/{EAST}/statemachine.asl.json"]))) == []
        machine = yaml.safe_load(files[f"regions/{EAST}/template.yaml"])["Resources"]["IterationStateMachine"]
        statements = [p["Statement"] for p in machine["Properties"]["Policies"] if "Statement" in p]
        if mode == "INLINE":
            assert statements == []
            continue
        assert iteration["ItemProcessor"]["ProcessorConfig"]["ExecutionType"] == "STANDARD"
        assert "ToleratedFailurePercentage" not in iteration  # its default, 0: a failed worker fails the Map
        (policy,) = statements
        name = machine["Properties"]["Name"]
        assert [(s["Action"], s["Resource"]["Fn::Sub"].rsplit(":", 2)[1:]) for s in policy] == [
            ("states:StartExecution", ["stateMachine", name]),
            (["states:DescribeExecution", "states:StopExecution"], ["execution", f"{name}/*"]),
        ]
    build = write_build(tmp_path, make_workflow(replicas=(1, 2, 38)))
    check_deployment(build)
    with pytest.raises(ValueError, match="10001 .* workers; a Step Functions Distributed Map runs at most 10000"):
        render_region(make_workflow(replicas=(1, 2, 9998)), EAST, {"sam"})
    render_region(make_workflow(replicas=(1, 2, 9998)), EAST, {"openfaas"})  # OpenFaaS runs no Map


# --- broken builds: the first problem, with its file and key --------------------------------------------


@pytest.mark.parametrize(
    ("old", "new", "key"),
    [
        (
            "    lang: python3-http-debian\n",
            "    lang: python3-http-debian\n    memory_limit: 1G\n",
            f"key functions/{RUN}-s0/memory_limit",
        ),
        ('memory: "1024Mi"', 'memory: "1G"', f"key functions/{RUN}-s0/limits/memory"),
        ('read_timeout: "910s"', 'read_timeout: "60s"', f"key functions/{RUN}-s0/environment/read_timeout"),
        (
            'com.openfaas.scale.min: "1"',
            "com.openfaas.scale.min: 1",
            f"key functions/{RUN}-s0/labels/com.openfaas.scale.min",
        ),
        (f"  {RUN}-s0:\n", "  MLP_s0:\n", "key functions/MLP_s0"),
        (f'image: "ghcr.io/acme/{RUN}-s0:sha-', f'image: "ghcr.io/acme/{RUN}-s1:sha-', f"key functions/{RUN}-s0/image"),
        ('image: "ghcr.io/acme/', 'image: "GHCR.io/Acme/', f"key functions/{RUN}-s0/image"),
    ],
    ids=["unknown-key", "bad-memory", "read-before-exec", "unquoted-scale", "bad-name", "image-name", "registry"],
)
def test_broken_stack_file(build: Path, old: str, new: str, key: str) -> None:
    edit(build / "regions" / EAST / "stack.yaml", old, new)
    message = failure(build)
    assert message.startswith(f"regions/{EAST}/stack.yaml: {key}"), message


@pytest.mark.parametrize("image", [f"ghcr.io/acme/{RUN}-s0:latest", f"ghcr.io/acme/{RUN}-s0", f"{RUN}-s0"])
def test_an_image_without_a_tag_of_its_own(build: Path, image: str) -> None:
    """faas-cli adds `:latest` to an untagged image: a tag that names different images over time."""
    path = build / "regions" / EAST / "stack.yaml"
    stack = yaml.safe_load(path.read_text())
    stack["functions"][f"{RUN}-s0"]["image"] = image
    path.write_text(yaml.safe_dump(stack))
    message = failure(build)
    assert message.startswith(f"regions/{EAST}/stack.yaml: key functions/{RUN}-s0/image: {image!r}: expected a tag")


def test_missing_handler_folder(build: Path) -> None:
    shutil.rmtree(build / "regions" / EAST / "functions" / f"{RUN}-s1")
    message = failure(build)
    assert message.startswith(f"regions/{EAST}/stack.yaml: key functions/{RUN}-s1/handler"), message
    check_deployment(build, packages=False)


def test_dangling_next_in_state_machine(build: Path) -> None:
    edit(
        build / "regions" / EAST / "statemachine.asl.json",
        '"Next": "Continue"\n    },\n    "Done"',
        '"Next": "Nowhere"\n    },\n    "Done"',
    )
    message = failure(build)
    assert message.startswith(f"regions/{EAST}/statemachine.asl.json: key States/Advance/Next: statelint:"), message
    assert "Nowhere" in message


def test_distributed_map_of_express_children(tmp_path: Path) -> None:
    build = write_build(tmp_path, make_workflow(replicas=(1, 2, 38)))
    path = build / "regions" / EAST / "statemachine.asl.json"
    edit(path, '"ExecutionType": "STANDARD"', '"ExecutionType": "EXPRESS"')
    message = failure(build)
    assert message.startswith(
        f"regions/{EAST}/statemachine.asl.json: key States/Iteration/ItemProcessor/ProcessorConfig/ExecutionType"
    ), message
    edit(path, '"ExecutionType": "EXPRESS"', '"ExecutionType": "STANDARD"')
    edit(path, '"MaxConcurrency": 41', '"MaxConcurrency": 40')
    message = failure(build)
    assert "MaxConcurrency: 40 < the region's 41 workers" in message, message
    edit(path, '"MaxConcurrency": 40', '"MaxConcurrency": 41')
    edit(
        build / "regions" / EAST / "template.yaml", "Action: states:StartExecution", "Action: states:DescribeExecution"
    )
    message = failure(build)
    assert message.startswith(
        f"regions/{EAST}/template.yaml: key Resources/IterationStateMachine/Properties/Policies: "
        "statemachine.asl.json runs a Distributed Map, but no statement allows states:StartExecution"
    ), message


def test_map_concurrency_over_40(build: Path) -> None:
    edit(build / "regions" / EAST / "statemachine.asl.json", '"MaxConcurrency": 7', '"MaxConcurrency": 41')
    message = failure(build)
    assert message.startswith(f"regions/{EAST}/statemachine.asl.json: key States/Iteration/MaxConcurrency"), message


def test_task_without_retry(build: Path) -> None:
    path = build / "regions" / EAST / "statemachine.asl.json"
    definition = json.loads(path.read_text())
    del definition["States"]["Iteration"]["ItemProcessor"]["States"]["Invoke"]["Retry"]
    path.write_text(json.dumps(definition, indent=2))
    message = failure(build)
    assert message.startswith(
        f"regions/{EAST}/statemachine.asl.json: key States/Iteration/ItemProcessor/States/Invoke/Retry"
    ), message


@pytest.mark.parametrize(
    ("old", "new", "key"),
    [
        ("      Timeout: 900\n", "      Timeout: 2000\n", "key Resources/MlpDigitsS0Function/Properties/Timeout"),
        (
            "      MemorySize: 1024\n",
            "      MemorySize: 20480\n",
            "key Resources/MlpDigitsS0Function/Properties/MemorySize",
        ),
        (
            "      PackageType: Image\n",
            "      PackageType: Image\n      Colour: blue\n",
            "key Resources/MlpDigitsS0Function/Properties/Colour: cfn-lint E3002",
        ),
        (
            "            Ref: MlpDigitsS1Function\n",
            "            Ref: MlpDigitsS9Function\n",
            "key Resources/IterationStateMachine/Properties/Policies/1/LambdaInvokePolicy/FunctionName/Ref",
        ),
        (
            "      PublicAccessBlockConfiguration:\n",
            "      BucketName: cloudless-mlp-digits\n      PublicAccessBlockConfiguration:\n",
            "key Resources/RunBucket/Properties/BucketName: the run's bucket is named by CloudFormation",
        ),
        (
            '            Fn::Sub: "s3://${RunBucket}/mlp-digits"\n',
            '            Fn::Sub: "s3://${Bucket}/mlp-digits"\n',
            "key Resources/MlpDigitsS0Function/Properties/Environment/Variables/CLOUDLESS_STORAGE/Fn::Sub: 'Bucket'",
        ),
        (
            f'      FunctionName: "{RUN}-s1-{EAST}"\n',
            f'      FunctionName: "{RUN}-s0-{EAST}"\n',
            "key Resources/MlpDigitsS1Function/Properties/FunctionName: 'mlp-digits-s0-aws-us-east-1' is also",
        ),
        (
            f'      FunctionName: "{RUN}-s1-{EAST}"\n',
            f'      FunctionName: "{RUN}-s1-{EAST}-{"x" * 40}"\n',
            "key Resources/MlpDigitsS1Function/Properties/FunctionName",
        ),
        (
            "  MlpDigitsS2FunctionName:\n",
            "  MlpDigitsS2FunctionLabel:\n",
            "key Outputs/MlpDigitsS2FunctionName: missing",
        ),
        (f'      Name: "{RUN}-{EAST}"\n', "", "key Resources/IterationStateMachine/Properties/Name: None"),
    ],
    ids=[
        "timeout",
        "memory",
        "unknown-property",
        "dangling-ref",
        "fixed-bucket-name",
        "dangling-sub",
        "same-function-name",
        "long-function-name",
        "unexported-name",
        "unnamed-state-machine",
    ],
)
def test_broken_template(build: Path, old: str, new: str, key: str) -> None:
    edit(build / "regions" / EAST / "template.yaml", old, new)
    message = failure(build)
    assert message.startswith(f"regions/{EAST}/template.yaml: {key}"), message


def test_missing_dockerfile(build: Path) -> None:
    (build / "regions" / WEST / "functions" / f"{RUN}-s1" / "Dockerfile").unlink()
    message = failure(build)
    assert message.startswith(f"regions/{WEST}/template.yaml: key Resources/MlpDigitsS1Function/Metadata/Dockerfile")


def test_broken_manifest(build: Path) -> None:
    workflow = make_workflow().to_json()
    workflow["steps"][1]["depends_on"] = [f"{EAST}/s7/compute"]
    (build / "workflow.yaml").write_text(dump_yaml(workflow))
    message = failure(build)
    assert message.startswith("workflow.yaml: key steps/1/depends_on/0: no step"), message
    with pytest.raises(SchemaError):  # BuildCheckError is a SchemaError
        check_deployment(build)


@pytest.mark.parametrize(
    ("old", "new", "key"),
    [
        ('region = "eu-west-1"', 'region = "eu-west-9"', f"key {WEST}.deploy.parameters.region"),
        (f"[{WEST}.deploy.parameters]", "[other.deploy.parameters]", "key other"),
        ("version = 0.1", "version = 1", "key version"),
    ],
    ids=["region", "env", "version"],
)
def test_broken_samconfig(build: Path, old: str, new: str, key: str) -> None:
    edit(build / "samconfig.toml", old, new)
    message = failure(build)
    assert message.startswith(f"samconfig.toml: {key}"), message


def test_credentials_are_refused(build: Path) -> None:
    edit(
        build / "regions" / WEST / "stack.yaml",
        "      max_inflight:",
        "      AWS_ACCESS_KEY_ID: " + "AKIA" + "Q" * 16 + "\n      max_inflight:",  # made up, not a literal
    )
    message = failure(build)
    assert message.startswith(f"regions/{WEST}/stack.yaml: key line"), message


# --- the state machine runs -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "replicas", [(1, 2, 4), pytest.param((1, 2, 38), marks=pytest.mark.slow)], ids=["inline-map", "distributed-map"]
)
def test_state_machine_runs_in_moto(replicas: tuple[int, int, int], monkeypatch: pytest.MonkeyPatch) -> None:
    import boto3
    from moto import mock_aws

    for variable, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(variable, value)
    workflow = make_workflow(replicas)
    region_workers = workers(workflow, EAST)
    definition = render_region(workflow, EAST, {"sam"})[f"regions/{EAST}/statemachine.asl.json"]
    config = {"stepfunctions": {"execute_state_machine": True}, "lambda": {"use_docker": False}}
    from moto.awslambda_simple.models import LambdaSimpleBackend

    def ran_its_range(self: Any, function_name: str, qualifier: Any, body: Any, *rest: Any) -> bytes:
        """Without Docker moto runs no function code: answer as a worker that ran its range does."""
        return json.dumps({"status": "done", "stop": json.loads(body)["stop"], "reason": ""}).encode()

    monkeypatch.setattr(LambdaSimpleBackend, "invoke", ran_its_range)
    with mock_aws(config=config):
        role_arn = lambda_role()
        code = io.BytesIO()
        with zipfile.ZipFile(code, "w") as archive:
            archive.writestr("handler.py", "def handler(event, context):\n    return event\n")
        lambdas = boto3.client("lambda")
        arns = {}
        for worker in region_workers:
            if f"{worker.logical_id}Arn" not in arns:
                arns[f"{worker.logical_id}Arn"] = lambdas.create_function(
                    FunctionName=worker.function,
                    Runtime="python3.12",
                    Role=role_arn,
                    Handler="handler.handler",
                    Code={"ZipFile": code.getvalue()},
                )["FunctionArn"]
        substituted = re.sub(r"\$\{(\w+)\}", lambda m: arns[m.group(1)], definition)
        sfn = boto3.client("stepfunctions")
        machine = sfn.create_state_machine(name="iterations", definition=substituted, roleArn=role_arn)

        execution_arns: list[str] = []

        def run(document: dict[str, int]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
            execution = sfn.start_execution(
                stateMachineArn=machine["stateMachineArn"],
                name=f"run-{len(document)}-{document.get('start')}",
                input=json.dumps(document),
            )
            execution_arns.append(execution["executionArn"])
            deadline = time.monotonic() + 30
            while (described := sfn.describe_execution(executionArn=execution["executionArn"]))["status"] == "RUNNING":
                assert time.monotonic() < deadline, "execution did not finish"
                time.sleep(0.05)
            assert described["status"] == "SUCCEEDED", described
            history = sfn.get_execution_history(executionArn=execution["executionArn"], maxResults=1000)["events"]
            return json.loads(described["output"]), history

        output, history = run({"start": 0, "stop": 2})
        assert output == {
            "iteration": 2,
            "stop": 2,
            "run": output["run"],
            "attempt": 0,
            "time_limit_s": 870.0,
            "plan": {},
        }
        if len(region_workers) <= 40:  # an inline Map: the invocations are the execution's own events
            invoked = [
                json.loads(e["taskScheduledEventDetails"]["parameters"])
                for e in history
                if e["type"] == "TaskScheduled"
            ]
            assert sorted(
                (p["FunctionName"], p["Payload"]["start"], p["Payload"]["stop"], p["Payload"]["replica"])
                for p in invoked
            ) == sorted((arns[f"{w.logical_id}Arn"], i, i + 1, w.replica) for w in region_workers for i in range(2))
            # the history budget behind rounds_per_execution holds
            assert len(history) <= 2 * (EVENTS_PER_WORKER * len(region_workers) + EVENTS_PER_ROUND)
        else:  # a Distributed Map: one map run per iteration, every worker a child execution, all at once
            runs = [
                sfn.describe_map_run(mapRunArn=r["mapRunArn"])
                for r in sfn.list_map_runs(executionArn=execution_arns[-1])["mapRuns"]
            ]
            assert len(runs) == 2
            for described in runs:
                assert described["maxConcurrency"] == len(region_workers)
                assert (
                    described["executionCounts"]["succeeded"]
                    == described["executionCounts"]["total"]
                    == len(region_workers)
                )
            # the parent's history does not grow with the workers
            assert not any(e["type"] == "TaskScheduled" for e in history)
            # + the input's defaults and Init (at most 15 states, 2 events each), within HISTORY_EVENTS_RESERVED
            assert len(history) <= 2 * (EVENTS_PER_DISTRIBUTED_MAP + EVENTS_PER_ROUND) + 2 * 15

        output, _ = run({"stop": 1})  # start defaults to 0
        # run defaults to the execution's name, attempt to 0, the time limit to the shortest timeout - 30 s
        assert output == {
            "iteration": 1,
            "stop": 1,
            "run": "run-1-None",
            "attempt": 0,
            "time_limit_s": 870.0,
            "plan": {},
        }
        output, history = run({"start": 3, "stop": 3})  # nothing to do
        assert output == {"iteration": 3, "stop": 3, "run": "run-2-3", "attempt": 0, "time_limit_s": 870.0, "plan": {}}
        assert not any(e["type"] == "TaskScheduled" for e in history)


def test_the_function_policy_allows_what_the_runtime_does_in_moto(monkeypatch: pytest.MonkeyPatch) -> None:
    """The functions' S3 channel does all its work (put, get, a missing key, claim, delete) under the
    generated policy, in moto with IAM enforced; other prefixes and bucket-level actions are refused.
    The role holds s3:ListBucket on its bucket and the peers' whatever the request (no s3:prefix condition,
    which the missing-key check of a GetObject does not document): the permission under which S3 answers
    a key not written yet 404, not 403. (moto answers a missing key 404 either way, and passes a condition on
    a key its requests do not carry, s3:prefix included: test_no_credentials_and_bucket_scoped_policies pins
    that the grant has none.) A read the role may not make is one line (StorageRefused), not a poll."""
    import boto3
    from botocore.exceptions import ClientError
    from moto import mock_aws
    from moto.core import set_initial_no_auth_action_count

    from cloudless.runtimes.storage.channels import S3Channel, StorageRefused

    template = yaml.safe_load(render_region(make_workflow(), EAST, {"sam"})[f"regions/{EAST}/template.yaml"])
    statements = template["Resources"]["MlpDigitsS0Function"]["Properties"]["Policies"][0]["Statement"]

    def substituted(value: Any) -> Any:
        if isinstance(value, dict) and list(value) == ["Fn::Sub"]:
            text = value["Fn::Sub"].replace("${RunBucket.Arn}", "arn:aws:s3:::run-bucket")
            return text.replace("${AWS::Partition}", "aws").replace("${PeerBucketAwsEuWest1}", "peer-bucket")
        if value == {"Fn::GetAtt": ["RunBucket", "Arn"]}:
            return "arn:aws:s3:::run-bucket"
        if isinstance(value, dict) and list(value) == ["Fn::If"]:  # the peer's bucket is given: its rights hold
            assert value["Fn::If"][0] == "HasPeerBucketAwsEuWest1"
            return substituted(value["Fn::If"][1])
        if isinstance(value, dict):
            return {k: substituted(v) for k, v in value.items()}
        return [substituted(v) for v in value] if isinstance(value, list) else value

    policy = {"Version": "2012-10-17", "Statement": substituted(statements)}
    for variable, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(variable, value)
    monkeypatch.delenv("CLOUDLESS_S3_ENDPOINT", raising=False)

    @mock_aws
    @set_initial_no_auth_action_count(5)  # the set-up's five requests; every later one is authorized
    def run() -> None:
        boto3.client("s3").create_bucket(Bucket="run-bucket")
        boto3.client("s3").create_bucket(Bucket="peer-bucket")
        act_as_a_user_holding(policy, monkeypatch)  # the function's credentials from now on
        channel = S3Channel("run-bucket", RUN)
        channel.put("run/aws-us-east-1/it0/act/s0/mb0", b"activations")
        assert channel.try_get("run/aws-us-east-1/it0/act/s0/mb0") == b"activations"
        assert channel.try_get("run/aws-us-east-1/it0/act/s0/mb1") is None
        assert channel.claim("run/aws-us-east-1/claim/a0", b"me") is True  # conditional PutObject
        assert channel.claim("run/aws-us-east-1/claim/a0", b"another") is False
        channel.delete("run/aws-us-east-1/it0/act/s0/mb0")
        assert channel.try_get("run/aws-us-east-1/it0/act/s0/mb0") is None
        for bucket, keys in (("run-bucket", 1), ("peer-bucket", 0)):  # the lookups S3's 404 for a missing key needs
            assert channel.client.list_objects_v2(Bucket=bucket)["KeyCount"] == keys
        outside = S3Channel("run-bucket", "another-run")
        with pytest.raises(StorageRefused, match=r"^s3://run-bucket/another-run/key: access denied \(403\)"):
            outside.try_get("key")
        refused: list[Callable[[], object]] = [
            lambda: outside.put("key", b"x"),
            lambda: outside.delete("key"),
            lambda: channel.client.delete_bucket(Bucket="run-bucket"),
            lambda: channel.client.put_bucket_acl(Bucket="run-bucket", ACL="public-read"),
            lambda: channel.client.put_object_acl(Bucket="run-bucket", Key=f"{RUN}/k", ACL="public-read"),
        ]
        for call in refused:
            with pytest.raises(ClientError, match="AccessDenied"):
                call()

    try:
        run()
    finally:
        boto3.DEFAULT_SESSION = None  # later tests make their own


def test_definition_over_1_mb(build: Path) -> None:
    path = build / "regions" / EAST / "statemachine.asl.json"
    definition = json.loads(path.read_text())
    definition["Comment"] = "x" * (1024 * 1024)
    path.write_text(json.dumps(definition))
    message = failure(build)
    assert message.startswith(f"regions/{EAST}/statemachine.asl.json: key (top level): about"), message


def lambda_role() -> str:
    """A role Lambda and Step Functions may assume (moto checks that a function's role exists)."""
    import boto3

    iam = boto3.client("iam")
    trust = {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Principal": {"Service": ["lambda.amazonaws.com", "states.amazonaws.com"]},
                "Action": "sts:AssumeRole",
            }
        ],
    }
    try:
        return iam.get_role(RoleName="cloudless")["Role"]["Arn"]
    except iam.exceptions.NoSuchEntityException:
        return iam.create_role(RoleName="cloudless", AssumeRolePolicyDocument=json.dumps(trust))["Role"]["Arn"]


def test_cloudless_run_invokes_the_lambda_functions_by_the_names_sam_deploys() -> None:
    """`cloudless-run --invoker lambda` without --stack: the names the template gives the functions."""
    from cloudless.runtimes.control.run import deployed_lambda_names

    workflow = make_workflow()
    template = yaml.safe_load(render_region(workflow, EAST, {"sam"})[f"regions/{EAST}/template.yaml"])
    deployed = {
        resource["Properties"]["FunctionName"]
        for resource in template["Resources"].values()
        if resource["Type"] == "AWS::Serverless::Function"
    }
    assert set(deployed_lambda_names(workflow, EAST).values()) == deployed and len(deployed) == 3
