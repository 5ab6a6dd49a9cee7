"""`cloudless-run BUILD --invoker lambda --rehearse`: the deployed path, on this machine.

A local AWS endpoint (moto's server on a free loopback port, in this process) stands in for AWS. Every
region's generated SAM template is deployed into it as `sam build && sam deploy --config-env REGION` would:
samconfig.toml's stack name, parameters and capabilities; each image function's ImageUri the tag `sam build`
gives it; the state machine's definition uploaded to a bucket (DefinitionUri); the template transformed to
plain CloudFormation by aws-sam-translator (the library CloudFormation's own SAM transform is) and created
with CreateStack. Then the real driver (runtimes/clouds/deploy.py, `--stack`) trains on the stacks: it reads
their outputs, stages the data into the run's bucket, starts and follows the executions. Step Functions'
executions run in the ASL interpreter (runtimes/rehearsal/stepfunctions_local.py) and each Lambda invocation in a
local execution environment entered through the runtime interface client (runtimes/rehearsal/lambda_local.py).

Where moto falls short, and what is done about it:
- moto's CloudFormation creates AWS::StepFunctions::StateMachine from DefinitionString only (not
  DefinitionS3Location, Definition nor DefinitionSubstitutions): the definition is read back from the
  bucket it was uploaded to and given as DefinitionString, its substitutions made with Fn::Join (moto's
  Fn::Sub would also turn the definition's `$$.` context paths into `$.`).
- moto's CloudFormation keeps neither PackageType nor ImageConfig of AWS::Lambda::Function (and runs no
  image): the handler string is the template's ImageConfig.Command (else the Dockerfile's CMD), and the
  package folder is the function's DockerContext.
- IAM policies are created but not enforced: a function may do more here than its role allows on AWS.

The functions get the endpoint (AWS_ENDPOINT_URL) and made-up credentials in their environment, as Lambda
gives a function its role's; the driver gets the same for the run's length. Nothing is written to a file.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import secrets
import shlex
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from ...ir import protocol
from ...ir.catalog import AWS_REGION_PREFIX
from ...ir.deployment import BUCKET_OUTPUT, peer_parameter
from ...ir.workflow import Workflow
from ..clouds.deploy import DeployError, aws_region, drive
from ..control.run import fail, resources_of
from ..storage.transient import Throttled, aws_client
from .lambda_local import FunctionImage, LambdaService
from .stepfunctions_local import StepFunctionsExecutor

#: made-up credentials for the first request (the endpoint accepts any; no real ones go near it)
SETUP_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "rehearsal", "AWS_SECRET_ACCESS_KEY": "rehearsal"}
#: the bucket `sam deploy --resolve-s3` uploads artifacts (the state machine's definition) to, + account, region
ARTIFACTS_BUCKET = "aws-sam-cli-rehearsal"
_CMD = re.compile(r"^\s*CMD\s+(\[.*\])\s*$", re.M)


@dataclass(frozen=True)
class DeployedStack:
    region: str  # the catalog's
    name: str
    aws_region: str
    images: dict[str, FunctionImage]  # deployed function name -> its image


def samconfig_deploy(build: Path, region: str) -> dict[str, Any]:
    """samconfig.toml's [REGION.deploy.parameters] (DeployError if missing)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    path = build / "samconfig.toml"
    if not path.is_file():
        raise DeployError(f"{path}: not found; the build has no SAM deployment (compile with --target sam or both)")
    try:
        config = tomllib.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise DeployError(f"{path}: cannot be read: {exc}") from None
    parameters = config.get(region, {}).get("deploy", {}).get("parameters")
    if not isinstance(parameters, dict):
        raise DeployError(f"{path}: no [{region}.deploy.parameters]; was the build compiled for AWS?")
    return parameters


def parameter_overrides(value: Any) -> dict[str, str]:
    """samconfig's parameter_overrides: "A=1 B='x y'" or a list of such items."""
    items = value if isinstance(value, list) else shlex.split(str(value or ""))
    overrides = {}
    for item in items:
        key, equals, text = str(item).partition("=")
        if not equals:
            raise DeployError(f"samconfig.toml: parameter_overrides {item!r}: expected KEY=VALUE")
        overrides[key] = text
    return overrides


def image_handler(resource: dict[str, Any], context: Path) -> str:
    """The handler string of an image function: ImageConfig.Command, else the Dockerfile's CMD."""
    command = resource.get("Properties", {}).get("ImageConfig", {}).get("Command")
    if command:
        return str(command[0])
    dockerfile = context / resource.get("Metadata", {}).get("Dockerfile", "Dockerfile")
    match = _CMD.search(dockerfile.read_text()) if dockerfile.is_file() else None
    if match is None:
        raise DeployError(f'{dockerfile}: no CMD ["module.function"] and no ImageConfig.Command')
    return str(json.loads(match.group(1))[0])


def substituted(text: str, variables: dict[str, Any]) -> Any:
    """Fn::Sub [text, variables] as the equivalent Fn::Join: ${Name} a variable (else a Ref, ${Res.Attr} a
    GetAtt), ${!Name} the literal ${Name}. (moto's Fn::Sub runs string.Template over the text, which turns
    the definition's `$$.Map.Item.Value` context paths into `$.Map...`; its Fn::Join leaves text alone.)"""
    parts: list[Any] = []
    at = 0
    for match in re.finditer(r"\$\{([^}]*)\}", text):
        parts.append(text[at : match.start()])
        name = match.group(1)
        if name.startswith("!"):
            parts.append("${" + name[1:] + "}")
        elif name in variables:
            parts.append(variables[name])
        elif "." in name:
            parts.append({"Fn::GetAtt": name.split(".", 1)})
        else:
            parts.append({"Ref": name})
        at = match.end()
    parts.append(text[at:])
    return {"Fn::Join": ["", [p for p in parts if p != ""]]}


class AwsRehearsal:
    """The endpoint, the deployed stacks, the executor and the Lambda service of one rehearsal."""

    def __init__(
        self, build: Path, workflow: Workflow, folder: Path, function_environment: dict[str, dict[str, dict[str, str]]]
    ):
        self.build, self.workflow, self.folder = build, workflow, folder
        self.throttled, self.seed = 0.0, 0  # --inject-throttling, --fault-seed
        self.function_environment = function_environment  # per region, then per workflow function name
        self.stacks: dict[str, DeployedStack] = {}
        self.server: Any = None
        self.endpoint = ""
        self.account = ""
        self.credentials = dict(SETUP_CREDENTIALS)
        self.lambdas: LambdaService | None = None
        self.executor: StepFunctionsExecutor | None = None

    def start(self) -> None:
        from moto.server import ThreadedMotoServer

        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one log line per request otherwise
        logging.getLogger("samtranslator.metrics").setLevel(logging.ERROR)  # "unpublished metrics": sam's own
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.endpoint = f"http://{host}:{port}"
        self.account = self._new_account()

    def _new_account(self) -> str:
        """An account of its own for this rehearsal, with a user whose access key every client uses: moto's
        server keeps its state in this process's memory, so a second rehearsal in the same process (or a
        moto server of the caller's) would otherwise find the first one's stacks."""
        account = f"{secrets.randbelow(9 * 10**11) + 10**11:012d}"
        iam = self.client("iam", "us-east-1")

        def in_account(request: Any, **_: Any) -> None:  # moto's header naming the account of a request
            request.headers["x-moto-account-id"] = account

        iam.meta.events.register("before-sign.iam.*", in_account)
        iam.create_user(UserName="cloudless-rehearsal")
        key = iam.create_access_key(UserName="cloudless-rehearsal")["AccessKey"]
        self.credentials = {"AWS_ACCESS_KEY_ID": key["AccessKeyId"], "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]}
        return account

    def client(self, service: str, region: str) -> Any:
        import boto3

        return boto3.client(
            service,
            region_name=region,
            endpoint_url=self.endpoint,
            aws_access_key_id=self.credentials["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.credentials["AWS_SECRET_ACCESS_KEY"],
        )

    def deploy(self, region: str, peers: Mapping[str, str] | None = None) -> DeployedStack:
        """`sam build && sam deploy --config-env REGION --parameter-overrides PeerBucket<Peer>=<bucket>...`
        into the endpoint: the stack, created, or updated where it exists (the second deploy of a region
        deployed before its peers). `peers`: the peer regions' buckets known so far."""
        import boto3
        from samtranslator.parser.parser import Parser
        from samtranslator.translator.translator import Translator

        config = samconfig_deploy(self.build, region)
        name, where = str(config.get("stack_name", "")), str(config.get("region", aws_region(region)))
        folder = self.build / "regions" / region
        template = yaml.safe_load((folder / "template.yaml").read_text())
        s3 = self.client("s3", where)
        artifacts = f"{ARTIFACTS_BUCKET}-{self.account}-{where}"  # bucket names are global: the account's own
        if region in self.stacks:
            pass  # a second deploy: the artifacts bucket is there
        elif where == "us-east-1":
            s3.create_bucket(Bucket=artifacts)
        else:
            s3.create_bucket(Bucket=artifacts, CreateBucketConfiguration={"LocationConstraint": where})
        contexts: dict[str, Path] = {}
        for logical, resource in template.get("Resources", {}).items():
            properties = resource.setdefault("Properties", {})
            if resource.get("Type") == "AWS::Serverless::Function" and properties.get("PackageType") == "Image":
                metadata = resource.get("Metadata", {})
                contexts[logical] = folder / metadata.get("DockerContext", ".")
                properties["ImageUri"] = f"{logical.lower()}:{metadata.get('DockerTag', 'latest')}"  # sam build's
            uri = properties.get("DefinitionUri")
            if resource.get("Type") == "AWS::Serverless::StateMachine" and isinstance(uri, str):
                body = (folder / uri).read_bytes()
                key = f"{name}/{hashlib.md5(body).hexdigest()}.json"
                s3.put_object(Bucket=artifacts, Key=key, Body=body)
                properties["DefinitionUri"] = {"Bucket": artifacts, "Key": key}
        overrides = parameter_overrides(config.get("parameter_overrides"))
        overrides.update({peer_parameter(peer): bucket for peer, bucket in (peers or {}).items()})
        iam = self.client("iam", where)

        def managed_policies() -> dict[str, str]:  # only for a template naming AWS managed policies
            pages = iam.get_paginator("list_policies").paginate(Scope="AWS")
            return {p["PolicyName"]: p["Arn"] for page in pages for p in page["Policies"]}

        translator = Translator(None, Parser(), boto_session=boto3.Session(region_name=where))
        try:
            transformed = translator.translate(
                template, parameter_values=dict(overrides), get_managed_policy_map=managed_policies
            )
        except Exception as exc:  # noqa: BLE001 - samtranslator's InvalidDocumentException and kin
            raise DeployError(f"{folder / 'template.yaml'}: the SAM transform failed: {exc}") from None
        for resource in transformed.get("Resources", {}).values():
            if resource.get("Type") == "AWS::StepFunctions::StateMachine":
                self._inline_definition(resource["Properties"], s3)
        cloudformation = self.client("cloudformation", where)
        capabilities = config.get("capabilities", [])
        capabilities = shlex.split(capabilities) if isinstance(capabilities, str) else list(capabilities)
        action = "UpdateStack" if region in self.stacks else "CreateStack"
        try:
            (cloudformation.update_stack if region in self.stacks else cloudformation.create_stack)(
                StackName=name,
                TemplateBody=json.dumps(transformed),
                Parameters=[{"ParameterKey": k, "ParameterValue": v} for k, v in overrides.items()],
                Capabilities=capabilities,
            )
            stack = cloudformation.describe_stacks(StackName=name)["Stacks"][0]
        except Exception as exc:  # noqa: BLE001 - botocore's ClientError: one line
            raise DeployError(f"{region}: {action} {name} failed: {str(exc).splitlines()[0]}") from None
        if stack["StackStatus"] not in ("CREATE_COMPLETE", "UPDATE_COMPLETE"):
            raise DeployError(f"{region}: stack {name}: {stack['StackStatus']} {stack.get('StackStatusReason', '')}")
        images: dict[str, FunctionImage] = {}
        resources = cloudformation.describe_stack_resources(StackName=name)["StackResources"]
        if action == "UpdateStack":
            self._update_environments(transformed, resources, overrides, where)
        for resource in resources:
            logical = resource["LogicalResourceId"]
            if resource["ResourceType"] != "AWS::Lambda::Function" or logical not in contexts:
                continue
            context = contexts[logical]
            function = json.loads((context / "function.json").read_text()).get("function", "")
            environment = {**self.function_environment.get(region, {}).get(function, {})}
            images[resource["PhysicalResourceId"]] = FunctionImage(
                context, image_handler(transformed["Resources"][logical], context), environment
            )
        deployed = DeployedStack(region, name, where, images)
        self.stacks[region] = deployed
        return deployed

    def _update_environments(
        self, transformed: dict[str, Any], resources: list[dict[str, Any]], parameters: dict[str, str], where: str
    ) -> None:
        """What CloudFormation's update does to the functions and moto's leaves undone: each function's
        environment as the updated template resolves it (a second deploy's peer buckets)."""
        physical = {r["LogicalResourceId"]: r["PhysicalResourceId"] for r in resources}
        names = {**physical, **parameters}
        client = self.client("lambda", where)
        for logical, resource in transformed.get("Resources", {}).items():
            variables = resource.get("Properties", {}).get("Environment", {}).get("Variables")
            if resource.get("Type") != "AWS::Lambda::Function" or not variables or logical not in physical:
                continue
            resolved = {key: _resolved(value, names) for key, value in variables.items()}
            client.update_function_configuration(FunctionName=physical[logical], Environment={"Variables": resolved})

    @staticmethod
    def _inline_definition(properties: dict[str, Any], s3: Any) -> None:
        """moto's CloudFormation reads DefinitionString only: the uploaded definition, its substitutions
        as Fn::Sub's variables (CloudFormation's meaning of DefinitionSubstitutions)."""
        location = properties.pop("DefinitionS3Location", None)
        definition = properties.pop("Definition", None)
        substitutions = properties.pop("DefinitionSubstitutions", None)
        if location is not None:
            text = s3.get_object(Bucket=location["Bucket"], Key=location["Key"])["Body"].read().decode()
        elif definition is not None:
            text = json.dumps(definition)
        else:
            return
        properties["DefinitionString"] = substituted(text, substitutions or {})

    def bucket(self, region: str) -> str:
        """The BucketName output of the region's deployed stack."""
        stack = self.stacks[region]
        described = self.client("cloudformation", stack.aws_region).describe_stacks(StackName=stack.name)
        return next(o["OutputValue"] for o in described["Stacks"][0]["Outputs"] if o["OutputKey"] == BUCKET_OUTPUT)

    def take_down(self, region: str) -> None:
        """Fault injection (`--fail-region`): the region's functions stop answering."""
        if self.lambdas is not None:
            self.lambdas.take_down(set(self.stacks[region].images))

    def run_functions(self) -> None:
        """The Lambda service and the Step Functions executor over every deployed stack."""
        images = {name: image for stack in self.stacks.values() for name, image in stack.images.items()}
        regions = {name: stack.aws_region for stack in self.stacks.values() for name in stack.images}
        clients = {where: self.client("lambda", where) for where in set(regions.values())}

        def configuration(name: str) -> dict[str, Any]:
            return dict(clients[regions[name]].get_function_configuration(FunctionName=name))

        self.lambdas = LambdaService(
            images, configuration, self.folder / "lambda", throttled=self.throttled, seed=self.seed
        )
        where = sorted({(self.account, s.aws_region) for s in self.stacks.values()})
        self.executor = StepFunctionsExecutor(where, self.lambdas)
        self.executor.__enter__()

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()
        if self.lambdas is not None:
            self.lambdas.close()
        if self.server is not None:
            self.server.stop()


def _resolved(value: Any, names: Mapping[str, str]) -> str:
    """A template value of a function's environment: a string, a Ref, or a Fn::Sub of names (parameters and
    resources' physical ids)."""
    if isinstance(value, dict) and "Ref" in value:
        return names[value["Ref"]]
    if isinstance(value, dict) and "Fn::Sub" in value:
        text = value["Fn::Sub"] if isinstance(value["Fn::Sub"], str) else value["Fn::Sub"][0]
        return re.sub(r"\$\{([^}!.]*)\}", lambda match: names[match.group(1)], text)
    return str(value)


#: --inject-throttling: the largest share of the driver's Step Functions requests throttled
DRIVER_THROTTLED_MAX = 0.5


@contextmanager
def driver_environment(endpoint: str, where: str, credentials: dict[str, str]) -> Iterator[None]:
    """The endpoint and the made-up credentials for every boto3 client of this process, for the run's
    length (the user's own profile, session token or endpoints set aside, then put back). boto3's default
    session keeps the credentials it first found: it is dropped on the way in and out, so that the driver's
    clients take these, and no client after the rehearsal takes them."""
    import boto3

    values = {
        **credentials,
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_DEFAULT_REGION": where,
        protocol.S3_ENDPOINT_ENV: endpoint,
    }
    cleared = (
        "AWS_PROFILE",
        "AWS_SESSION_TOKEN",
        "AWS_ENDPOINT_URL_S3",
        "AWS_ENDPOINT_URL_CLOUDFORMATION",
        "AWS_ENDPOINT_URL_SFN",
        "AWS_ENDPOINT_URL_LAMBDA",
    )
    saved = {k: os.environ.get(k) for k in [*values, *cleared]}
    os.environ.update(values)
    for key in cleared:
        os.environ.pop(key, None)
    boto3.DEFAULT_SESSION = None
    try:
        yield
    finally:
        boto3.DEFAULT_SESSION = None
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def rehearse(args: argparse.Namespace, build: Path, workflow: Workflow, iterations: int, out: Path) -> int:
    """`--invoker lambda --rehearse`: deploy every region's stack into a local endpoint, train on them
    through the driver, tear everything down; the exit status."""
    if args.stack:
        return fail("--stack: not with --rehearse (the rehearsal deploys its own stacks)")
    others = [r for r in workflow.regions if r.provider != "aws" or not r.name.startswith(AWS_REGION_PREFIX)]
    if others:
        return fail(f"--rehearse: region {others[0].name} is not an AWS region (provider {others[0].provider})")
    try:
        import awslambdaric  # noqa: F401 - the functions' entry point, in the same environment
        import moto.server  # noqa: F401
        import samtranslator  # noqa: F401
    except ImportError as exc:
        return fail(f"--rehearse needs {exc.name}: pip install 'cloudless[rehearse]'")
    folder = out / "rehearsal"
    resources = resources_of(workflow, args)
    environment: dict[str, dict[str, dict[str, str]]] = {}
    rehearsal = AwsRehearsal(build, workflow, folder, environment)
    driver_throttled: Throttled | None = None
    rehearsal.throttled, rehearsal.seed = args.inject_throttling, args.fault_seed
    try:
        rehearsal.start()
        for region in workflow.regions:
            for function in region.functions:
                given = resources(function)
                environment.setdefault(region.name, {})[function.name] = {
                    **rehearsal.credentials,  # as Lambda gives a function its role's
                    "AWS_ENDPOINT_URL": rehearsal.endpoint,
                    **({protocol.EMULATE_ENV: json.dumps(given.to_json())} if given is not None else {}),
                    **(
                        {protocol.STORAGE_FAULTS_ENV: os.environ[protocol.STORAGE_FAULTS_ENV]}
                        if os.environ.get(protocol.STORAGE_FAULTS_ENV)
                        else {}
                    ),
                }
        # docs/deploying.md's order: each region deployed with the buckets of those deployed before it, then
        # those deployed before a peer existed once more, with every peer's.
        buckets: dict[str, str] = {}
        for region in workflow.regions:
            stack = rehearsal.deploy(region.name, buckets)
            buckets[region.name] = rehearsal.bucket(region.name)
            if not args.quiet:
                print(
                    f"rehearsal: stack {stack.name} ({region.name}) created in the local AWS endpoint "
                    f"{rehearsal.endpoint} (moto): {len(stack.images)} function(s), logs in {folder / 'lambda'}/",
                    flush=True,
                )
        for region in workflow.regions[:-1]:
            stack = rehearsal.deploy(region.name, {name: b for name, b in buckets.items() if name != region.name})
            if not args.quiet:
                print(f"rehearsal: stack {stack.name} ({region.name}) deployed again with its peers' buckets")
        rehearsal.run_functions()
        args.stack = [
            f"{region}={stack.name}" if len(rehearsal.stacks) > 1 else stack.name
            for region, stack in rehearsal.stacks.items()
        ]
        where = next(iter(rehearsal.stacks.values())).aws_region
        with driver_environment(rehearsal.endpoint, where, rehearsal.credentials):
            # --inject-throttling: the driver's Step Functions requests are throttled too, at most half of them
            # (throttled on every one, the driver would end after botocore's retries, having invoked nothing)
            driver_throttled = Throttled(min(args.inject_throttling, DRIVER_THROTTLED_MAX), args.fault_seed)

            def stepfunctions(region: str) -> Any:
                return driver_throttled.attach(aws_client("stepfunctions", region_name=aws_region(region)))

            return drive(
                args, build, workflow, iterations, out, take_down=rehearsal.take_down, stepfunctions=stepfunctions
            )
    except DeployError as exc:
        return fail(str(exc))
    finally:
        rehearsal.close()
        if rehearsal.lambdas is not None and not args.quiet:
            lambdas = rehearsal.lambdas
            throttled = f" ({lambdas.throttles} throttled)" if lambdas.throttles else ""
            print(
                f"rehearsal: {lambdas.invocations} Lambda invocation(s){throttled} in {lambdas.started} "
                "execution environment(s); the endpoint and the functions are stopped"
            )
            if driver_throttled is not None and driver_throttled.count:
                print(f"rehearsal: {driver_throttled.count} of the driver's Step Functions requests were throttled")
