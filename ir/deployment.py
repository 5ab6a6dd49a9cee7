"""What a deployed SAM stack exports, as the generated template names it and the deploy-and-train driver
(runtimes/clouds/deploy.py) reads it: the stack's output keys and each stage function's logical id."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any

#: the output holding the run's bucket (the functions' storage is s3://<bucket>/<workflow.storage.prefix>)
BUCKET_OUTPUT = "BucketName"
#: the output holding the ARN of the region's state machine
STATE_MACHINE_OUTPUT = "IterationStateMachineArn"
#: the error an execution fails with when a worker stopped the run (diverged, aborted, storage refused a
#: write): its cause is the worker's reason, and no retry of the execution can mend it
RUN_STOPPED_ERROR = "Cloudless.RunStopped"


#: Lambda's limit on a function name (letters, digits, '-' and '_')
LAMBDA_NAME_LIMIT = 64


def bounded_name(name: str, limit: int) -> str:
    """`name`, or when longer than `limit` its start and 8 hex digits of its SHA-256 (still unique)."""
    if len(name) <= limit:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{name[: limit - 9].rstrip('-_')}-{digest}"


def lambda_function_name(function_name: str, region: str) -> str:
    """The deployed Lambda function of a stage's function in a region: `<function>-<region>` (the run, the
    stage and the catalog region: mlp-digits-s0-aws-us-east-1), at most LAMBDA_NAME_LIMIT characters: what
    the SAM template names it, and what `cloudless-run --invoker lambda` invokes."""
    return bounded_name(f"{function_name}-{region}", LAMBDA_NAME_LIMIT)


def logical_id(function_name: str) -> str:
    """A CloudFormation logical id (alphanumeric) for a function: mlp-digits-s0 -> MlpDigitsS0Function."""
    parts = re.split(r"[^A-Za-z0-9]+", function_name)
    return "".join(part[:1].upper() + part[1:] for part in parts if part) + "Function"


def function_output(function_name: str) -> str:
    """The output holding the deployed name of a stage's Lambda function."""
    return f"{logical_id(function_name)}Name"


def function_arn_output(function_name: str) -> str:
    """The output holding the ARN of a stage's Lambda function (what the state machine invokes)."""
    return f"{logical_id(function_name)}Arn"


#: Several regions: each region's stack has its own bucket. A SAM stack takes each peer region's bucket (the
#: BucketName output of that region's stack, not known when this one deploys) as a parameter named
#: PEER_BUCKET_PARAMETER + the region in CamelCase (PeerBucketAwsEuWest1); see `peer_parameter`. Its rights
#: on a peer's bucket hold only where that parameter is set (the condition `peer_condition`), so that a stack
#: deployed before its peers exist is valid, grants nothing yet, and the driver can tell.
PEER_BUCKET_PARAMETER = "PeerBucket"


def peer_parameter(region: str) -> str:
    """The SAM stack parameter holding a peer region's bucket name: aws-eu-west-1 -> PeerBucketAwsEuWest1."""
    return PEER_BUCKET_PARAMETER + "".join(part[:1].upper() + part[1:] for part in re.split(r"[^A-Za-z0-9]+", region))


def peer_condition(region: str) -> str:
    """The template's condition that a peer region's bucket is given: HasPeerBucketAwsEuWest1."""
    return "Has" + peer_parameter(region)


def stack_name(run: str, region: str) -> str:
    """The CloudFormation stack of a region's deployment (samconfig.toml's stack_name)."""
    return f"{run}-{region}"


@dataclass(frozen=True)
class ExecutionInput:
    """The input of one execution of a region's state machine: train iterations [start, stop) of the run
    `run`. The driver sends it; the generated state machine defaults each field it lacks, carries
    `CARRIED_FIELDS` unchanged through every state into every invocation, and returns them with
    `iteration` (where it stopped) in place of `start`, so that the next execution's input is
    `continued(output)`.

    The run's coordinator (runtimes/control/controller.py) adds what a re-plan of the region decided: `plan`, the
    invocation fields of the region's plan now (`protocol.Invocation`'s `iterations`, `rounds`, `since`,
    `first_round`, `replicas`, `weight`, `region_timeout`, `timeout`), which every invocation's payload
    carries; `workers`, the (function, stage, replica) items a round invokes (fewer replicas where capacity
    shrank; default every deployed one); and `max_rounds`, at most how many rounds the execution runs
    (default as many as its history's quota allows): 1 makes an execution one range, as the coordinator
    plans them."""

    start: int
    stop: int
    attempt: int
    time_limit_s: float
    run: str
    plan: Mapping[str, Any] = field(default_factory=dict)
    workers: tuple[Mapping[str, Any], ...] | None = None
    max_rounds: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON the state machine reads: the fields left at their default are left out."""
        document: dict[str, Any] = {
            "run": self.run,
            "attempt": self.attempt,
            "time_limit_s": self.time_limit_s,
            "start": self.start,
            "stop": self.stop,
        }
        if self.plan:
            document["plan"] = dict(self.plan)
        if self.workers is not None:
            document["workers"] = [dict(worker) for worker in self.workers]
        if self.max_rounds is not None:
            document["max_rounds"] = self.max_rounds
        return document

    def continued(self, output: Mapping[str, Any]) -> ExecutionInput:
        """The next execution's input, from an execution's output."""
        carried = {name: output[name] for name in CARRIED_FIELDS if name in output}
        return replace(self, **carried, start=int(output["iteration"]), stop=int(output.get("stop", self.stop)))


#: the fields every state passes on unchanged, and every invocation's payload carries
CARRIED_FIELDS = ("run", "attempt", "time_limit_s", "plan")
#: the fields the states pass on that the invocations do not get
ROUND_FIELDS = ("workers", "max_rounds")
#: the fields an execution's input may give, in the order the state machine defaults them
EXECUTION_FIELDS = tuple(f.name for f in fields(ExecutionInput))
