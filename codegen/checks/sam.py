"""The SAM side of a deployment: samconfig.toml, each region's template.yaml (its references, Lambda
functions, bucket and outputs) and cfn-lint. The state machines the templates declare are checked by
cloudless.codegen.checks.state_machine."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

from ...ir.catalog import AWS_REGIONS
from ...ir.deployment import LAMBDA_NAME_LIMIT
from ...ir.workflow import Region, Workflow
from ..platforms import aws_region, logical_id
from .base import AWS_NAME, build_relative, fail, load_yaml
from .state_machine import check_state_machine

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


#: Lambda's limits (https://docs.aws.amazon.com/lambda/latest/dg/gettingstarted-limits.html).
LAMBDA_MEMORY_MB = (128, 10240)
LAMBDA_MAX_TIMEOUT_S = 900
#: a name Fn::Sub substitutes: ${Resource}, ${Resource.Attribute} or ${AWS::Pseudo} (not ${!Literal})
_SUB_NAME = re.compile(r"\$\{([A-Za-z0-9_:]+)(?:\.[A-Za-z0-9_.]+)?\}")


def check_samconfig(build: Path, workflow: Workflow, sam_regions: list[str]) -> dict[str, str]:
    """Check samconfig.toml; return each SAM region's AWS region (what cfn-lint checks the template for)."""
    file = "samconfig.toml"
    path = build / file
    if not path.exists():
        fail(file, "(file)", f"missing, but regions {sam_regions} have SAM templates")
    try:
        config = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        fail(file, "(top level)", f"not TOML: {exc}")
    if config.get("version") != 0.1:
        fail(file, "version", f"{config.get('version')!r}; sam reads version = 0.1")
    regions = {region.name for region in workflow.regions}
    for env in config:
        if env != "version" and env not in regions:
            fail(file, env, f"config-env {env!r} is not a region of workflow.yaml")
    deploy_regions = {}
    for name in sam_regions:
        if name not in config:
            fail(file, name, "missing: every region with a template.yaml needs its config-env")
        build_template = config[name].get("build", {}).get("parameters", {}).get("template_file")
        if build_template != f"regions/{name}/template.yaml":
            fail(file, f"{name}.build.parameters.template_file", f"{build_template!r}; expected the region's template")
        deploy = config[name].get("deploy", {}).get("parameters")
        if not isinstance(deploy, dict):
            fail(file, f"{name}.deploy.parameters", "missing")
        for needed in ("stack_name", "region", "template_file", "capabilities"):
            if not isinstance(deploy.get(needed), str) or not deploy[needed]:
                fail(file, f"{name}.deploy.parameters.{needed}", "missing or not a string")
        if deploy["region"] not in AWS_REGIONS:
            fail(file, f"{name}.deploy.parameters.region", f"{deploy['region']!r} is not an AWS region")
        if deploy["region"] != aws_region(name):
            fail(file, f"{name}.deploy.parameters.region", f"{deploy['region']!r}, but the region is {name!r}")
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


def check_template(build: Path, workflow: Workflow, region: Region, deploy_region: str, packages: bool) -> None:
    path = build / "regions" / region.name / "template.yaml"
    file = build_relative(build, path)
    template = load_yaml(build, path)
    if not isinstance(template, dict) or not isinstance(template.get("Resources"), dict):
        fail(file, "Resources", "missing")
    if template.get("Transform") != "AWS::Serverless-2016-10-31":
        fail(file, "Transform", "the SAM transform AWS::Serverless-2016-10-31 is required")
    resources: dict[str, Any] = template["Resources"]
    targets = set(resources) | set(template.get("Parameters", {}))
    for key, target in _walk_refs(resources, ["Resources"]) + _walk_refs(template.get("Outputs", {}), ["Outputs"]):
        if target not in targets and not target.startswith("AWS::"):
            fail(file, key, f"{target!r} is neither a resource nor a parameter")
    outputs = template.get("Outputs", {})
    names: dict[str, str] = {}
    for function in region.functions:
        logical = logical_id(function.name)
        if resources.get(logical, {}).get("Type") != "AWS::Serverless::Function":
            fail(file, f"Resources/{logical}", f"no AWS::Serverless::Function for {function.name!r}")
        # a name of its own, which the stack exports: the controller invokes the functions by name
        key = f"Resources/{logical}/Properties/FunctionName"
        name = resources[logical].get("Properties", {}).get("FunctionName")
        if not isinstance(name, str) or not AWS_NAME.fullmatch(name) or len(name) > LAMBDA_NAME_LIMIT:
            fail(file, key, f"{name!r}; Lambda takes letters, digits, '-' and '_', at most {LAMBDA_NAME_LIMIT}")
        if name in names:
            fail(file, key, f"{name!r} is also the name of {names[name]}")
        names[name] = logical
        output = outputs.get(f"{logical}Name", {})
        if output.get("Value") != {"Ref": logical} or "Export" not in output:
            fail(file, f"Outputs/{logical}Name", f"missing: the stack exports each function's name (Ref {logical})")
    buckets = [n for n, r in resources.items() if isinstance(r, dict) and r.get("Type") == "AWS::S3::Bucket"]
    for bucket in buckets:
        if "BucketName" in resources[bucket].get("Properties", {}):
            # S3 bucket names are global: a fixed one can be guessed, and taken first, by anyone
            fail(file, f"Resources/{bucket}/Properties/BucketName", "the run's bucket is named by CloudFormation")
    if len(buckets) != 1 or outputs.get("BucketName", {}).get("Value") != {"Ref": buckets[0]}:
        fail(file, "Outputs/BucketName", "expected the run's bucket, one AWS::S3::Bucket of the stack, as output")
    machines = []
    for name, resource in resources.items():
        kind = resource.get("Type") if isinstance(resource, dict) else None
        if kind == "AWS::Serverless::Function":
            _check_function(build, path, name, resource, packages)
        elif kind == "AWS::Serverless::StateMachine":
            machines.append(name)
            check_state_machine(build, path, name, resource, region)
    if not machines:
        fail(file, "Resources", "no AWS::Serverless::StateMachine")
    _cfn_lint(file, path.read_text(), deploy_region)


def _check_function(build: Path, path: Path, name: str, resource: dict[str, Any], packages: bool) -> None:
    file = build_relative(build, path)
    key = f"Resources/{name}"
    properties = resource.get("Properties", {})
    if properties.get("PackageType") != "Image":
        # torch does not fit the 250 MB limit of a zip package.
        fail(file, f"{key}/Properties/PackageType", f"{properties.get('PackageType')!r}; expected Image")
    memory = properties.get("MemorySize")
    low, high = LAMBDA_MEMORY_MB
    if not isinstance(memory, int) or not low <= memory <= high:
        fail(file, f"{key}/Properties/MemorySize", f"{memory!r}; Lambda allows {low} to {high} MB")
    timeout = properties.get("Timeout")
    if not isinstance(timeout, int) or not 1 <= timeout <= LAMBDA_MAX_TIMEOUT_S:
        fail(file, f"{key}/Properties/Timeout", f"{timeout!r}; Lambda allows 1 to {LAMBDA_MAX_TIMEOUT_S} s")
    if not properties.get("ImageConfig", {}).get("Command"):
        fail(file, f"{key}/Properties/ImageConfig/Command", "missing")
    for policy in properties.get("Policies", []):
        for policy_name, arguments in policy.items() if isinstance(policy, dict) else []:
            bucket = arguments.get("BucketName") if isinstance(arguments, dict) else None
            if policy_name.startswith("S3") and not (isinstance(bucket, dict) and "Ref" in bucket):
                fail(file, f"{key}/Properties/Policies/{policy_name}", "an S3 policy must name the run's bucket (Ref)")
    metadata = resource.get("Metadata", {})
    for needed in ("Dockerfile", "DockerContext", "DockerTag"):
        if not isinstance(metadata.get(needed), str):
            fail(file, f"{key}/Metadata/{needed}", "missing: sam build needs it to build the image")
    if packages:
        context = path.parent / metadata["DockerContext"]
        if not context.is_dir():
            fail(file, f"{key}/Metadata/DockerContext", f"no folder {metadata['DockerContext']!r}")
        if not (context / metadata["Dockerfile"]).is_file():
            fail(file, f"{key}/Metadata/Dockerfile", f"no {metadata['Dockerfile']} in {metadata['DockerContext']!r}")


def _cfn_lint(file: str, text: str, deploy_region: str) -> None:
    import cfnlint.api

    # Errors only: warnings (deprecations, best practices) depend on the date and are not failures.
    errors = [m for m in cfnlint.api.lint(text, regions=[deploy_region]) if m.rule.id.startswith("E")]
    if errors:
        match = errors[0]
        key = "/".join(str(p) for p in (match.path or [])) or f"line {match.linenumber}"
        fail(file, key, f"cfn-lint {match.rule.id}: {match.message}")
