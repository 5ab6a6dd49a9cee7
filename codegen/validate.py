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

The checks themselves live in cloudless.codegen.checks, one module per family of files; this module runs
them in that order and keeps the names other code imports.
"""

from __future__ import annotations

from pathlib import Path

from ..ir.files import load_workflow
from ..ir.workflow import Workflow
from .checks.base import EDITED, BuildCheckError, BuildContext, build_relative, fail
from .checks.digests import check_digests, check_no_secrets
from .checks.manifest import check_manifest, check_run
from .checks.openfaas import check_stack, stack_warnings
from .checks.packages import check_packages
from .checks.plan import check_plan
from .checks.quotas import quota_warnings
from .checks.sam import LAMBDA_MAX_TIMEOUT_S, LAMBDA_MEMORY_MB, check_samconfig, check_template
from .checks.state_machine import (
    DUMMY_ARN,
    LONGEST_ARN,
    MAX_DEFINITION_BYTES,
    check_definition,
    substitute_arns,
)
from .checks.storage import check_region_storage

__all__ = [
    "DUMMY_ARN",
    "EDITED",
    "LAMBDA_MAX_TIMEOUT_S",
    "LAMBDA_MEMORY_MB",
    "LONGEST_ARN",
    "MAX_DEFINITION_BYTES",
    "BuildCheckError",
    "check_build",
    "check_definition",
    "check_deployment",
    "deployment_warnings",
    "substitute_arns",
]


def check_build(build: Path, *, packages: bool = True) -> None:
    """Raise BuildCheckError at the first problem in the build folder `build`: what passes must run.

    With `packages=False` the function packages (handler folders, Dockerfiles) are not looked for, so the
    deployment files can be checked before the packages are written."""
    build = Path(build)
    if not build.is_dir():
        raise BuildCheckError(f"{build}: no such folder; expected a build folder written by cloudless-compile")
    context = BuildContext.open(build)
    document, workflow = check_manifest(build, context)
    check_run(context, document, workflow)
    check_plan(context, document, workflow)
    if packages:
        check_packages(context, document, workflow)
    check_digests(context, workflow, packages, deployment=False)
    _check_deployment(build, workflow, packages)
    check_digests(context, workflow, packages, deployment=True)


def check_deployment(build: Path, *, packages: bool = True) -> None:
    """Only the deployment files (workflow.yaml's schema, stack files, SAM templates, state machines,
    samconfig.toml, no secrets): for a folder that holds those but is no whole build."""
    build = Path(build)
    _check_deployment(build, check_manifest(build, None)[1], packages)


def _check_deployment(build: Path, workflow: Workflow, packages: bool) -> None:
    names = [region.name for region in workflow.regions]
    regions_dir = build / "regions"
    if regions_dir.is_dir():
        for folder in sorted(p for p in regions_dir.iterdir() if p.is_dir()):
            deployable = (folder / "stack.yaml").exists() or (folder / "template.yaml").exists()
            if folder.name not in names and deployable:
                fail(f"regions/{folder.name}", "(folder)", f"region {folder.name!r} is not in workflow.yaml")
    sam_regions = []
    for region in workflow.regions:
        folder = regions_dir / region.name
        stack, template = folder / "stack.yaml", folder / "template.yaml"
        if not stack.exists() and not template.exists():
            fail(f"regions/{region.name}", "(folder)", "neither stack.yaml nor template.yaml was generated")
        if stack.exists():
            check_stack(build, region, packages)
        if template.exists():
            sam_regions.append(region)
    if sam_regions or (build / "samconfig.toml").exists():
        deploy_regions = check_samconfig(build, workflow, [r.name for r in sam_regions])
        for region in sam_regions:
            check_template(build, workflow, region, deploy_regions[region.name], packages)
    if len(names) > 1:
        check_region_storage(build, workflow)
    check_no_secrets(build, names)


def deployment_warnings(build: Path) -> list[str]:
    """What a build's deployment files allow, but a default platform would refuse (one line each, the file
    first): OpenFaaS images without a registry (faas-cli up fails at the push) and stacks beyond OpenFaaS CE's
    limits (they deploy on OpenFaaS Pro only), requests above a small cluster; SAM functions above a new AWS
    account's memory quota, iterations above its concurrency. For a build that passed check_build."""
    regions = Path(build) / "regions"
    stacks = sorted(regions.glob("*/stack.yaml")) if regions.is_dir() else []
    files = sorted([*stacks, *regions.glob("*/template.yaml")]) if regions.is_dir() else []
    texts = {build_relative(Path(build), path): path.read_text() for path in files}
    workflow = load_workflow(Path(build) / "workflow.yaml") if texts else None
    stack_texts = {path: text for path, text in texts.items() if path.endswith("/stack.yaml")}
    return stack_warnings(stack_texts) + quota_warnings(texts, workflow)
