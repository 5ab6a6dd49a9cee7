"""What a deployed SAM stack exports, as the generated template names it and the deploy-and-train driver
(runtimes/deploy.py) reads it: the stack's output keys and each stage function's logical id."""

from __future__ import annotations

import re

#: the output holding the run's bucket (the functions' storage is s3://<bucket>/<workflow.storage.prefix>)
BUCKET_OUTPUT = "BucketName"
#: the output holding the ARN of the region's state machine
STATE_MACHINE_OUTPUT = "IterationStateMachineArn"


def logical_id(function_name: str) -> str:
    """A CloudFormation logical id (alphanumeric) for a function: mlp-digits-s0 -> MlpDigitsS0Function."""
    parts = re.split(r"[^A-Za-z0-9]+", function_name)
    return "".join(part[:1].upper() + part[1:] for part in parts if part) + "Function"


def function_output(function_name: str) -> str:
    """The output holding the deployed name of a stage's Lambda function."""
    return f"{logical_id(function_name)}Name"


def stack_name(run: str, region: str) -> str:
    """The CloudFormation stack of a region's deployment (samconfig.toml's stack_name)."""
    return f"{run}-{region}"
