"""Several regions on SAM: each region's stack takes its peers' buckets as parameters. A parameter left empty
(the stack deployed before its peer exists) grants nothing on the peer, and no bucket-less ARN
(`arn:aws:s3:::`, `arn:aws:s3:::/prefix/*`): the template's Conditions, evaluated by CloudFormation (moto's).
Before a run the driver reads every stack's parameters and refuses, one line per stack, naming the sam deploy
that gives it its peers."""

from __future__ import annotations

import argparse
import ast
import json
import re
from typing import Any

import boto3
import pytest
import yaml

from cloudless.codegen.platforms import lambda_function_name, render_region
from cloudless.ir.deployment import function_output, peer_parameter, stack_name
from cloudless.runtimes.clouds.preflight import lambda_preflight
from tests.preflight_servers import lambda_api, serve
from tests.test_platforms import EAST, RUN, WEST, make_workflow

TRUST = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Principal": {"Service": "lambda.amazonaws.com"}, "Action": "sts:AssumeRole"}],
}


def _template(region: str) -> dict[str, Any]:
    return yaml.safe_load(render_region(make_workflow(), region, {"sam"})[f"regions/{region}/template.yaml"])


def _role_policy(region: str, peer_bucket: str, moto_endpoint: str) -> list[dict[str, Any]]:
    """The first function's statements as CloudFormation resolves them in an IAM role (as the SAM transform
    puts an inline policy document), with the peer's parameter set to `peer_bucket`."""
    template = _template(region)
    function = template["Resources"]["MlpDigitsS0Function"]["Properties"]
    document = {"Version": "2012-10-17", "Statement": function["Policies"][0]["Statement"]}
    body = {
        "AWSTemplateFormatVersion": "2010-09-09",
        "Parameters": template["Parameters"],
        "Conditions": template.get("Conditions", {}),
        "Resources": {
            "RunBucket": {"Type": "AWS::S3::Bucket"},
            "FunctionRole": {
                "Type": "AWS::IAM::Role",
                "Properties": {
                    "AssumeRolePolicyDocument": TRUST,
                    "Policies": [{"PolicyName": "run", "PolicyDocument": document}],
                },
            },
        },
        "Outputs": {"Role": {"Value": {"Ref": "FunctionRole"}}},
    }
    cloudformation = boto3.client("cloudformation", endpoint_url=moto_endpoint)
    name = f"role-{region}-{peer_bucket or 'none'}"
    parameter = peer_parameter(WEST if region == EAST else EAST)
    cloudformation.create_stack(
        StackName=name,
        TemplateBody=json.dumps(body),
        Parameters=[{"ParameterKey": parameter, "ParameterValue": peer_bucket}],
        Capabilities=["CAPABILITY_IAM"],
    )
    role = cloudformation.describe_stacks(StackName=name)["Stacks"][0]["Outputs"][0]["OutputValue"]
    policy = boto3.client("iam", endpoint_url=moto_endpoint).get_role_policy(RoleName=role, PolicyName="run")
    document = policy["PolicyDocument"]
    if isinstance(document, str):  # moto keeps a policy CloudFormation created as the dict's repr, not JSON
        document = ast.literal_eval(document)
    # CloudFormation removes a list element that is AWS::NoValue; moto leaves it as null
    return [statement for statement in document["Statement"] if statement is not None]


def _resources(statements: list[dict[str, Any]]) -> list[str]:
    found = []
    for statement in statements:
        resource = statement["Resource"]
        found += resource if isinstance(resource, list) else [resource]
    return found


def test_an_empty_peer_parameter_grants_nothing_and_names_no_bucketless_arn(moto_endpoint: str, aws_env: None) -> None:
    statements = _role_policy(EAST, "", moto_endpoint)
    resources = _resources(statements)
    assert not [r for r in resources if re.match(r"arn:aws:s3:::(/|$)", r)], resources
    assert [s["Sid"] for s in statements] == ["RunObjects", "RunBucketLookups"]
    statements = _role_policy(EAST, "west-bucket", moto_endpoint)
    assert [s["Sid"] for s in statements] == [
        "RunObjects",
        "RunBucketLookups",
        "PeerObjectsAwsEuWest1",
        "PeerBucketLookupsAwsEuWest1",
        "DepartureMarksAwsEuWest1",
    ]
    assert statements[2]["Resource"] == f"arn:aws:s3:::west-bucket/{RUN}/*"
    assert statements[3]["Resource"] == "arn:aws:s3:::west-bucket"


def _deploy(region: str, peers: dict[str, str], moto_endpoint: str, update: bool = False, name: str = "") -> str:
    """The region's stack in moto with the template's Parameters, Conditions and output keys (the functions and
    the state machine named, not built: the pre-flight reads the stack, it invokes nothing); its bucket."""
    workflow = make_workflow()
    template = _template(region)
    outputs: dict[str, Any] = {
        "BucketName": {"Value": {"Ref": "RunBucket"}},
        "IterationStateMachineArn": {"Value": f"arn:aws:states:{region}:123456789012:stateMachine:{RUN}-{region}"},
    }
    for function in workflow.region(region).functions:
        outputs[function_output(function.name)] = {"Value": lambda_function_name(function.name, region)}
    body = {
        "AWSTemplateFormatVersion": "2010-09-09",
        "Parameters": template["Parameters"],
        "Conditions": template["Conditions"],
        "Resources": {"RunBucket": {"Type": "AWS::S3::Bucket"}},
        "Outputs": outputs,
    }
    client = boto3.client("cloudformation", region_name=region.removeprefix("aws-"), endpoint_url=moto_endpoint)
    call = client.update_stack if update else client.create_stack
    parameters = [{"ParameterKey": peer_parameter(p), "ParameterValue": b} for p, b in peers.items()]
    name = name or stack_name(RUN, region)
    call(StackName=name, TemplateBody=json.dumps(body), Parameters=parameters)
    described = client.describe_stacks(StackName=name)["Stacks"][0]
    return str({o["OutputKey"]: o["OutputValue"] for o in described["Outputs"]}["BucketName"])


def test_the_driver_refuses_stacks_that_do_not_grant_their_peers(
    moto_endpoint: str, aws_env: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """East deployed first (no peer yet), west with east's bucket: east still needs its second deploy."""
    workflow = make_workflow()
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    memory = {lambda_function_name(f.name, r.name): f.memory_mb for r in workflow.regions for f in r.functions}
    try:
        _check_peers(workflow, memory, moto_endpoint, monkeypatch)
    finally:  # moto's state lives as long as the session's server: a stack left here is another test's stack
        for region, name in ((EAST, f"{RUN}-{EAST}"), (WEST, f"{RUN}-{WEST}"), (EAST, "other-east")):
            client = boto3.client("cloudformation", region_name=region.removeprefix("aws-"), endpoint_url=moto_endpoint)
            client.delete_stack(StackName=name)


def _check_peers(workflow: Any, memory: dict[str, int], moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    east = _deploy(EAST, {WEST: ""}, moto_endpoint)
    west = _deploy(WEST, {EAST: east}, moto_endpoint)
    args = argparse.Namespace(stack=[], preflight_only=True)
    with serve(lambda_api(concurrency=1000, unreserved=1000, memory=memory)) as server:
        monkeypatch.setenv("AWS_ENDPOINT_URL_LAMBDA", server.url)
        found = lambda_preflight(args, workflow)
        assert found.failures == [
            f"{EAST}: stack {RUN}-{EAST} does not grant its peers' buckets (PeerBucketAwsEuWest1 is empty): deploy it "
            f"with them: sam deploy --config-env {EAST} --parameter-overrides PeerBucketAwsEuWest1={west}"
        ]
        named = argparse.Namespace(stack=[f"{EAST}=other-east", f"{WEST}={RUN}-{WEST}"], preflight_only=True)
        other = _deploy(EAST, {WEST: "someone-elses"}, moto_endpoint, name="other-east")
        failures = lambda_preflight(named, workflow).failures
        assert len(failures) == 2 and failures[1] == (
            f"{EAST}: stack other-east does not grant its peers' buckets (PeerBucketAwsEuWest1 is someone-elses): "
            f"deploy it with them: sam deploy --config-env {EAST} --stack-name other-east --parameter-overrides "
            f"PeerBucketAwsEuWest1={west}"
        )
        # west was given the default east stack's bucket, not other-east's
        assert failures[0] == (
            f"{WEST}: stack {RUN}-{WEST} does not grant its peers' buckets (PeerBucketAwsUsEast1 is {east}): deploy it "
            f"with them: sam deploy --config-env {WEST} --parameter-overrides PeerBucketAwsUsEast1={other}"
        )
        _deploy(EAST, {WEST: west}, moto_endpoint, update=True)  # the sam deploy it named
        assert lambda_preflight(args, workflow).failures == []
