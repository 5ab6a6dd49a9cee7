"""Offline checks of a build folder: what a run relies on (workflow.yaml, plan.json, every function
package, cloudless-build.json's digests) and what a deployment does (the OpenFaaS stack files, the SAM
templates and their state machines, samconfig.toml).

Neither faas-cli nor the clouds are reachable here, and faas-cli and sam ignore keys they do not know, so
mistakes would surface only at deploy time, or as a run that trains on the wrong thing. `check_build`
raises `BuildCheckError` at the first problem, naming the file (relative to the build folder) and the
key, for example `regions/aws-us-east-1/stack.yaml: key functions/mlp-digits-s0/limits/memory: ...`.

In order: the manifest exists; workflow.yaml passes its schema and agrees with itself (batch sizes,
stages tiling the block chain, each stage's inputs sent by the one before, the inter-region settings, the
optimizer); plan.json agrees with it; every package holds what its worker loads, and agrees with
workflow.yaml (function.json's copy, stage.py's INPUTS/OUTPUTS/TENSORS read with `ast`, the safetensors
header of the weights, the loss module); the deployment files pass their schemas, the platform limits
the linters do not know (Lambda memory and timeout, Step Functions Map concurrency and definition size),
statelint and cfn-lint (errors only); last, every file has the digest cloudless-build.json recorded and
no package holds a file it does not list. The semantic checks come first because they say what is wrong;
the digests catch every other edit. When two files disagree, the message names the one whose digest no
longer matches (the one edited after the compile).
"""

from __future__ import annotations

import ast
import json
import math
import re
import sys
from pathlib import Path, PurePosixPath
from typing import Any, NoReturn

import jsonschema
import yaml

from cloudless.codegen.package import VENDORED_MODULES
from cloudless.codegen.platforms import (
    LAMBDA_INVOKE,
    LAMBDA_NAME_LIMIT,
    LAMBDA_RETRY_ERRORS,
    STATE_MACHINE_NAME_LIMIT,
    aws_region,
    logical_id,
    peer_parameter,
)
from cloudless.ir.catalog import (
    AWS_REGIONS,
    DISTRIBUTED_MAP_MAX_CONCURRENCY,
    INLINE_MAP_MAX_CONCURRENCY,
    OPENFAAS_CE_MAX_FUNCTIONS,
    OPENFAAS_CE_MAX_REPLICAS,
    registry_problem,
)
from cloudless.ir.files import BUILD_MARKER, check_workflow, file_digest, read_manifest
from cloudless.ir.plan import PlannedStage, TrainingPlan
from cloudless.ir.protocol import PEERS_ENV, STORAGE_ENV
from cloudless.ir.schema import SchemaError, load_schema
from cloudless.ir.workflow import Function, Region, Workflow

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

#: Lambda's limits (https://docs.aws.amazon.com/lambda/latest/dg/gettingstarted-limits.html).
LAMBDA_MEMORY_MB = (128, 10240)
LAMBDA_MAX_TIMEOUT_S = 900
#: Step Functions' limit on a state machine definition.
MAX_DEFINITION_BYTES = 1024 * 1024
#: Stands in for the function ARNs that DefinitionSubstitutions fill in at deploy time.
DUMMY_ARN = "arn:aws:lambda:us-east-1:123456789012:function:{name}"
#: The longest ARN a substitution can bring (64-character function name, longest region name), so that the
#: size check is not optimistic.
LONGEST_ARN = len("arn:aws-us-gov:lambda:ap-southeast-5:123456789012:function:") + 64
_PLACEHOLDER = re.compile(r"\$\{([A-Za-z0-9_]+)\}")
#: a name Fn::Sub substitutes: ${Resource}, ${Resource.Attribute} or ${AWS::Pseudo} (not ${!Literal})
_SUB_NAME = re.compile(r"\$\{([A-Za-z0-9_:]+)(?:\.[A-Za-z0-9_.]+)?\}")
#: Lambda function and state machine names (letters, digits, '-' and '_')
_AWS_NAME = re.compile(r"[A-Za-z0-9_-]+")
#: an image reference's tag
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ns|us|µs|ms|s|m|h)")
_DURATION_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
#: Things that look like credentials; none may appear in a generated file.
_SECRET_PATTERNS = (
    re.compile(r"AKIA[0-9A-Z]{16}"),
    re.compile(r"ASIA[0-9A-Z]{16}"),
    re.compile(r"aws_secret_access_key", re.IGNORECASE),
    re.compile(r"aws_session_token", re.IGNORECASE),
    re.compile(r"password\s*[:=]", re.IGNORECASE),
)


class BuildCheckError(SchemaError):
    """A generated file is malformed or breaks a platform limit; the message names the file and the key."""


def _fail(file: str, key: str, message: str) -> NoReturn:
    """Raise the one-line message `file: key K: message` (a parser's multi-line message is joined)."""
    raise BuildCheckError(" ".join(f"{file}: key {key}: {message}".split()))


def check_build(build: Path, *, packages: bool = True) -> None:
    """Raise BuildCheckError at the first problem in the build folder `build`: what passes must run.

    With `packages=False` the function packages (handler folders, Dockerfiles) are not looked for, so the
    deployment files can be checked before the packages are written."""
    build = Path(build)
    if not build.is_dir():
        raise BuildCheckError(f"{build}: no such folder; expected a build folder written by cloudless-compile")
    context = _Build.open(build)
    document, workflow = _check_manifest(build, context)
    _check_run(context, document, workflow)
    _check_plan(context, document, workflow)
    if packages:
        _check_packages(context, document, workflow)
    _check_digests(context, workflow, packages, deployment=False)
    _check_deployment(build, workflow, packages)
    _check_digests(context, workflow, packages, deployment=True)


def check_deployment(build: Path, *, packages: bool = True) -> None:
    """Only the deployment files (workflow.yaml's schema, stack files, SAM templates, state machines,
    samconfig.toml, no secrets): for a folder that holds those but is no whole build."""
    build = Path(build)
    _check_deployment(build, _check_manifest(build, None)[1], packages)


def _check_deployment(build: Path, workflow: Workflow, packages: bool) -> None:
    names = [region.name for region in workflow.regions]
    regions_dir = build / "regions"
    if regions_dir.is_dir():
        for folder in sorted(p for p in regions_dir.iterdir() if p.is_dir()):
            deployable = (folder / "stack.yaml").exists() or (folder / "template.yaml").exists()
            if folder.name not in names and deployable:
                _fail(f"regions/{folder.name}", "(folder)", f"region {folder.name!r} is not in workflow.yaml")
    sam_regions = []
    for region in workflow.regions:
        folder = regions_dir / region.name
        stack, template = folder / "stack.yaml", folder / "template.yaml"
        if not stack.exists() and not template.exists():
            _fail(f"regions/{region.name}", "(folder)", "neither stack.yaml nor template.yaml was generated")
        if stack.exists():
            _check_stack(build, region, packages)
        if template.exists():
            sam_regions.append(region)
    if sam_regions or (build / "samconfig.toml").exists():
        deploy_regions = _check_samconfig(build, workflow, [r.name for r in sam_regions])
        for region in sam_regions:
            _check_template(build, workflow, region, deploy_regions[region.name], packages)
    if len(names) > 1:
        _check_region_storage(build, workflow)
    _check_no_secrets(build, names)


def _check_region_storage(build: Path, workflow: Workflow) -> None:
    """Several regions: one bucket per region, and every function reaches each other region's storage through
    CLOUDLESS_PEERS (OpenFaaS: that region's storage URL; SAM: the stack parameter naming its bucket, with
    read rights on it)."""
    storage: dict[str, str] = {}
    for region in workflow.regions:
        path = build / "regions" / region.name / "stack.yaml"
        if not path.exists():
            continue
        file = _relative(build, path)
        for name, function in _load_yaml(build, path)["functions"].items():
            where = storage.setdefault(region.name, str(function.get("environment", {}).get(STORAGE_ENV)))
            if function.get("environment", {}).get(STORAGE_ENV) != where:
                _fail(file, f"functions/{name}/environment/{STORAGE_ENV}", f"not the region's storage {where!r}")
    order = list(storage)
    shared = [(a, b) for i, a in enumerate(order) for b in order[i + 1 :] if storage[a] == storage[b]]
    if shared:
        a, b = shared[0]
        _fail(
            f"regions/{b}/stack.yaml",
            f"functions/*/environment/{STORAGE_ENV}",
            f"{storage[b]!r} is region {a!r}'s storage too: every region has its own bucket",
        )
    for region in workflow.regions:
        peers = [r.name for r in workflow.regions if r.name != region.name]
        path = build / "regions" / region.name / "stack.yaml"
        if path.exists():
            file = _relative(build, path)
            for name, function in _load_yaml(build, path)["functions"].items():
                key = f"functions/{name}/environment/{PEERS_ENV}"
                try:
                    value = json.loads(function.get("environment", {}).get(PEERS_ENV, ""))
                except ValueError:
                    _fail(file, key, "missing or not JSON: the function cannot reach the other regions' storage")
                expected = {peer: storage.get(peer) for peer in peers}
                if value != expected:
                    _fail(file, key, f"{value}, but the other regions' storage is {expected}")
        path = build / "regions" / region.name / "template.yaml"
        if path.exists():
            file = _relative(build, path)
            template = _load_yaml(build, path)
            parameters = template.get("Parameters") or {}
            for peer in peers:
                if peer_parameter(peer) not in parameters:
                    _fail(file, f"Parameters/{peer_parameter(peer)}", f"missing: the bucket of peer region {peer!r}")
            for logical, resource in template["Resources"].items():
                if resource.get("Type") != "AWS::Serverless::Function":
                    continue
                key = f"Resources/{logical}/Properties/Environment/Variables/{PEERS_ENV}"
                variables = resource["Properties"].get("Environment", {}).get("Variables", {})
                peers_value = variables.get(PEERS_ENV)
                sub = peers_value.get("Fn::Sub") if isinstance(peers_value, dict) else None
                if not isinstance(sub, str):
                    _fail(file, key, "missing: the function cannot reach the other regions' storage")
                for peer in peers:
                    if f"${{{peer_parameter(peer)}}}" not in sub:
                        _fail(file, key, f"does not name peer region {peer!r}'s bucket (${{{peer_parameter(peer)}}})")
                statements = [
                    statement
                    for policy in resource["Properties"].get("Policies", [])
                    if isinstance(policy, dict)
                    for statement in policy.get("Statement", [])
                ]
                reads = [st.get("Resource") for st in statements if "s3:GetObject" in str(st.get("Action"))]
                readable = json.dumps(reads)
                for peer in peers:
                    if f"${{{peer_parameter(peer)}}}" not in readable:
                        where = f"Resources/{logical}/Properties/Policies"
                        _fail(file, where, f"no read right on peer {peer!r}'s bucket")


def _relative(build: Path, path: Path) -> str:
    return path.relative_to(build).as_posix()


def _load_yaml(build: Path, path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        # Short-form intrinsics (!Ref) fail here too: the project writes them in long form.
        where = ""
        if isinstance(exc, yaml.MarkedYAMLError) and exc.problem_mark is not None:
            where = f" at line {exc.problem_mark.line + 1}, column {exc.problem_mark.column + 1}"
        problem = exc.problem if isinstance(exc, yaml.MarkedYAMLError) and exc.problem else str(exc)
        _fail(_relative(build, path), "(top level)", f"not plain YAML: {problem}{where}")


def _check_manifest(build: Path, context: _Build | None) -> tuple[dict[str, Any], Workflow]:
    """workflow.yaml's document and workflow, once it passes its schema and the DAG check."""
    path = build / "workflow.yaml"
    if not path.exists():
        _fail("workflow.yaml", "(file)", "missing")
    document = _load_yaml(build, path)
    _schema_check(document, "workflow", "workflow.yaml")
    _check_step_replicas(document, context)
    try:
        check_workflow(document, "workflow.yaml")
    except BuildCheckError:
        raise
    except SchemaError as exc:
        raise BuildCheckError(str(exc)) from exc
    return document, Workflow.from_json(document)


def _schema_check(document: Any, schema_name: str, file: str) -> None:
    """Like cloudless.ir.schema.validate, but the key names the offending entry itself (the unknown key, the
    bad property name), not only the object holding it."""
    validator = jsonschema.Draft202012Validator(load_schema(schema_name))
    errors = sorted(validator.iter_errors(document), key=lambda e: [str(p) for p in e.absolute_path])
    if not errors:
        return
    error = errors[0]
    path = [str(p) for p in error.absolute_path]
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        allowed = set(error.schema.get("properties", {}))
        patterns = list(error.schema.get("patternProperties", {}))
        extra = sorted(k for k in error.instance if k not in allowed and not any(re.search(p, k) for p in patterns))
        if extra:
            path.append(str(extra[0]))
    elif "propertyNames" in error.schema_path:
        path.append(str(error.instance))
    _fail(file, "/".join(path) or "(top level)", error.message)


def _seconds(duration: str) -> float:
    return sum(float(value) * _DURATION_UNITS[unit] for value, unit in _DURATION_PART.findall(duration))


def _check_stack(build: Path, region: Region, packages: bool) -> None:
    path = build / "regions" / region.name / "stack.yaml"
    file = _relative(build, path)
    stack = _load_yaml(build, path)
    _schema_check(stack, "openfaas-stack", file)
    expected = {f.name: f for f in region.functions}
    for name in stack["functions"]:
        if name not in expected:
            _fail(file, f"functions/{name}", f"not a function of region {region.name!r} in workflow.yaml")
    for name in expected:
        if name not in stack["functions"]:
            _fail(file, "functions", f"function {name!r} of workflow.yaml is missing")
    for name, function in stack["functions"].items():
        key = f"functions/{name}"
        environment = function.get("environment", {})
        for timeout in ("exec_timeout", "read_timeout", "write_timeout"):
            if timeout not in environment:
                # The watchdog's default (10 s) would cut a training step short.
                _fail(file, f"{key}/environment/{timeout}", "missing")
        exec_s = _seconds(environment["exec_timeout"])
        if exec_s < expected[name].timeout_s:
            _fail(
                file,
                f"{key}/environment/exec_timeout",
                f"{environment['exec_timeout']} is shorter than the function's timeout_s "
                f"{expected[name].timeout_s} in workflow.yaml",
            )
        for timeout in ("read_timeout", "write_timeout"):
            if _seconds(environment[timeout]) < exec_s:
                _fail(
                    file,
                    f"{key}/environment/{timeout}",
                    f"{environment[timeout]} is shorter than exec_timeout {environment['exec_timeout']}: the "
                    "response of a handler using its whole time would be cut off",
                )
        _check_image(file, key, function["image"], name)
        labels = function.get("labels", {})
        low, high = labels.get("com.openfaas.scale.min"), labels.get("com.openfaas.scale.max")
        if low is not None and high is not None and int(low) > int(high):
            _fail(file, f"{key}/labels/com.openfaas.scale.min", f"{low} exceeds com.openfaas.scale.max {high}")
        if packages:
            handler = (path.parent / function["handler"]).resolve()
            if not handler.is_dir():
                _fail(file, f"{key}/handler", f"no folder {function['handler']!r} next to the stack file")
            for needed in ("handler.py", "requirements.txt"):
                if not (handler / needed).is_file():
                    _fail(file, f"{key}/handler", f"{function['handler']!r} has no {needed}")


def _split_image(image: str) -> tuple[str, str, str | None]:
    """An image reference `[<registry>/]<name>[:<tag>]` as (registry, name, tag); registry '' if none."""
    repository, tag = image, None
    if ":" in image.rsplit("/", 1)[-1]:
        repository, tag = image.rsplit(":", 1)
    registry, _, name = repository.rpartition("/")
    return registry, name, tag


def _check_image(file: str, key: str, image: str, function: str) -> None:
    """An image faas-cli can build, tag and push as written: `[<registry>/]<function>:<tag>`, with a tag of
    its own (faas-cli would add `:latest`, which names different images over time)."""
    registry, name, tag = _split_image(image)
    if name != function:
        _fail(file, f"{key}/image", f"{image!r}: the image of function {function!r} is named {function!r}")
    if tag is None or not _TAG.fullmatch(tag) or tag == "latest":
        _fail(file, f"{key}/image", f"{image!r}: expected a tag naming the build (<name>:<tag>, not latest)")
    if registry:
        problem = registry_problem(registry)
        if problem:
            _fail(file, f"{key}/image", f"{image!r}: the registry {registry!r} is {problem}")


def deployment_warnings(build: Path) -> list[str]:
    """What a build's deployment files allow, but a default platform would refuse (one line each, the file
    first): OpenFaaS images without a registry (faas-cli up fails at the push) and stacks beyond OpenFaaS CE's
    limits (they deploy on OpenFaaS Pro only). For a build that passed check_build."""
    found = []
    regions = Path(build) / "regions"
    for path in sorted(regions.glob("*/stack.yaml")) if regions.is_dir() else []:
        file = _relative(Path(build), path)
        stack = yaml.safe_load(path.read_text())
        functions = stack.get("functions", {}) if isinstance(stack, dict) else {}
        bare = [name for name, function in functions.items() if not _split_image(str(function.get("image")))[0]]
        if bare:
            found.append(
                f"{file}: the images have no registry ({functions[bare[0]]['image']}): faas-cli up fails at the "
                "push; compile with --registry (e.g. ghcr.io/<you>) or give the region a registry in the catalog"
            )
        if len(functions) > OPENFAAS_CE_MAX_FUNCTIONS:
            found.append(
                f"{file}: {len(functions)} functions; OpenFaaS CE deploys at most {OPENFAAS_CE_MAX_FUNCTIONS} "
                "(this stack needs OpenFaaS Pro)"
            )
        for name, function in functions.items():
            scale = function.get("labels", {}).get("com.openfaas.scale.max")
            if scale is not None and int(scale) > OPENFAAS_CE_MAX_REPLICAS:
                found.append(
                    f"{file}: function {name} scales to {scale} replicas; OpenFaaS CE allows at most "
                    f"{OPENFAAS_CE_MAX_REPLICAS} (this stack needs OpenFaaS Pro)"
                )
    return found


def _check_samconfig(build: Path, workflow: Workflow, sam_regions: list[str]) -> dict[str, str]:
    """Check samconfig.toml; return each SAM region's AWS region (what cfn-lint checks the template for)."""
    file = "samconfig.toml"
    path = build / file
    if not path.exists():
        _fail(file, "(file)", f"missing, but regions {sam_regions} have SAM templates")
    try:
        config = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        _fail(file, "(top level)", f"not TOML: {exc}")
    if config.get("version") != 0.1:
        _fail(file, "version", f"{config.get('version')!r}; sam reads version = 0.1")
    regions = {region.name for region in workflow.regions}
    for env in config:
        if env != "version" and env not in regions:
            _fail(file, env, f"config-env {env!r} is not a region of workflow.yaml")
    deploy_regions = {}
    for name in sam_regions:
        if name not in config:
            _fail(file, name, "missing: every region with a template.yaml needs its config-env")
        build_template = config[name].get("build", {}).get("parameters", {}).get("template_file")
        if build_template != f"regions/{name}/template.yaml":
            _fail(file, f"{name}.build.parameters.template_file", f"{build_template!r}; expected the region's template")
        deploy = config[name].get("deploy", {}).get("parameters")
        if not isinstance(deploy, dict):
            _fail(file, f"{name}.deploy.parameters", "missing")
        for needed in ("stack_name", "region", "template_file", "capabilities"):
            if not isinstance(deploy.get(needed), str) or not deploy[needed]:
                _fail(file, f"{name}.deploy.parameters.{needed}", "missing or not a string")
        if deploy["region"] not in AWS_REGIONS:
            _fail(file, f"{name}.deploy.parameters.region", f"{deploy['region']!r} is not an AWS region")
        if deploy["region"] != aws_region(name):
            _fail(file, f"{name}.deploy.parameters.region", f"{deploy['region']!r}, but the region is {name!r}")
        deploy_regions[name] = deploy["region"]
    return deploy_regions


def _walk_refs(node: Any, where: list[str]) -> list[tuple[str, str]]:
    """(key path, target) of every Ref, Fn::GetAtt and name Fn::Sub substitutes in a template fragment."""
    found: list[tuple[str, str]] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "Ref" and isinstance(value, str):
                found.append(("/".join([*where, key]), value))
            elif key == "Fn::GetAtt" and isinstance(value, list) and value and isinstance(value[0], str):
                found.append(("/".join([*where, key]), value[0]))
            elif key == "Fn::Sub" and isinstance(value, str):
                found.extend(("/".join([*where, key]), name) for name in _SUB_NAME.findall(value))
            else:
                found.extend(_walk_refs(value, [*where, str(key)]))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found.extend(_walk_refs(value, [*where, str(index)]))
    return found


def _check_template(build: Path, workflow: Workflow, region: Region, deploy_region: str, packages: bool) -> None:
    path = build / "regions" / region.name / "template.yaml"
    file = _relative(build, path)
    template = _load_yaml(build, path)
    if not isinstance(template, dict) or not isinstance(template.get("Resources"), dict):
        _fail(file, "Resources", "missing")
    if template.get("Transform") != "AWS::Serverless-2016-10-31":
        _fail(file, "Transform", "the SAM transform AWS::Serverless-2016-10-31 is required")
    resources: dict[str, Any] = template["Resources"]
    targets = set(resources) | set(template.get("Parameters", {}))
    for key, target in _walk_refs(resources, ["Resources"]) + _walk_refs(template.get("Outputs", {}), ["Outputs"]):
        if target not in targets and not target.startswith("AWS::"):
            _fail(file, key, f"{target!r} is neither a resource nor a parameter")
    outputs = template.get("Outputs", {})
    names: dict[str, str] = {}
    for function in region.functions:
        logical = logical_id(function.name)
        if resources.get(logical, {}).get("Type") != "AWS::Serverless::Function":
            _fail(file, f"Resources/{logical}", f"no AWS::Serverless::Function for {function.name!r}")
        # a name of its own, which the stack exports: the controller invokes the functions by name
        key = f"Resources/{logical}/Properties/FunctionName"
        name = resources[logical].get("Properties", {}).get("FunctionName")
        if not isinstance(name, str) or not _AWS_NAME.fullmatch(name) or len(name) > LAMBDA_NAME_LIMIT:
            _fail(file, key, f"{name!r}; Lambda takes letters, digits, '-' and '_', at most {LAMBDA_NAME_LIMIT}")
        if name in names:
            _fail(file, key, f"{name!r} is also the name of {names[name]}")
        names[name] = logical
        output = outputs.get(f"{logical}Name", {})
        if output.get("Value") != {"Ref": logical} or "Export" not in output:
            _fail(file, f"Outputs/{logical}Name", f"missing: the stack exports each function's name (Ref {logical})")
    buckets = [n for n, r in resources.items() if isinstance(r, dict) and r.get("Type") == "AWS::S3::Bucket"]
    for bucket in buckets:
        if "BucketName" in resources[bucket].get("Properties", {}):
            # S3 bucket names are global: a fixed one can be guessed, and taken first, by anyone
            _fail(file, f"Resources/{bucket}/Properties/BucketName", "the run's bucket is named by CloudFormation")
    if len(buckets) != 1 or outputs.get("BucketName", {}).get("Value") != {"Ref": buckets[0]}:
        _fail(file, "Outputs/BucketName", "expected the run's bucket, one AWS::S3::Bucket of the stack, as output")
    machines = []
    for name, resource in resources.items():
        kind = resource.get("Type") if isinstance(resource, dict) else None
        if kind == "AWS::Serverless::Function":
            _check_function(build, path, name, resource, packages)
        elif kind == "AWS::Serverless::StateMachine":
            machines.append(name)
            _check_state_machine(build, path, name, resource, region)
    if not machines:
        _fail(file, "Resources", "no AWS::Serverless::StateMachine")
    _cfn_lint(file, path.read_text(), deploy_region)


def _check_function(build: Path, path: Path, name: str, resource: dict[str, Any], packages: bool) -> None:
    file = _relative(build, path)
    key = f"Resources/{name}"
    properties = resource.get("Properties", {})
    if properties.get("PackageType") != "Image":
        # torch does not fit the 250 MB limit of a zip package.
        _fail(file, f"{key}/Properties/PackageType", f"{properties.get('PackageType')!r}; expected Image")
    memory = properties.get("MemorySize")
    low, high = LAMBDA_MEMORY_MB
    if not isinstance(memory, int) or not low <= memory <= high:
        _fail(file, f"{key}/Properties/MemorySize", f"{memory!r}; Lambda allows {low} to {high} MB")
    timeout = properties.get("Timeout")
    if not isinstance(timeout, int) or not 1 <= timeout <= LAMBDA_MAX_TIMEOUT_S:
        _fail(file, f"{key}/Properties/Timeout", f"{timeout!r}; Lambda allows 1 to {LAMBDA_MAX_TIMEOUT_S} s")
    if not properties.get("ImageConfig", {}).get("Command"):
        _fail(file, f"{key}/Properties/ImageConfig/Command", "missing")
    for policy in properties.get("Policies", []):
        for policy_name, arguments in policy.items() if isinstance(policy, dict) else []:
            bucket = arguments.get("BucketName") if isinstance(arguments, dict) else None
            if policy_name.startswith("S3") and not (isinstance(bucket, dict) and "Ref" in bucket):
                _fail(file, f"{key}/Properties/Policies/{policy_name}", "an S3 policy must name the run's bucket (Ref)")
    metadata = resource.get("Metadata", {})
    for needed in ("Dockerfile", "DockerContext", "DockerTag"):
        if not isinstance(metadata.get(needed), str):
            _fail(file, f"{key}/Metadata/{needed}", "missing: sam build needs it to build the image")
    if packages:
        context = path.parent / metadata["DockerContext"]
        if not context.is_dir():
            _fail(file, f"{key}/Metadata/DockerContext", f"no folder {metadata['DockerContext']!r}")
        if not (context / metadata["Dockerfile"]).is_file():
            _fail(file, f"{key}/Metadata/Dockerfile", f"no {metadata['Dockerfile']} in {metadata['DockerContext']!r}")


def _check_state_machine(build: Path, template_path: Path, name: str, resource: dict[str, Any], region: Region) -> None:
    file = _relative(build, template_path)
    key = f"Resources/{name}/Properties"
    properties = resource.get("Properties", {})
    machine = properties.get("Name")
    if not isinstance(machine, str) or not _AWS_NAME.fullmatch(machine) or len(machine) > STATE_MACHINE_NAME_LIMIT:
        # its Distributed Map's policy names it, and the controller finds it by it
        _fail(
            file,
            f"{key}/Name",
            f"{machine!r}; a state machine's name is letters, digits, '-' and '_', at most {STATE_MACHINE_NAME_LIMIT}",
        )
    uri = properties.get("DefinitionUri")
    if not isinstance(uri, str):
        _fail(file, f"{key}/DefinitionUri", "expected the definition file next to the template")
    definition_path = template_path.parent / uri
    if not definition_path.is_file():
        _fail(file, f"{key}/DefinitionUri", f"no file {uri!r}")
    text = definition_path.read_text()
    substitutions = properties.get("DefinitionSubstitutions", {})
    placeholders = sorted(set(_PLACEHOLDER.findall(text)))
    for placeholder in placeholders:
        if placeholder not in substitutions:
            _fail(file, f"{key}/DefinitionSubstitutions", f"{uri} uses ${{{placeholder}}}, which is not substituted")
    for substitution in substitutions:
        if substitution not in placeholders:
            _fail(file, f"{key}/DefinitionSubstitutions/{substitution}", f"not used in {uri}")
    workers = sum(f.replicas for f in region.functions)
    check_definition(_relative(build, definition_path), text, workers)
    if _distributed(json.loads(substitute_arns(text)).get("States", {})):
        # a Distributed Map starts its iterations as executions of this state machine: its role must allow it
        allowed = [
            statement.get("Resource")
            for policy in properties.get("Policies", [])
            if isinstance(policy, dict)
            for statement in policy.get("Statement", [])
            if isinstance(statement, dict) and "states:StartExecution" in _as_list(statement.get("Action"))
        ]
        own = f":stateMachine:{machine}"
        if not any(isinstance(r, dict) and str(r.get("Fn::Sub", "")).endswith(own) for r in allowed):
            _fail(
                file,
                f"{key}/Policies",
                f"{uri} runs a Distributed Map, but no statement allows states:StartExecution on state machine "
                f"{machine}",
            )


def _distributed(states: dict[str, Any]) -> bool:
    """Whether a state machine's states hold a Distributed Map (at any depth)."""
    for state in states.values():
        processor = state.get("ItemProcessor") or state.get("Iterator") or {}
        if (processor.get("ProcessorConfig") or {}).get("Mode") == "DISTRIBUTED":
            return True
        branches = [processor, *state.get("Branches", [])]
        if any(_distributed(branch.get("States", {})) for branch in branches):
            return True
    return False


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


def substitute_arns(text: str) -> str:
    """The definition with every `${Name}` placeholder replaced by a Lambda ARN (for linting)."""
    return _PLACEHOLDER.sub(lambda m: DUMMY_ARN.format(name=m.group(1)[:64]), text)


def check_definition(file: str, text: str, workers: int) -> None:
    """Check a state machine definition (placeholders allowed) that invokes `workers` functions per Map."""
    from statelint.linter import Linter

    size = len(_PLACEHOLDER.sub("x" * LONGEST_ARN, text).encode())
    if size > MAX_DEFINITION_BYTES:
        _fail(file, "(top level)", f"about {size} bytes once substituted; Step Functions allows {MAX_DEFINITION_BYTES}")
    substituted = substitute_arns(text)
    try:
        definition = json.loads(substituted)
    except json.JSONDecodeError as exc:
        _fail(file, "(top level)", f"not JSON: {exc}")
    problems = Linter.validate(definition)
    if problems:
        _fail(file, _statelint_key(problems[0]), f"statelint: {problems[0]}")
    _check_states(file, definition.get("States", {}), ["States"], workers)


def _statelint_key(problem: str) -> str:
    """statelint names places as `State Machine.States.X.Retry[0].BackoffRate`; make that a key path."""
    match = re.search(r"State Machine((?:\.[A-Za-z0-9_\-]+|\[\d+\])+)", problem)
    if not match:
        return "(definition)"
    return "/".join(re.findall(r"[A-Za-z0-9_\-]+", match.group(1)))


def _check_states(file: str, states: dict[str, Any], where: list[str], workers: int) -> None:
    for name, state in states.items():
        key = "/".join([*where, name])
        kind = state.get("Type")
        if kind == "Map":
            config = (state.get("ItemProcessor") or {}).get("ProcessorConfig") or {}
            mode = config.get("Mode", "INLINE")
            if mode == "DISTRIBUTED" and config.get("ExecutionType") != "STANDARD":
                # an Express child execution ends after 5 minutes; a worker may run up to Lambda's 15
                _fail(file, f"{key}/ItemProcessor/ProcessorConfig/ExecutionType", "expected STANDARD")
            most = DISTRIBUTED_MAP_MAX_CONCURRENCY if mode == "DISTRIBUTED" else INLINE_MAP_MAX_CONCURRENCY
            concurrency = state.get("MaxConcurrency")
            if not isinstance(concurrency, int) or not 1 <= concurrency <= most:
                _fail(
                    file,
                    f"{key}/MaxConcurrency",
                    f"{concurrency!r}; {'a Distributed' if mode == 'DISTRIBUTED' else 'an inline'} Map runs at most "
                    f"{most} iterations at once",
                )
            if concurrency < workers:
                # The stages wait on each other's activations: a worker left queued deadlocks the iteration.
                _fail(file, f"{key}/MaxConcurrency", f"{concurrency} < the region's {workers} workers")
            processor = state.get("ItemProcessor") or state.get("Iterator") or {}
            inner = "ItemProcessor" if "ItemProcessor" in state else "Iterator"
            _check_states(file, processor.get("States", {}), [*where, name, inner, "States"], workers)
        elif kind == "Parallel":
            for index, branch in enumerate(state.get("Branches", [])):
                _check_states(file, branch.get("States", {}), [*where, name, "Branches", str(index), "States"], workers)
        elif kind == "Task":
            if state.get("Resource") != LAMBDA_INVOKE:
                _fail(file, f"{key}/Resource", f"{state.get('Resource')!r}; expected {LAMBDA_INVOKE}")
            retried = {error for retry in state.get("Retry", []) for error in retry.get("ErrorEquals", [])}
            missing = [error for error in LAMBDA_RETRY_ERRORS if error not in retried and "States.ALL" not in retried]
            if missing:
                _fail(file, f"{key}/Retry", f"no retry on {', '.join(missing)}")
            caught = {error for catch in state.get("Catch", []) for error in catch.get("ErrorEquals", [])}
            if "States.ALL" not in caught:
                _fail(file, f"{key}/Catch", "no Catch on States.ALL")


def _cfn_lint(file: str, text: str, deploy_region: str) -> None:
    import cfnlint.api

    # Errors only: warnings (deprecations, best practices) depend on the date and are not failures.
    errors = [m for m in cfnlint.api.lint(text, regions=[deploy_region]) if m.rule.id.startswith("E")]
    if errors:
        match = errors[0]
        key = "/".join(str(p) for p in (match.path or [])) or f"line {match.linenumber}"
        _fail(file, key, f"cfn-lint {match.rule.id}: {match.message}")


def _check_no_secrets(build: Path, regions: list[str]) -> None:
    """No credentials in any generated deployment file (the function packages are checked by their writer)."""
    files = [build / "workflow.yaml", build / "samconfig.toml"]
    for name in regions:
        files += [build / "regions" / name / leaf for leaf in ("stack.yaml", "template.yaml", "statemachine.asl.json")]
    for path in files:
        if not path.exists():
            continue
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            for pattern in _SECRET_PATTERNS:
                if pattern.search(line):
                    _fail(_relative(build, path), f"line {number}", f"looks like a credential ({pattern.pattern})")


# --- what a run relies on --------------------------------------------------------------------------------

#: the hint on a message about a file whose digest no longer matches cloudless-build.json
EDITED = " (the file was edited after the compile; recompile)"
_MISSING = object()
#: safetensors dtype -> (the torch dtype name a generated stage's TENSORS gives, bytes per element)
_SAFETENSORS_DTYPES = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "C64": ("complex64", 8),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U64": ("uint64", 8),
    "U32": ("uint32", 4),
    "U16": ("uint16", 2),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
}
#: a package's files besides stage.py, weights and the loss, and why each is needed
_PACKAGE_FILES = {
    "function.json": "the worker reads its function, region and workflow from it",
    "handler.py": "the function's entry point (Lambda's CMD, OpenFaaS's handler)",
    "stage.py": "the stage's generated module, which the worker runs",
    "weights.safetensors": "the stage's initial weights, which the worker loads at iteration 0",
    "requirements.txt": "the OpenFaaS image's dependencies",
    "requirements-torch.txt": "the Lambda image's torch (its Dockerfile's first pip step)",
    "requirements-pypi.txt": "the Lambda image's other dependencies (its Dockerfile's second pip step)",
    "Dockerfile": "what the Lambda image is built from",
}


class _Build:
    """A build folder and its manifest: which files are as compiled (their digests, each computed once),
    and the compiled workflow (an intact function.json's copy), to tell which of two disagreeing values
    was edited. Without a manifest (`check_deployment`) nothing counts as edited."""

    def __init__(self, root: Path, manifest: dict[str, str] | None) -> None:
        self.root, self.manifest = root, manifest or {}
        self._digests: dict[str, str | None] = {}
        self._compiled: Any = _MISSING

    @classmethod
    def open(cls, root: Path) -> _Build:
        if not (root / BUILD_MARKER).is_file():
            _fail(
                BUILD_MARKER,
                "(file)",
                "missing: not a build written by cloudless-compile, or written by an older version; recompile",
            )
        manifest = read_manifest(root)
        if manifest is None:
            _fail(BUILD_MARKER, "(top level)", 'not JSON of kind "cloudless-build" with "files"; recompile')
        for path, digest in manifest.items():
            parts = PurePosixPath(path).parts
            if PurePosixPath(path).is_absolute() or ".." in parts or not parts:
                _fail(BUILD_MARKER, f"files/{path}", "not a path inside the build folder")
            if not isinstance(digest, str) or not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
                _fail(BUILD_MARKER, f"files/{path}", f"{_short(digest)} is not sha256:<64 hex digits>")
        return cls(root, manifest)

    def digest(self, path: str) -> str | None:
        """The file's digest now; None if it is not there."""
        if path not in self._digests:
            file = self.root / path
            self._digests[path] = file_digest(file.read_bytes()) if file.is_file() else None
        return self._digests[path]

    def edited(self, path: str) -> bool:
        """Listed in the manifest, but missing or with other bytes."""
        return path in self.manifest and self.digest(path) != self.manifest[path]

    def culprit(self, default: str, other: str) -> str:
        """Of two files that disagree, the one to name: `other` when only it was edited, else `default`."""
        return other if self.edited(other) and not self.edited(default) else default

    def note(self, path: str) -> str:
        return EDITED if self.edited(path) else ""

    @property
    def compiled(self) -> Any:
        """The workflow document as compiled: the copy in the first intact function.json (None if none is)."""
        if self._compiled is _MISSING:
            self._compiled = None
            for path in sorted(p for p in self.manifest if p.endswith("/function.json")):
                if not self.edited(path):
                    try:
                        self._compiled = json.loads((self.root / path).read_text())["workflow"]
                    except (OSError, ValueError, KeyError, TypeError):
                        continue
                    break
        return self._compiled

    def blame(self, keys: list[str]) -> str:
        """Of workflow.yaml's keys that disagree with each other, the first whose value is not as compiled
        (the first when that cannot be told)."""
        if self.edited("workflow.yaml") and self.compiled is not None:
            document = yaml.safe_load((self.root / "workflow.yaml").read_text())
            for key in keys:
                if _lookup(document, key) != _lookup(self.compiled, key):
                    return key
        return keys[0]

    def was(self, key: str, value: Any) -> str:
        """`; compiled as X` when workflow.yaml's `key` holds `value` but was compiled otherwise."""
        if not self.edited("workflow.yaml") or self.compiled is None:
            return ""
        compiled = _lookup(self.compiled, key)
        if compiled is _MISSING or compiled == value:
            return ""
        return f"; compiled as {_short(compiled)}{EDITED}"


def _lookup(document: Any, key: str) -> Any:
    """The value at a key path like `regions/0/functions/1/inputs`; _MISSING if there is none."""
    for part in key.split("/"):
        if isinstance(document, dict) and part in document:
            document = document[part]
        elif isinstance(document, list) and part.isdigit() and int(part) < len(document):
            document = document[int(part)]
        else:
            return _MISSING
    return document


def _short(value: Any, limit: int = 80) -> str:
    text = "(nothing)" if value is _MISSING else repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _first_difference(ours: Any, theirs: Any, where: str = "") -> tuple[str, Any, Any] | None:
    """The first key path (in `theirs`' order) at which two JSON documents differ, and both values."""
    if isinstance(ours, dict) and isinstance(theirs, dict):
        for key in [*theirs, *(k for k in ours if k not in theirs)]:
            path = f"{where}/{key}" if where else str(key)
            if key not in ours or key not in theirs:
                return path, ours.get(key, _MISSING), theirs.get(key, _MISSING)
            found = _first_difference(ours[key], theirs[key], path)
            if found:
                return found
        return None
    if isinstance(ours, list) and isinstance(theirs, list) and len(ours) == len(theirs):
        for index, (a, b) in enumerate(zip(ours, theirs, strict=True)):
            found = _first_difference(a, b, f"{where}/{index}" if where else str(index))
            if found:
                return found
        return None
    return None if ours == theirs else (where or "(top level)", ours, theirs)


def _function_key(document: dict[str, Any], region: int, name: str) -> str:
    """workflow.yaml's key of a region's function (Workflow.from_json sorts them by stage)."""
    for index, function in enumerate(document["regions"][region]["functions"]):
        if function["name"] == name:
            return f"regions/{region}/functions/{index}"
    raise KeyError(name)


def _check_step_replicas(document: dict[str, Any], context: _Build | None) -> None:
    """Each step has its function's replicas (before check_workflow, to name the edited side)."""
    functions = {
        (region["name"], function["name"]): (f"regions/{r}/functions/{f}/replicas", function["replicas"])
        for r, region in enumerate(document["regions"])
        for f, function in enumerate(region["functions"])
    }
    for i, step in enumerate(document["steps"]):
        found = functions.get((step["region"], step["function"]))
        if found is None or found[1] == step["replicas"]:
            continue
        step_key, (function_key, replicas) = f"steps/{i}/replicas", found
        if context is not None and context.blame([step_key, function_key]) == function_key:
            _fail(
                "workflow.yaml",
                function_key,
                f"{replicas}, but its steps (steps/{i}) have {step['replicas']}{context.was(function_key, replicas)}",
            )
        note = context.was(step_key, step["replicas"]) if context is not None else ""
        _fail(
            "workflow.yaml",
            step_key,
            f"{step['replicas']}, but function {step['function']!r} has {replicas} ({function_key}){note}",
        )


def _check_run(context: _Build, document: dict[str, Any], workflow: Workflow) -> None:
    """What the workers and the controller take from workflow.yaml agrees with itself."""
    file = "workflow.yaml"
    run = workflow.run
    if run.micro_batch * run.micro_batches != run.global_batch:
        key = context.blame(["run/micro_batch", "run/micro_batches", "run/global_batch"])
        _fail(
            file,
            key,
            f"micro_batch {run.micro_batch} x micro_batches {run.micro_batches} = "
            f"{run.micro_batch * run.micro_batches}, but global_batch is {run.global_batch}: every iteration's "
            f"global_batch samples are cut into micro_batches of micro_batch{context.was(key, _lookup(document, key))}",
        )
    blocks = _block_count(context.root)
    partition = [f.blocks for f in workflow.regions[0].functions]
    for r, region in enumerate(workflow.regions):
        functions = region.functions  # in stage order
        for function in functions:
            key = _function_key(document, r, function.name)
            if function.package != f"regions/{region.name}/functions/{function.name}":
                _fail(
                    file,
                    f"{key}/package",
                    f"{function.package!r}; expected 'regions/{region.name}/functions/{function.name}'"
                    + context.was(f"{key}/package", function.package),
                )
            first, last = function.blocks
            if first > last:
                _fail(file, f"{key}/blocks", f"{list(function.blocks)}: the first block is after the last")
            if function.stage == 0 and first != 0:
                _fail(file, f"{key}/blocks", f"{list(function.blocks)}: stage 0 must start at block 0")
            if function.stage > 0:
                before = functions[function.stage - 1]
                if first != before.blocks[1] + 1:
                    before_key = _function_key(document, r, before.name)
                    blamed = context.blame([f"{key}/blocks", f"{before_key}/blocks"])
                    _fail(
                        file,
                        blamed,
                        f"stage {before.stage} has blocks {list(before.blocks)} and stage {function.stage} "
                        f"{list(function.blocks)}: the stages must tile the block chain, each from the block after "
                        f"the last of the one before{context.was(blamed, _lookup(document, blamed))}",
                    )
        if blocks is not None and functions[-1].blocks[1] != blocks - 1:
            key = f"{_function_key(document, r, functions[-1].name)}/blocks"
            _fail(
                file,
                key,
                f"{list(functions[-1].blocks)}: the last stage must end at the chain's last block {blocks - 1} "
                f"(ir/blocks.json has {blocks}){context.was(key, _lookup(document, key))}",
            )
        if [f.blocks for f in functions] != partition:
            key = f"regions/{r}/functions"
            _fail(
                file,
                key,
                f"blocks {[list(b) for b in (f.blocks for f in functions)]}, but region "
                f"{workflow.regions[0].name!r} has {[list(b) for b in partition]}: every region runs the same "
                "generated stages",
            )
        _check_stage_inputs(context, document, workflow, r)
    _check_regions(context, document, workflow)
    _check_optimizer(context, document, workflow)


def _block_count(build: Path) -> int | None:
    """How many blocks ir/blocks.json has (None without a readable one)."""
    try:
        blocks = json.loads((build / "ir" / "blocks.json").read_text())["blocks"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return len(blocks) if isinstance(blocks, list) else None


def _check_stage_inputs(context: _Build, document: dict[str, Any], workflow: Workflow, r: int) -> None:
    """Stage 0 takes the data inputs, in order (the worker zips them with the stored data); each later
    stage takes tensors the one before it sends (it reads only that stage's activations)."""
    file = "workflow.yaml"
    functions = workflow.regions[r].functions
    first_key = f"{_function_key(document, r, functions[0].name)}/inputs"
    if functions[0].inputs != workflow.data.inputs:
        key = context.blame([first_key, "data/inputs"])
        _fail(
            file,
            key,
            f"stage 0 takes {list(functions[0].inputs)}, but data/inputs is {list(workflow.data.inputs)}: the "
            f"first stage takes the data inputs in order{context.was(key, _lookup(document, key))}",
        )
    for before, function in zip(functions, functions[1:], strict=False):
        missing = [name for name in function.inputs if name not in before.outputs]
        if missing:
            key = f"{_function_key(document, r, function.name)}/inputs"
            before_key = f"{_function_key(document, r, before.name)}/outputs"
            blamed = context.blame([key, before_key])
            _fail(
                file,
                blamed,
                f"stage {function.stage} takes {missing}, which stage {before.stage} does not send (its outputs "
                f"are {list(before.outputs)}){context.was(blamed, _lookup(document, blamed))}",
            )


def _check_regions(context: _Build, document: dict[str, Any], workflow: Workflow) -> None:
    """Several regions: what the controller and the workers' inter-region sync need."""
    file = "workflow.yaml"
    sync = workflow.sync
    names = [region.name for region in workflow.regions]
    for r, region in enumerate(workflow.regions):
        counted = sum(source.count for source in region.data_sources)
        if region.data_sources and region.samples is not None and region.samples != counted:
            counts = [f"regions/{r}/data_sources/{k}/count" for k in range(len(region.data_sources))]
            key = context.blame([f"regions/{r}/samples", *counts])
            if key in counts:
                count = region.data_sources[counts.index(key)].count
                what = f"{count}, but the region's samples are {region.samples} (its data_sources hold {counted})"
            else:
                what = f"{region.samples}, but its data_sources hold {counted}"
            _fail(file, key, what + context.was(key, _lookup(document, key)))
    if len(names) == 1:
        return
    if sync.inter_region is None:
        _fail(file, "sync/inter_region", f"null, but {len(names)} regions train: their models must meet")
    if sync.rounds is None:
        _fail(file, "sync/rounds", "missing: the controller runs every region for the planned rounds")
    if sync.inter_region == "asgd-ga" and sync.server not in names:
        _fail(file, "sync/server", f"{sync.server!r} is not a region of workflow.yaml {names}: ASGD-GA's server")
    for r, region in enumerate(workflow.regions):
        if region.iterations is None:
            _fail(file, f"regions/{r}/iterations", "missing: several regions run their planned iterations")
        if sync.inter_region == "sync" and region.iterations != workflow.run.iterations:
            key = context.blame([f"regions/{r}/iterations", "run/iterations"])
            _fail(
                file,
                key,
                f"region {region.name!r}: iterations {region.iterations}, but run/iterations {workflow.run.iterations}:"
                " under sync every region runs every iteration" + context.was(key, _lookup(document, key)),
            )
        if sync.inter_region == "sync" and sync.rounds != region.iterations:
            key = context.blame(["sync/rounds", f"regions/{r}/iterations"])
            _fail(
                file,
                key,
                f"sync/rounds {sync.rounds}, but region {region.name!r} runs {region.iterations} iterations: under "
                "sync the regions meet every iteration" + context.was(key, _lookup(document, key)),
            )
        if not 1 <= sync.rounds <= region.iterations:
            key = context.blame(["sync/rounds", f"regions/{r}/iterations"])
            _fail(
                file,
                key,
                f"region {region.name!r}: {sync.rounds} rounds over {region.iterations} iterations; every round holds "
                "at least one iteration (round_ends)" + context.was(key, _lookup(document, key)),
            )
        if sync.inter_region == "model-average" and region.weight is None:
            _fail(file, f"regions/{r}/weight", "missing: model averaging weighs each region's model")
    if sync.inter_region == "model-average":
        total = sum(region.weight or 0.0 for region in workflow.regions)
        if not math.isclose(total, 1.0, abs_tol=1e-6):
            key = context.blame([f"regions/{r}/weight" for r in range(len(names))])
            _fail(
                file,
                key,
                f"the regions' weights add up to {total:g}, not 1: the average would scale the model"
                + context.was(key, _lookup(document, key)),
            )


def _check_optimizer(context: _Build, document: dict[str, Any], workflow: Workflow) -> None:
    """Every worker builds `torch.optim.<class>(parameters, **options)`: build one on a dummy parameter."""
    import torch

    spec = workflow.optimizer
    optimizer = getattr(torch.optim, spec.class_name, None)
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        _fail(
            "workflow.yaml",
            "optimizer/class",
            f"{spec.class_name!r} is not a torch.optim optimizer" + context.was("optimizer/class", spec.class_name),
        )
    try:
        optimizer([torch.nn.Parameter(torch.zeros(1))], **spec.options)
    except (TypeError, ValueError, RuntimeError) as exc:
        _fail("workflow.yaml", "optimizer/options", f"torch.optim.{spec.class_name} refuses them: {exc}")
    rates = spec.learning_rates
    if rates is not None and len(rates) != workflow.run.iterations:
        _fail(
            "workflow.yaml",
            "optimizer/learning_rates",
            f"{len(rates)} rates; expected one per iteration of run/iterations ({workflow.run.iterations})",
        )


# --- plan.json ---------------------------------------------------------------------------------------


def _check_plan(context: _Build, document: dict[str, Any], workflow: Workflow) -> None:
    """plan.json's stages, batch sizes and schedule are workflow.yaml's (the report and the platform
    files come from the plan, the run from the workflow). Without plan.json nothing to compare: the
    digests say whether it should be there."""
    file = "plan.json"
    path = context.root / file
    if not path.is_file():
        return
    try:
        plan_document = json.loads(path.read_text())
    except ValueError as exc:
        _fail(file, "(top level)", f"not JSON: {exc}")
    _schema_check(plan_document, "plan", file)
    try:
        plan = TrainingPlan.from_json(plan_document)
    except ValueError as exc:
        _fail(file, "(top level)", str(exc))

    def agree(plan_key: str, plan_value: Any, workflow_key: str, workflow_value: Any) -> None:
        if plan_value == workflow_value:
            return
        if context.culprit(file, "workflow.yaml") == file:
            _fail(
                file,
                plan_key,
                f"{_short(plan_value)}, but workflow.yaml has {_short(workflow_value)} at {workflow_key}"
                + context.note(file),
            )
        _fail(
            "workflow.yaml",
            workflow_key,
            f"{_short(workflow_value)}, but plan.json has {_short(plan_value)} at {plan_key}{EDITED}",
        )

    run = workflow.run
    agree("model", plan.model, "model", workflow.model)
    agree("schedule", plan.schedule, "run/schedule", run.schedule)
    for key in ("global_batch", "micro_batch", "micro_batches"):
        agree(key, getattr(plan, key), f"run/{key}", getattr(run, key))
    planned: dict[str, tuple[str, tuple[PlannedStage, ...]]] = {}
    if plan.regions is None:
        planned[plan.region] = ("stages", plan.stages)
    else:
        for s, site in enumerate(plan.regions.sites):
            if site.trains:
                planned[site.name] = (f"regions/sites/{s}/stages", site.stages)
        if len(workflow.regions) > 1:
            agree("regions/sync", plan.regions.sync, "sync/inter_region", workflow.sync.inter_region)
            agree("regions/rounds", plan.regions.rounds, "sync/rounds", workflow.sync.rounds)
            if workflow.sync.inter_region == "asgd-ga":
                agree("regions/server", plan.regions.server, "sync/server", workflow.sync.server)
    agree(
        "regions/sites" if plan.regions is not None else "region",
        sorted(planned),
        "regions",
        sorted(region.name for region in workflow.regions),
    )
    for r, region in enumerate(workflow.regions):
        where, stages = planned[region.name]
        agree(where, len(stages), f"regions/{r}/functions", len(region.functions))
        for position, (stage, function) in enumerate(zip(stages, region.functions, strict=True)):
            key = _function_key(document, r, function.name)
            here = f"{where}/{position}"
            agree(f"{here}/index", stage.index, f"{key}/stage", function.stage)
            agree(f"{here}/blocks", list(stage.blocks), f"{key}/blocks", list(function.blocks))
            agree(f"{here}/tier_mb", stage.tier_mb, f"{key}/memory_mb", function.memory_mb)
            agree(f"{here}/replicas", stage.replicas, f"{key}/replicas", function.replicas)


# --- function packages -------------------------------------------------------------------------------


def _check_packages(context: _Build, document: dict[str, Any], workflow: Workflow) -> None:
    """Each function's package holds what its worker loads, as workflow.yaml describes it."""
    for r, region in enumerate(workflow.regions):
        tensors: dict[int, dict[str, tuple[tuple[int, ...], str, bool]]] = {}
        for function in region.functions:
            last = function.stage == region.stages - 1
            _check_package_files(context, workflow, function, last)
            _check_function_json(context, document, workflow, region, function)
            tensors[function.stage] = _check_stage_module(context, document, r, function)
            _check_weights(context, function, tensors[function.stage])
            if last:
                _check_loss(context, workflow, function)
        _check_shared(context, document, r, region, tensors)


def _check_package_files(context: _Build, workflow: Workflow, function: Function, last: bool) -> None:
    folder = context.root / function.package
    if not folder.is_dir():
        _fail(function.package, "(folder)", f"missing: the package of function {function.name!r}")
    needed = dict(_PACKAGE_FILES)
    if last:
        needed[f"{workflow.data.loss}.py"] = "the loss module, which the last stage runs"
    for package, modules in VENDORED_MODULES.items():
        for module in modules:
            needed[f"cloudless/{package}/{module}.py"] = "part of the vendored runtime the handler imports"
    for name, why in needed.items():
        if not (folder / name).is_file():
            path = f"{function.package}/{name}"
            _fail(path, "(file)", f"missing: {why}{_deleted(context, path)}")


def _deleted(context: _Build, path: str) -> str:
    return " (listed in cloudless-build.json: deleted after the compile; recompile)" if path in context.manifest else ""


def _check_function_json(
    context: _Build, document: dict[str, Any], workflow: Workflow, region: Region, function: Function
) -> None:
    """function.json names this function and region and holds workflow.yaml's workflow: the worker reads
    this copy, the controller workflow.yaml."""
    file = f"{function.package}/function.json"
    try:
        spec = json.loads((context.root / file).read_text())
    except ValueError as exc:
        _fail(file, "(top level)", f"not JSON: {exc}{context.note(file)}")
    if not isinstance(spec, dict):
        _fail(file, "(top level)", f"not an object{context.note(file)}")
    for key, name in (("function", function.name), ("region", region.name)):
        if spec.get(key) != name:
            found = _short(spec.get(key, _MISSING))
            _fail(file, key, f"{found}; expected {name!r}, whose package this is{context.note(file)}")
    copy = spec.get("workflow", _MISSING)
    try:
        typed = Workflow.from_json(copy)
    except (AttributeError, KeyError, TypeError, ValueError):
        ours, theirs = copy, document  # not a workflow: say where its document differs
    else:
        if typed == workflow:
            return
        ours, theirs = typed.to_json(), workflow.to_json()
    where, mine, expected = _first_difference(ours, theirs) or ("(top level)", copy, document)
    if context.culprit(file, "workflow.yaml") == file:
        _fail(
            file,
            f"workflow/{where}" if where != "(top level)" else "workflow",
            f"{_short(mine)}, but workflow.yaml has {_short(expected)}: the worker reads this copy, the controller "
            f"workflow.yaml{context.note(file)}",
        )
    _fail("workflow.yaml", where, f"{_short(expected)}, but the packages' function.json have {_short(mine)}{EDITED}")


def _module_constants(context: _Build, file: str, names: tuple[str, ...]) -> dict[str, Any]:
    """The literal values a generated module assigns to `names`, read with ast (the build's code is not
    run), once it defines class Stage."""
    try:
        tree = ast.parse((context.root / file).read_text(), filename=file)
    except (SyntaxError, ValueError, UnicodeDecodeError) as exc:
        _fail(file, "(top level)", f"not Python: {exc}{context.note(file)}")
    values: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            if node.targets[0].id in names:
                try:
                    values[node.targets[0].id] = ast.literal_eval(node.value)
                except ValueError:
                    _fail(file, node.targets[0].id, f"not a literal{context.note(file)}")
    if not any(isinstance(node, ast.ClassDef) and node.name == "Stage" for node in tree.body):
        _fail(file, "Stage", f"missing: the worker instantiates class Stage{context.note(file)}")
    for name in names:
        if name not in values:
            _fail(file, name, f"missing{context.note(file)}")
    return values


def _names(value: Any) -> tuple[str, ...] | None:
    if isinstance(value, tuple | list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    return None


def _check_stage_module(
    context: _Build, document: dict[str, Any], r: int, function: Function
) -> dict[str, tuple[tuple[int, ...], str, bool]]:
    """stage.py's INPUTS and OUTPUTS are the function's (the worker takes and sends those); its TENSORS
    (name: (shape, dtype, trainable)), which Stage() installs, are returned."""
    file = f"{function.package}/stage.py"
    constants = _module_constants(context, file, ("INPUTS", "OUTPUTS", "TENSORS"))
    key = _function_key(document, r, function.name)
    for name, expected in (("INPUTS", function.inputs), ("OUTPUTS", function.outputs)):
        found = _names(constants[name])
        if found is None:
            _fail(file, name, f"{_short(constants[name])} is not a tuple of names{context.note(file)}")
        if found != expected:
            workflow_key = f"{key}/{name.lower()}"
            if context.culprit(file, "workflow.yaml") == file:
                _fail(
                    file,
                    name,
                    f"{list(found)}, but workflow.yaml has {list(expected)} at {workflow_key}{context.note(file)}",
                )
            _fail("workflow.yaml", workflow_key, f"{list(expected)}, but stage.py's {name} are {list(found)}{EDITED}")
    tensors = constants["TENSORS"]
    well_formed = isinstance(tensors, dict) and all(
        isinstance(name, str)
        and isinstance(entry, tuple)
        and len(entry) == 3
        and isinstance(entry[0], tuple)
        and all(isinstance(n, int) and n >= 0 for n in entry[0])
        and isinstance(entry[1], str)
        and isinstance(entry[2], bool)
        for name, entry in tensors.items()
    )
    if not well_formed:
        _fail(file, "TENSORS", f"not {{name: (shape, dtype, trainable)}}{context.note(file)}")
    return tensors


def _check_weights(context: _Build, function: Function, tensors: dict[str, tuple[tuple[int, ...], str, bool]]) -> None:
    """weights.safetensors is whole (its header, and data to the last tensor's end) and holds exactly the
    tensors stage.py's TENSORS declares, with their shapes and dtypes: the worker loads it with
    load_state_dict(strict=True) into Stage(), which installs TENSORS. Only the header is read."""
    file = f"{function.package}/weights.safetensors"
    stage = f"{function.package}/stage.py"
    note = context.note(file)
    path = context.root / file
    size = path.stat().st_size
    with path.open("rb") as stream:
        head = stream.read(8)
        length = int.from_bytes(head, "little") if len(head) == 8 else -1
        if length < 0 or length > size - 8:
            _fail(file, "(header)", f"truncated or not safetensors: {size} bytes, header length {length}{note}")
        try:
            header = json.loads(stream.read(length))
        except (ValueError, UnicodeDecodeError) as exc:
            _fail(file, "(header)", f"not a safetensors header (JSON): {exc}{note}")
    if not isinstance(header, dict):
        _fail(file, "(header)", f"not a safetensors header (a JSON object){note}")
    found: dict[str, tuple[tuple[int, ...], str]] = {}
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, itemsize = _SAFETENSORS_DTYPES[entry["dtype"]]
            shape = tuple(int(n) for n in entry["shape"])
            first, stop = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError):
            _fail(file, name, f"not a safetensors entry {{dtype, shape, data_offsets}}: {_short(entry)}{note}")
        if not 0 <= first <= stop or stop - first != math.prod(shape) * itemsize:
            _fail(file, name, f"data_offsets {[first, stop]} do not hold a {dtype} tensor of shape {list(shape)}{note}")
        found[name] = (shape, dtype)
        end = max(end, stop)
    data = size - 8 - length
    if end != data:
        what = "truncated" if end > data else "longer than its header says"
        _fail(file, "(data)", f"{what}: the header describes {end} bytes of tensor data, the file holds {data}{note}")
    blamed = context.culprit(file, stage)
    for name, (shape, dtype, _) in tensors.items():
        if name not in found:
            if blamed == stage:
                _fail(stage, f"TENSORS/{name}", f"not in weights.safetensors{EDITED}")
            _fail(file, name, f"missing: stage.py's TENSORS declares it {list(shape)} {dtype}{note}")
        if found[name] != (shape, dtype):
            have = f"{list(found[name][0])} {found[name][1]}"
            if blamed == stage:
                _fail(stage, f"TENSORS/{name}", f"{list(shape)} {dtype}, but weights.safetensors has {have}{EDITED}")
            _fail(file, name, f"{have}, but stage.py's TENSORS declares {list(shape)} {dtype}{note}")
    for name in found:
        if name not in tensors:
            if blamed == stage:
                _fail(stage, "TENSORS", f"lacks {name!r}, which weights.safetensors holds{EDITED}")
            _fail(file, name, f"not a tensor of the stage (stage.py's TENSORS does not declare it){note}")


def _check_loss(context: _Build, workflow: Workflow, function: Function) -> None:
    """The loss module takes the last stage's outputs, then the targets: Stage()(*outputs, *targets)."""
    file = f"{function.package}/{workflow.data.loss}.py"
    constants = _module_constants(context, file, ("INPUTS",))
    inputs = _names(constants["INPUTS"])
    expected = len(function.outputs) + workflow.data.targets
    if inputs is None or len(inputs) != expected:
        if context.culprit(file, "workflow.yaml") == file:
            _fail(
                file,
                "INPUTS",
                f"{_short(constants['INPUTS'])}, but it takes the last stage's {len(function.outputs)} outputs and "
                f"data/targets {workflow.data.targets} targets{context.note(file)}",
            )
        _fail(
            "workflow.yaml",
            "data/targets",
            f"{workflow.data.targets}, but {file} takes {len(inputs or ())} tensors, the last stage sends "
            f"{len(function.outputs)}{EDITED}",
        )


def _check_shared(
    context: _Build,
    document: dict[str, Any],
    r: int,
    region: Region,
    tensors: dict[int, dict[str, tuple[tuple[int, ...], str, bool]]],
) -> None:
    """A tied parameter is a trainable tensor of every stage that lists it, and every stage holding it lists
    it: the stages that list it sum their gradients, and one left out would train its copy apart."""
    shared = {name for function in region.functions for name in function.shared_parameters}
    for function in region.functions:
        key = f"{_function_key(document, r, function.name)}/shared_parameters"
        held = {name for name, (_, _, trainable) in tensors[function.stage].items() if trainable}
        for name in function.shared_parameters:
            if name not in held:
                _fail(
                    "workflow.yaml",
                    key,
                    f"{name!r} is no trainable tensor of stage {function.stage} (its stage.py TENSORS)"
                    + context.was(key, list(function.shared_parameters)),
                )
        for name in sorted((shared & held) - set(function.shared_parameters)):
            _fail(
                "workflow.yaml",
                key,
                f"stage {function.stage} holds the tied parameter {name!r}, which other stages list, but does "
                f"not list it: its gradient would not be summed{context.was(key, list(function.shared_parameters))}",
            )


# --- digests -----------------------------------------------------------------------------------------


def _deployment_file(path: str) -> bool:
    """A file the deployment checks read (their messages explain an edit better than its digest)."""
    return path == "samconfig.toml" or (path.startswith("regions/") and path.count("/") == 2)


def _check_digests(context: _Build, workflow: Workflow, packages: bool, *, deployment: bool) -> None:
    """Every file cloudless-build.json lists has its digest, and every file a deployment or a run reads is
    listed: a package folder is deployed whole (its image copies every file in it). Python's own caches
    (__pycache__, written when a local run imports the vendored runtime) are not the build's. In two passes:
    the deployment files (`deployment`) after their own checks, every other file before them."""
    package_roots = tuple(f"{function.package}/" for _, function in workflow.functions())
    for path, digest in sorted(context.manifest.items()):
        if _deployment_file(path) != deployment or (not packages and path.startswith(package_roots)):
            continue
        actual = context.digest(path)
        if actual is None:
            _fail(path, "(file)", f"missing (listed in {BUILD_MARKER}): deleted after the compile; recompile")
        if actual != digest:
            _fail(path, "(digest)", f"differs from {BUILD_MARKER} (edited or corrupted after the compile; recompile)")
    read = [context.root / name for name in ("workflow.yaml", "plan.json", "samconfig.toml")]
    regions = context.root / "regions"
    if regions.is_dir():
        read += [p for p in regions.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    for file in sorted(read):
        relative = _relative(context.root, file)
        if file.is_file() and relative not in context.manifest and _deployment_file(relative) == deployment:
            inside = relative.startswith(package_roots) or "/functions/" in relative
            why = "a package folder is deployed whole: remove it, or recompile" if inside else "remove it, or recompile"
            _fail(relative, "(file)", f"not in {BUILD_MARKER}: {why}")
