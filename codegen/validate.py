"""Offline checks of a build folder: the manifest, the OpenFaaS stack files, the SAM templates and their
state machines, and samconfig.toml.

Neither faas-cli nor the clouds are reachable here, and faas-cli and sam ignore keys they do not know, so
mistakes would surface only at deploy time. `check_build` raises `BuildCheckError` at the first problem,
naming the file (relative to the build folder) and the key, for example
`regions/aws-us-east-1/stack.yaml: key functions/mlp-digits-s0/limits/memory: ...`.

It runs the project's own strict schema for stack files, the platform limits the linters do not know
(Lambda memory and timeout, Step Functions Map concurrency and definition size), statelint on each state
machine graph and cfn-lint (errors only) on each template.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any, NoReturn

import jsonschema
import yaml

from cloudless.codegen.platforms import (
    LAMBDA_INVOKE,
    LAMBDA_RETRY_ERRORS,
    MAX_MAP_CONCURRENCY,
    aws_region,
    logical_id,
)
from cloudless.ir.files import check_workflow
from cloudless.ir.schema import SchemaError, load_schema
from cloudless.ir.workflow import Region, Workflow

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
    raise BuildCheckError(f"{file}: key {key}: {message}")


def check_build(build: Path, *, packages: bool = True) -> None:
    """Raise BuildCheckError at the first problem in the build folder `build`.

    With `packages=False` the function packages (handler folders, Dockerfiles) are not looked for, so the
    deployment files can be checked before the packages are written."""
    build = Path(build)
    workflow = _check_manifest(build)
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
    _check_no_secrets(build, names)


def _relative(build: Path, path: Path) -> str:
    return path.relative_to(build).as_posix()


def _load_yaml(build: Path, path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        # Short-form intrinsics (!Ref) fail here too: the project writes them in long form.
        _fail(_relative(build, path), "(top level)", f"not plain YAML: {exc}")


def _check_manifest(build: Path) -> Workflow:
    path = build / "workflow.yaml"
    if not path.exists():
        _fail("workflow.yaml", "(file)", "missing")
    document = _load_yaml(build, path)
    try:
        check_workflow(document, "workflow.yaml")
    except BuildCheckError:
        raise
    except SchemaError as exc:
        raise BuildCheckError(str(exc)) from exc
    return Workflow.from_json(document)


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


def _check_samconfig(build: Path, workflow: Workflow, sam_regions: list[str]) -> dict[str, str]:
    """Check samconfig.toml; return each SAM region's AWS region (what cfn-lint checks the template for)."""
    from cfnlint.helpers import REGIONS

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
        if deploy["region"] not in REGIONS:
            _fail(file, f"{name}.deploy.parameters.region", f"{deploy['region']!r} is not an AWS region")
        if deploy["region"] != aws_region(name):
            _fail(file, f"{name}.deploy.parameters.region", f"{deploy['region']!r}, but the region is {name!r}")
        deploy_regions[name] = deploy["region"]
    return deploy_regions


def _walk_refs(node: Any, where: list[str]) -> list[tuple[str, str]]:
    """(key path, target) of every Ref and Fn::GetAtt in a template fragment."""
    found: list[tuple[str, str]] = []
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "Ref" and isinstance(value, str):
                found.append(("/".join([*where, key]), value))
            elif key == "Fn::GetAtt" and isinstance(value, list) and value and isinstance(value[0], str):
                found.append(("/".join([*where, key]), value[0]))
            else:
                found.extend(_walk_refs(value, [*where, str(key)]))
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found.extend(_walk_refs(value, [*where, str(index)]))
    return found


def _check_template(
    build: Path, workflow: Workflow, region: Region, deploy_region: str, packages: bool
) -> None:
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
    for function in region.functions:
        logical = logical_id(function.name)
        if resources.get(logical, {}).get("Type") != "AWS::Serverless::Function":
            _fail(file, f"Resources/{logical}", f"no AWS::Serverless::Function for {function.name!r}")
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
                _fail(file, f"{key}/Properties/Policies/{policy_name}", "an S3 policy must name the bucket parameter")
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


def _check_state_machine(
    build: Path, template_path: Path, name: str, resource: dict[str, Any], region: Region
) -> None:
    file = _relative(build, template_path)
    key = f"Resources/{name}/Properties"
    properties = resource.get("Properties", {})
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
            concurrency = state.get("MaxConcurrency")
            if not isinstance(concurrency, int) or not 1 <= concurrency <= MAX_MAP_CONCURRENCY:
                _fail(
                    file,
                    f"{key}/MaxConcurrency",
                    f"{concurrency!r}; an inline Map runs at most {MAX_MAP_CONCURRENCY} iterations at once",
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
