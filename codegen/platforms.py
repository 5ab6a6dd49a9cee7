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

import json
import posixpath
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2

from ..ir.catalog import AWS_REGION_PREFIX, DISTRIBUTED_MAP_MAX_CONCURRENCY, INLINE_MAP_MAX_CONCURRENCY
from ..ir.deployment import (
    CARRIED_FIELDS,
    EXECUTION_FIELDS,
    ROUND_FIELDS,
    RUN_STOPPED_ERROR,
    bounded_name,
    lambda_function_name,
    logical_id,
    peer_condition,
    peer_parameter,
)
from ..ir.protocol import PEERS_ENV, S3_ENDPOINT_ENV, STORAGE_ENV, STORAGE_SECRET, TOKEN_HEADER, TOKEN_SECRET
from ..ir.workflow import Function, Region, Workflow
from .images import OPENFAAS_BUILD_ARGS, image_name, image_tag

TARGETS = frozenset({"openfaas", "sam"})

#: The OpenFaaS template: Debian-based because torch publishes no musl (Alpine) wheels.
OPENFAAS_TEMPLATE = "python3-http-debian"
OPENFAAS_TEMPLATE_SOURCE = "https://github.com/openfaas/python-flask-template"
OPENFAAS_GATEWAY = "http://127.0.0.1:8080"
#: read/write timeouts of the function's HTTP server exceed the execution timeout by this, so that a
#: handler finishing just in time can still send its response.
TIMEOUT_MARGIN_S = 10

#: What a Lambda function may do with the objects under the run's prefix, and nothing more: the worker's
#: storage requests (runtimes/storage/channels.py, S3Channel) are GetObject (`try_get`), PutObject (`put`, and `claim`,
#: a conditional PutObject with If-None-Match, which needs no other right) and DeleteObject (`delete`).
#: `delete_prefix` (ListObjectsV2, DeleteObjects) is the controller's, which runs with the user's credentials.
#: The role also gets s3:ListBucket on the bucket (and on the peers' buckets), with no s3:prefix condition: S3
#: answers a GetObject of a missing key with 404 (NoSuchKey) only to a caller holding s3:ListBucket on the
#: bucket, 403 (AccessDenied) to any other (GetObject's documented permissions), and a worker polls for keys
#: that are not written yet. AWS documents no s3:prefix for that check, so a prefix-scoped grant may turn
#: "not written yet" into 403; the buckets are the run's own, and listing them shows key names only.
S3_OBJECT_ACTIONS = ("s3:GetObject", "s3:PutObject", "s3:DeleteObject")

#: Step Functions' limit on a state machine's name (Lambda's on a function's: ir/deployment.py)
STATE_MACHINE_NAME_LIMIT = 80
#: the SAM template's logical id of the run's bucket
BUCKET_RESOURCE = "RunBucket"
#: an S3 bucket name's longest form
BUCKET_NAME_LIMIT = 63
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
#: fails. One worker's invocation costs about 11 events (Map iteration started/succeeded, task state
#: entered/exited, task scheduled/started/succeeded, the result's check and pass), 14 with one retry; one
#: round (every worker invoked once for a range of iterations) adds about 18 more. Each execution therefore
#: runs at most `rounds_per_execution(workers)` rounds and hands back where it stopped. A Distributed Map's
#: workers are child executions with histories of their own: the parent's round then costs
#: EVENTS_PER_DISTRIBUTED_MAP events (map state and map run started, succeeded) whatever the workers.
MAX_HISTORY_EVENTS = 25_000
HISTORY_EVENTS_RESERVED = 1_000
EVENTS_PER_WORKER = 14
EVENTS_PER_ROUND = 18
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


def distributed(workers: int) -> bool:
    """Whether an iteration of this many workers needs a Distributed Map (more than an inline Map runs at
    once); ValueError beyond what a Distributed Map runs at once (the planner never plans that)."""
    if workers > DISTRIBUTED_MAP_MAX_CONCURRENCY:
        raise ValueError(
            f"{workers} (stage, replica) workers; a Step Functions Distributed Map runs at most "
            f"{DISTRIBUTED_MAP_MAX_CONCURRENCY} at once, and all of an iteration's workers must run together"
        )
    return workers > INLINE_MAP_MAX_CONCURRENCY


def rounds_per_execution(workers: int) -> int:
    """How many rounds (every worker invoked once) one execution may run before its history could overflow."""
    budget = MAX_HISTORY_EVENTS - HISTORY_EVENTS_RESERVED
    per_round = EVENTS_PER_DISTRIBUTED_MAP if distributed(workers) else EVENTS_PER_WORKER * workers
    return max(1, budget // (per_round + EVENTS_PER_ROUND))


#: the share of an invocation's time limit its range of iterations is planned to take (the predicted
#: iteration time may be off by a busy profile; a range cut by the time limit is continued, not lost)
RANGE_SHARE_OF_TIME_LIMIT = 0.25


def iterations_per_invocation(iteration_s: float | None, time_limit_s: float, checkpoint_every: int) -> int:
    """How many iterations one invocation of every worker runs in a deployed round: as many as take
    RANGE_SHARE_OF_TIME_LIMIT of the time limit at the predicted `iteration_s`, at most `checkpoint_every`
    (a failed invocation replays from the last checkpoint), at least 1. None: not predicted, 1."""
    if iteration_s is None or not iteration_s > 0:
        return 1
    return max(1, min(checkpoint_every, int(RANGE_SHARE_OF_TIME_LIMIT * time_limit_s / iteration_s)))


def state_machine_name(workflow: Workflow, region: str) -> str:
    """The region's state machine: `<run>-<region>`, at most STATE_MACHINE_NAME_LIMIT characters."""
    return bounded_name(f"{workflow.run.name}-{region}", STATE_MACHINE_NAME_LIMIT)


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
    iteration_s: float | None = None,
) -> dict[str, str]:
    """The deployment files of one region for the given targets, as path under the build root -> text.

    `registry` prefixes the OpenFaaS images (`<registry>/<function>:<tag>`; None: no prefix, and faas-cli
    cannot push them). `packages` holds the build's files, of which each function package's content tags
    its image (codegen.images.image_tag); without them (a render of the deployment files alone) the tag is
    derived from the function's description in the workflow instead. `iteration_s`: the plan's predicted
    seconds per iteration in the region, which sets how many iterations one deployed invocation runs
    (`iterations_per_invocation`; None: one)."""
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
        files[f"regions/{region}/statemachine.asl.json"] = _render_state_machine(workflow, entry, iteration_s)
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


def region_bucket(workflow: Workflow, region: str) -> str:
    """The bucket of a region's storage where the build names it (OpenFaaS): the run's bucket, and with
    several regions one per region, `<bucket>-<region>` (at most BUCKET_NAME_LIMIT characters)."""
    if len(workflow.regions) == 1:
        return workflow.storage.bucket
    return bounded_name(f"{workflow.storage.bucket}-{region}", BUCKET_NAME_LIMIT)


def peer_regions(workflow: Workflow, region: str) -> list[str]:
    """The regions whose storage a region's functions reach across the WAN: every other region of the
    workflow (synchronous SGD and model averaging read each other's; ASGD-GA reads and writes the global
    model in the server's, which is one of them)."""
    return [r.name for r in workflow.regions if r.name != region]


def _storage_url(workflow: Workflow, region: str) -> str:
    return f"s3://{region_bucket(workflow, region)}/{workflow.storage.prefix}"


def _peers_json(workflow: Workflow, region: str, bucket_of: Any) -> str:
    """CLOUDLESS_PEERS's value: {peer region: its storage URL}, keys sorted, the bucket as `bucket_of` names it."""
    peers = {peer: f"s3://{bucket_of(peer)}/{workflow.storage.prefix}" for peer in peer_regions(workflow, region)}
    return json.dumps(peers, sort_keys=True)


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
        storage=_storage_url(workflow, entry.name),
        peers_env=PEERS_ENV,
        peers=_peers_json(workflow, entry.name, lambda peer: region_bucket(workflow, peer))
        if len(workflow.regions) > 1
        else None,
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


def data_object_arns(patterns: Iterable[str]) -> list[str]:
    """The objects a region's data in place may be read from, as IAM resources (for Fn::Sub): a pattern's
    key up to its first brace, then any key (`s3://b/train-{0..9}.tar` -> `b/train-*`); a wids index's
    folder, where its shards lie; a file as it is. Folders of this machine need no grant."""
    arns = []
    for pattern in patterns:
        if not pattern.startswith("s3://"):
            continue
        bucket, _, key = pattern.removeprefix("s3://").partition("/")
        if key.endswith(".json"):
            key = key.rpartition("/")[0] + "/*" if "/" in key else "*"
        elif "{" in key:
            key = key[: key.index("{")] + "*"
        literal = f"{bucket}/{key}".replace("${", "${!")  # Fn::Sub's escape: a key's own `${` is no variable
        arns.append(f"arn:${{AWS::Partition}}:s3:::{literal}")
    return sorted(set(arns))


def _render_template(workflow: Workflow, entry: Region, tags: Mapping[str, str]) -> str:
    prefix = object_prefix(workflow)
    machine = state_machine_name(workflow, entry.name)
    states_arn = "arn:${AWS::Partition}:states:${AWS::Region}:${AWS::AccountId}"
    server = workflow.sync.server if workflow.sync.inter_region == "asgd-ga" else None
    # Model averaging, sync: a region that stops waiting for a peer marks the peer's missing contribution
    # and its departure in the peer's bucket (create-if-absent, protocol.LEFT_MARK), nothing else there.
    contribution = {"model-average": "model-average/*/model", "sync": "it*/cross/*/sums"}.get(
        workflow.sync.inter_region or ""
    )
    peers = []
    for peer in peer_regions(workflow, entry.name):
        bucket = f"arn:${{AWS::Partition}}:s3:::${{{peer_parameter(peer)}}}"
        base = f"{bucket}/{prefix}*/{peer}"
        peers.append(
            {
                "region": peer,
                "parameter": peer_parameter(peer),
                "condition": peer_condition(peer),
                "sid": peer_parameter(peer).removeprefix("PeerBucket"),
                "bucket_arn": bucket,
                "object_arn": f"{bucket}/{prefix}*",
                "departure_arns": [f"{base}/{contribution}", f"{base}/left"] if contribution is not None else [],
                # ASGD-GA: a region other than the server writes the global model's next versions in the server's
                # bucket, under <prefix><run id>/<server>/global/ (the run id is the controller's: any).
                "global_arn": f"{base}/global/*" if peer == server else None,
            }
        )
    return _ENV.get_template("template.yaml.j2").render(
        peers=peers,
        peers_env=PEERS_ENV,
        peers_sub=_peers_json(workflow, entry.name, lambda peer: f"${{{peer_parameter(peer)}}}"),
        run=workflow.run.name,
        region=entry.name,
        bucket=BUCKET_RESOURCE,
        storage_sub=f"s3://${{{BUCKET_RESOURCE}}}/" + workflow.storage.prefix,
        object_actions=S3_OBJECT_ACTIONS,
        object_prefix=prefix,
        object_arn=f"${{{BUCKET_RESOURCE}.Arn}}/" + prefix + "*",
        storage_env=STORAGE_ENV,
        functions=_sam_functions(entry, tags),
        data_arns=data_object_arns(entry.data_in_place),
        machine_name=machine,
        distributed=distributed(len(workers(workflow, entry.name))),
        machine_arn=f"{states_arn}:stateMachine:{machine}",
        child_executions_arn=f"{states_arn}:execution:{machine}/*",
    )


def default_time_limit(entry: Region) -> float:
    """The time limit an invocation gets when the execution's input names none: 30 s less than the region's
    shortest function timeout (at least 1 s), as cloudless-run gives (runtimes/control/controller.py)."""
    return float(max(1, min(function.timeout_s for function in entry.functions) - 30))


def _render_state_machine(workflow: Workflow, entry: Region, iteration_s: float | None) -> str:
    region_workers = workers(workflow, entry.name)
    chunk = rounds_per_execution(len(region_workers))
    time_limit = default_time_limit(entry)
    items = [
        json.dumps({"function": f"${{{w.logical_id}Arn}}", "stage": w.stage, "replica": w.replica})
        for w in region_workers
    ]
    several = len(workflow.regions) > 1
    return _ENV.get_template("statemachine.asl.json.j2").render(
        run=workflow.run.name,
        region=entry.name,
        # several regions: each trains its own number of iterations (their rounds meet)
        iterations=(entry.iterations or workflow.run.iterations) if several else workflow.run.iterations,
        several=several,
        time_limit=time_limit,
        chunk=chunk,
        span=iterations_per_invocation(iteration_s, time_limit, workflow.run.checkpoint_every),
        workers=items,
        concurrency=len(region_workers),
        distributed=distributed(len(region_workers)),
        retry_errors=json.dumps(list(LAMBDA_RETRY_ERRORS)),
        invoke=LAMBDA_INVOKE,
        carried=CARRIED_FIELDS,
        round_fields=ROUND_FIELDS,
        fields=EXECUTION_FIELDS,
        run_stopped=RUN_STOPPED_ERROR,
    )
