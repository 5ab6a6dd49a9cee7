"""Deployment files for the serverless platforms: OpenFaaS stack files and SAM templates with state machines.

Per region, `render_region` writes
- `regions/<region>/stack.yaml` (target "openfaas"): one OpenFaaS function per pipeline stage, built from the
  `python3-http-debian` template, scaled to the stage's replicas; each image is `<registry>/<function>:<tag>`,
  the tag derived from the package's content (codegen/images.py);
- `regions/<region>/template.yaml` and `regions/<region>/statemachine.asl.json` (target "sam"): the run's S3
  bucket, one image-based Lambda function per stage with a deterministic name (`lambda_function_name`), and one
  Step Functions state machine running the region's iteration loop; the stack's outputs name them all;
and `render_samconfig` writes the build root's `samconfig.toml`, one config-env per region.

An iteration runs all of a region's (stage, replica) workers at once, as one Map state: inline up to
INLINE_MAP_MAX_CONCURRENCY workers, a Distributed Map (one child execution per worker) above, up to
DISTRIBUTED_MAP_MAX_CONCURRENCY; the planner keeps a SAM build's plans within that (ir/catalog.py,
platform_limits), and within OpenFaaS CE's replica and function limits when the stack files are built.

The function packages themselves (handler, Dockerfile, stage code) are written elsewhere; these files only
name their folders. Everything is rendered from jinja templates in a fixed order, so the same manifest gives
byte-identical files. No credentials appear anywhere: OpenFaaS functions read the `cloudless-storage` secret
(and accept only requests carrying the `cloudless-token` secret's value), Lambda functions get an IAM role
that may only get, put and delete objects under the run's prefix of the run's bucket (`S3_OBJECT_ACTIONS`).
The bucket is a resource of the SAM stack, named by CloudFormation: no fixed, guessable global name.
"""

from __future__ import annotations

import hashlib
import json
import posixpath
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from cloudless.codegen.images import OPENFAAS_BUILD_ARGS, image_name, image_tag
from cloudless.ir.catalog import AWS_REGION_PREFIX, DISTRIBUTED_MAP_MAX_CONCURRENCY, INLINE_MAP_MAX_CONCURRENCY
from cloudless.ir.protocol import S3_ENDPOINT_ENV, STORAGE_ENV, STORAGE_SECRET, TOKEN_HEADER, TOKEN_SECRET
from cloudless.ir.workflow import Function, Region, Workflow

TARGETS = frozenset({"openfaas", "sam"})

#: The OpenFaaS template: Debian-based because torch publishes no musl (Alpine) wheels.
OPENFAAS_TEMPLATE = "python3-http-debian"
OPENFAAS_TEMPLATE_SOURCE = "https://github.com/openfaas/python-flask-template"
OPENFAAS_GATEWAY = "http://127.0.0.1:8080"
#: read/write timeouts of the function's HTTP server exceed the execution timeout by this, so that a
#: handler finishing just in time can still send its response.
TIMEOUT_MARGIN_S = 10

#: What a Lambda function may do with the objects under the run's prefix, and nothing more: the worker's
#: storage requests (runtimes/storage.py, S3Channel) are GetObject (`try_get`), PutObject (`put`, and `claim`,
#: a conditional PutObject with If-None-Match, which needs no other right) and DeleteObject (`delete`).
#: `delete_prefix` (ListObjectsV2, DeleteObjects) is the controller's, which runs with the user's credentials.
#: The role also gets s3:ListBucket on the bucket, restricted to keys under the prefix: without it S3 answers
#: a GetObject of a missing key with 403 (AccessDenied) instead of 404 (NoSuchKey), and a worker polls for
#: keys that are not written yet.
S3_OBJECT_ACTIONS = ("s3:GetObject", "s3:PutObject", "s3:DeleteObject")

#: Lambda's limit on a function name (letters, digits, '-' and '_'), and Step Functions' on a state machine's
LAMBDA_NAME_LIMIT = 64
STATE_MACHINE_NAME_LIMIT = 80
#: the SAM template's logical id of the run's bucket
BUCKET_RESOURCE = "RunBucket"
LAMBDA_INVOKE = "arn:aws:states:::lambda:invoke"
#: The transient Lambda errors AWS recommends retrying.
LAMBDA_RETRY_ERRORS = (
    "Lambda.ServiceException",
    "Lambda.AWSLambdaException",
    "Lambda.SdkClientException",
    "Lambda.ClientExecutionTimeoutException",
    "Lambda.TooManyRequestsException",
)
#: A Standard workflow's execution history holds at most 25,000 events; an execution that would exceed it
#: fails. One worker's invocation costs about 7 events (Map iteration started/succeeded, task state
#: entered/exited, task scheduled/started/succeeded), 10 with one retry; one iteration adds about 12 more.
#: Each execution therefore runs at most `iterations_per_execution(workers)` iterations and hands back
#: where it stopped. A Distributed Map's workers are child executions with histories of their own: the
#: parent's iteration then costs EVENTS_PER_DISTRIBUTED_MAP events (map state and map run started, succeeded)
#: whatever the workers.
MAX_HISTORY_EVENTS = 25_000
HISTORY_EVENTS_RESERVED = 1_000
EVENTS_PER_WORKER = 10
EVENTS_PER_ITERATION = 12
EVENTS_PER_DISTRIBUTED_MAP = 10

_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).resolve().parent / "templates"),
    undefined=jinja2.StrictUndefined,
    keep_trailing_newline=True,
    trim_blocks=True,
    lstrip_blocks=True,
    autoescape=False,
)
# JSON scalars are valid YAML and TOML basic strings too: one quoting filter for all three formats.
_ENV.filters["q"] = lambda value: json.dumps(value)


@dataclass(frozen=True)
class Worker:
    """One (stage, replica) instance the state machine invokes every iteration."""

    function: str
    logical_id: str
    stage: int
    replica: int


def aws_region(region_name: str) -> str:
    """The AWS region of a catalog region: the catalog names AWS regions `aws-<aws region>` (and rejects an
    aws region named otherwise, see cloudless.ir.catalog.aws_region_of).

    Rule: a name starting with `aws-` loses that prefix (aws-us-east-1 -> us-east-1); any other name is
    kept as it is (it is not an AWS region, and tools that need one will say so)."""
    return region_name.removeprefix(AWS_REGION_PREFIX)


def logical_id(function_name: str) -> str:
    """A CloudFormation logical id (alphanumeric) for a function: mlp-digits-s0 -> MlpDigitsS0Function."""
    parts = re.split(r"[^A-Za-z0-9]+", function_name)
    return "".join(part[:1].upper() + part[1:] for part in parts if part) + "Function"


def distributed(workers: int) -> bool:
    """Whether an iteration of this many workers needs a Distributed Map (more than an inline Map runs at
    once); ValueError beyond what a Distributed Map runs at once (the planner never plans that)."""
    if workers > DISTRIBUTED_MAP_MAX_CONCURRENCY:
        raise ValueError(
            f"{workers} (stage, replica) workers; a Step Functions Distributed Map runs at most "
            f"{DISTRIBUTED_MAP_MAX_CONCURRENCY} at once, and all of an iteration's workers must run together"
        )
    return workers > INLINE_MAP_MAX_CONCURRENCY


def iterations_per_execution(workers: int) -> int:
    """How many iterations one state machine execution may run before its history could overflow."""
    budget = MAX_HISTORY_EVENTS - HISTORY_EVENTS_RESERVED
    per_iteration = EVENTS_PER_DISTRIBUTED_MAP if distributed(workers) else EVENTS_PER_WORKER * workers
    return max(1, budget // (per_iteration + EVENTS_PER_ITERATION))


def _bounded_name(name: str, limit: int) -> str:
    """`name`, or when longer than `limit` its start and 8 hex digits of its SHA-256 (still unique)."""
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: limit - 9].rstrip('-_')}-{digest}"


def lambda_function_name(function_name: str, region: str) -> str:
    """The deployed Lambda function of a stage's function in a region: `<function>-<region>` (the run, the
    stage and the catalog region: mlp-digits-s0-aws-us-east-1), at most LAMBDA_NAME_LIMIT characters."""
    return _bounded_name(f"{function_name}-{region}", LAMBDA_NAME_LIMIT)


def state_machine_name(workflow: Workflow, region: str) -> str:
    """The region's state machine: `<run>-<region>`, at most STATE_MACHINE_NAME_LIMIT characters."""
    return _bounded_name(f"{workflow.run.name}-{region}", STATE_MACHINE_NAME_LIMIT)


def stack_name(workflow: Workflow, region: str) -> str:
    """The CloudFormation stack of a region's deployment."""
    return f"{workflow.run.name}-{region}"


def render_region(
    workflow: Workflow,
    region: str,
    targets: set[str],
    *,
    registry: str | None = None,
    packages: Mapping[str, bytes] | None = None,
) -> dict[str, str]:
    """The deployment files of one region for the given targets, as path under the build root -> text.

    `registry` prefixes the OpenFaaS images (`<registry>/<function>:<tag>`; None: no prefix, and faas-cli
    cannot push them). `packages` holds the build's files, of which each function package's content tags
    its image (codegen.images.image_tag); without them (a render of the deployment files alone) the tag is
    derived from the function's description in the workflow instead."""
    unknown = set(targets) - TARGETS
    if unknown:
        raise ValueError(f"unknown targets {sorted(unknown)}; known: {sorted(TARGETS)}")
    entry = _region(workflow, region)
    tags = {function.name: _tag(workflow, entry, function, packages) for function in entry.functions}
    files: dict[str, str] = {}
    if "openfaas" in targets:
        files[f"regions/{region}/stack.yaml"] = _render_stack(workflow, entry, tags, registry)
    if "sam" in targets:
        files[f"regions/{region}/template.yaml"] = _render_template(workflow, entry, tags)
        files[f"regions/{region}/statemachine.asl.json"] = _render_state_machine(workflow, entry)
    return dict(sorted(files.items()))


def _tag(workflow: Workflow, entry: Region, function: Function, packages: Mapping[str, bytes] | None) -> str:
    if packages is not None:
        return image_tag(packages, function.package)
    described = {"function": function.to_json(), "region": entry.name, "workflow": workflow.to_json()}
    document = json.dumps(described, sort_keys=True).encode()
    return image_tag({f"{function.package}/function.json": document}, function.package)


def render_samconfig(workflow: Workflow) -> str:
    """The build root's samconfig.toml: one config-env per region, named like the region."""
    regions = []
    for entry in workflow.regions:
        if entry.provider != "aws":
            continue  # SAM deploys to AWS only
        name = entry.name
        regions.append(
            {
                "name": name,
                "stack_name": stack_name(workflow, name),
                "aws_region": aws_region(name),
                "template_file": f"regions/{name}/template.yaml",
                # One build folder per region: `sam build` empties its build folder first.
                "build_dir": f".aws-sam/{name}/build",
            }
        )
    return _ENV.get_template("samconfig.toml.j2").render(run=workflow.run.name, regions=regions)


def workers(workflow: Workflow, region: str) -> list[Worker]:
    """Every (stage, replica) of a region, by stage then replica: what one iteration invokes."""
    return [
        Worker(function.name, logical_id(function.name), function.stage, replica)
        for function in _region(workflow, region).functions
        for replica in range(function.replicas)
    ]


def _region(workflow: Workflow, region: str) -> Region:
    try:
        return workflow.region(region)
    except KeyError as exc:
        raise ValueError(exc.args[0]) from None


def _relative(package: str, region: str) -> str:
    """A package folder (relative to the build root) as seen from the region's folder."""
    return posixpath.relpath(package, f"regions/{region}")


def _storage_url(workflow: Workflow) -> str:
    return f"s3://{workflow.storage.bucket}/{workflow.storage.prefix}"


def _render_stack(workflow: Workflow, entry: Region, tags: Mapping[str, str], registry: str | None) -> str:
    functions = []
    for function in entry.functions:
        handler = _relative(function.package, entry.name)
        timeout = function.timeout_s
        functions.append(
            {
                "name": function.name,
                "stage": function.stage,
                "handler": handler if handler.startswith("../") else f"./{handler}",
                "image": image_name(function.name, tags[function.name], registry),
                "exec_timeout": f"{timeout}s",
                "io_timeout": f"{timeout + TIMEOUT_MARGIN_S}s",
                "memory": f"{function.memory_mb}Mi",
                "cpu": f"{function.cpu_millis}m",
                "replicas": str(function.replicas),
            }
        )
    return _ENV.get_template("stack.yaml.j2").render(
        run=workflow.run.name,
        region=entry.name,
        gateway=OPENFAAS_GATEWAY,
        template=OPENFAAS_TEMPLATE,
        template_source=OPENFAAS_TEMPLATE_SOURCE,
        build_args=OPENFAAS_BUILD_ARGS,
        registry=registry,
        storage=_storage_url(workflow),
        secret=STORAGE_SECRET,
        token_secret=TOKEN_SECRET,
        token_header=TOKEN_HEADER,
        storage_env=STORAGE_ENV,
        s3_endpoint_env=S3_ENDPOINT_ENV,
        functions=functions,
    )


def _sam_functions(entry: Region, tags: Mapping[str, str]) -> list[dict[str, Any]]:
    functions = []
    seen: dict[str, str] = {}
    deployed: dict[str, str] = {}
    for function in entry.functions:
        logical = logical_id(function.name)
        if logical in seen:
            raise ValueError(f"functions {seen[logical]!r} and {function.name!r} both map to logical id {logical}")
        seen[logical] = function.name
        name = lambda_function_name(function.name, entry.name)
        if name in deployed:
            raise ValueError(f"functions {deployed[name]!r} and {function.name!r} both map to Lambda function {name}")
        deployed[name] = function.name
        functions.append(
            {
                "name": function.name,
                "function_name": name,
                "logical": logical,
                "stage": function.stage,
                "memory_mb": function.memory_mb,
                "timeout_s": function.timeout_s,
                "context": _relative(function.package, entry.name),
                "tag": tags[function.name],
            }
        )
    return functions


def object_prefix(workflow: Workflow) -> str:
    """The key prefix of every object the run's functions use: the storage prefix, as S3Channel joins it
    to a key (`<prefix>/<key>`; empty when there is no prefix)."""
    prefix = workflow.storage.prefix.strip("/")
    return f"{prefix}/" if prefix else ""


def _render_template(workflow: Workflow, entry: Region, tags: Mapping[str, str]) -> str:
    prefix = object_prefix(workflow)
    machine = state_machine_name(workflow, entry.name)
    states_arn = "arn:${AWS::Partition}:states:${AWS::Region}:${AWS::AccountId}"
    return _ENV.get_template("template.yaml.j2").render(
        run=workflow.run.name,
        region=entry.name,
        bucket=BUCKET_RESOURCE,
        storage_sub=f"s3://${{{BUCKET_RESOURCE}}}/" + workflow.storage.prefix,
        object_actions=S3_OBJECT_ACTIONS,
        object_prefix=prefix,
        object_arn=f"${{{BUCKET_RESOURCE}.Arn}}/" + prefix + "*",
        storage_env=STORAGE_ENV,
        functions=_sam_functions(entry, tags),
        machine_name=machine,
        distributed=distributed(len(workers(workflow, entry.name))),
        machine_arn=f"{states_arn}:stateMachine:{machine}",
        child_executions_arn=f"{states_arn}:execution:{machine}/*",
    )


def _render_state_machine(workflow: Workflow, entry: Region) -> str:
    region_workers = workers(workflow, entry.name)
    chunk = iterations_per_execution(len(region_workers))
    items = [
        json.dumps({"function": f"${{{w.logical_id}Arn}}", "stage": w.stage, "replica": w.replica})
        for w in region_workers
    ]
    return _ENV.get_template("statemachine.asl.json.j2").render(
        run=workflow.run.name,
        region=entry.name,
        iterations=workflow.run.iterations,
        chunk=chunk,
        workers=items,
        concurrency=len(region_workers),
        distributed=distributed(len(region_workers)),
        retry_errors=json.dumps(list(LAMBDA_RETRY_ERRORS)),
        invoke=LAMBDA_INVOKE,
    )
