"""Deploy-and-train: `cloudless-run BUILD --invoker lambda --stack NAME` trains on a deployed SAM stack.

Per region it reads the stack's outputs with CloudFormation (the run's bucket, the state machine, the
functions' names: cloudless.ir.deployment), stages the region's training data into the bucket (under the
workflow's storage prefix, where the functions read it), and starts the region's state machine with
{"run", "attempt", "time_limit_s", "start", "stop"}: every invocation carries the run name (so that a new
run in the same bucket trains anew), the attempt and the time limit. All regions' executions are started
together and followed together: each execution's status (describe_execution), and the progress the last
stage reports in storage. An execution runs at most a chunk of iterations (its history's quota) and
returns where it stopped: the next execution starts from there. A failed execution is started again
(attempt + 1, --retries times) from the newest iteration every stage has a checkpoint of, after the
completion markers of the iterations it left are deleted. At the end the trained model is fetched into
OUT/model.safetensors, with OUT/metrics.json, and the run's keys are deleted (the staged data stays).

Credentials and regions are boto3's own (environment, profile, role); AWS_ENDPOINT_URL points every client
at another endpoint (the tests use moto).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..ir import protocol
from ..ir.catalog import AWS_REGION_PREFIX
from ..ir.deployment import (
    BUCKET_OUTPUT,
    RUN_STOPPED_ERROR,
    STATE_MACHINE_OUTPUT,
    ExecutionInput,
    function_output,
    stack_name,
)
from ..ir.workflow import Region, Workflow
from .controller import Controller
from .data import data_name
from .invokers import Handle, Invocation, Invoker
from .retrying_channel import RetryingChannel
from .run_state import RunError, RunMetrics, RunSettings
from .staged_weights import save_trained_model
from .staging import DataError, describe_staged, model_file_state, recorded_model_file, stage_data, stage_run_weights
from .storage import Channel, open_channel

#: Step Functions' limit on an execution's name
EXECUTION_NAME_LIMIT = 80
#: how often an execution's status and the run's progress are read
POLL_S = 1.0
FINISHED = ("SUCCEEDED", "FAILED", "TIMED_OUT", "ABORTED")


class DeployError(RuntimeError):
    """The stack cannot be used (not found, an output missing): one line, the run does not start."""


@dataclass(frozen=True)
class Stack:
    """What a region's deployed stack exports."""

    region: str  # the catalog's region
    name: str
    bucket: str
    state_machine: str
    functions: dict[str, str]  # stage function -> deployed Lambda function name
    parameters: dict[str, str] = field(default_factory=dict)  # the stack's parameters (peers' buckets)

    def storage(self, workflow: Workflow) -> str:
        """Where the stack's functions keep their keys (their CLOUDLESS_STORAGE)."""
        return f"s3://{self.bucket}/{workflow.storage.prefix}"


def aws_region(region: str) -> str:
    return region.removeprefix(AWS_REGION_PREFIX)


def stack_names(workflow: Workflow, given: list[str]) -> dict[str, str]:
    """Each region's stack: `--stack NAME` (one region), `--stack REGION=NAME` (several); a region not
    named has samconfig.toml's stack name, <run>-<region>. ValueError for a bad value."""
    regions = [r.name for r in workflow.regions]
    names = {r: stack_name(workflow.run.name, r) for r in regions}
    for value in given:
        region, equals, name = value.rpartition("=")
        if not equals:
            if len(regions) > 1:
                raise ValueError(f"--stack {value}: several regions ({', '.join(regions)}): give REGION=NAME")
            region, name = regions[0], value
        if region not in names:
            raise ValueError(f"--stack {value}: no region {region!r} in the workflow ({', '.join(regions)})")
        if not name:
            raise ValueError(f"--stack {value}: expected a stack name")
        names[region] = name
    return names


def read_stack(cloudformation: Any, name: str, workflow: Workflow, region: Region) -> Stack:
    """The stack's outputs (DeployError names what is missing)."""
    try:
        stacks = cloudformation.describe_stacks(StackName=name)["Stacks"]
    except Exception as exc:  # noqa: BLE001 - botocore's ClientError (no such stack), no credentials...
        raise DeployError(f"--stack {name}: {_one_line(exc)}") from None
    stack = stacks[0]
    status = stack.get("StackStatus", "")
    if not status.endswith("_COMPLETE") or "ROLLBACK" in status or "DELETE" in status:
        raise DeployError(f"--stack {name}: status {status}; deploy it first (sam deploy)")
    outputs = {o["OutputKey"]: o["OutputValue"] for o in stack.get("Outputs", [])}
    wanted = [BUCKET_OUTPUT, STATE_MACHINE_OUTPUT, *(function_output(f.name) for f in region.functions)]
    missing = [key for key in wanted if key not in outputs]
    if missing:
        raise DeployError(
            f"--stack {name}: no output {', '.join(missing)}; is it the stack of {region.name} of run "
            f"{workflow.run.name} (regions/{region.name}/template.yaml)?"
        )
    return Stack(
        region.name,
        name,
        outputs[BUCKET_OUTPUT],
        outputs[STATE_MACHINE_OUTPUT],
        {f.name: outputs[function_output(f.name)] for f in region.functions},
        {p["ParameterKey"]: p.get("ParameterValue", "") for p in stack.get("Parameters", [])},
    )


def _cause(cause: str) -> str:
    """An execution's cause, one line: a Lambda function's error document is its errorMessage."""
    try:
        document = json.loads(cause)
    except ValueError:
        return " ".join(cause.split())
    if isinstance(document, dict) and isinstance(document.get("errorMessage"), str):
        return " ".join(document["errorMessage"].split())
    return " ".join(cause.split())


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@dataclass
class Followed:
    """One region's training on its stack: its executions and the progress read from storage."""

    stack: Stack
    channel: Channel
    stop: int
    executions: list[dict[str, Any]] = field(default_factory=list)
    progress: list[dict[str, Any]] = field(default_factory=list)
    next_iteration: int = 0
    retries: int = 0


class _NoInvoker(Invoker):
    """The controller is used for its arithmetic only (each region's iterations): it invokes nothing."""

    name = "Step Functions"

    def start(self, invocation: Invocation) -> Handle:
        raise AssertionError("the state machine invokes the functions")


class Driver:
    """Start and follow every region's state machine executions of one run."""

    def __init__(
        self,
        workflow: Workflow,
        stacks: dict[str, Stack],
        channels: dict[str, Channel],
        *,
        run_id: str,
        iterations: dict[str, int],
        time_limit_s: float,
        retries: int = 3,
        poll_s: float = 1.0,
        stepfunctions: Callable[[str], Any] | None = None,
        on_progress: Callable[[str, int, float], None] = lambda region, iteration, loss: None,
    ) -> None:
        import boto3

        self.workflow, self.run_id, self.time_limit_s = workflow, run_id, time_limit_s
        self.retries, self.poll_s, self.on_progress = retries, poll_s, on_progress
        make = stepfunctions or (lambda region: boto3.client("stepfunctions", region_name=aws_region(region)))
        self.clients = {region: make(region) for region in stacks}
        self.regions = {region: Followed(stacks[region], channels[region], iterations[region]) for region in stacks}

    def run(self) -> dict[str, Followed]:
        errors: list[BaseException] = []

        def region_run(region: str) -> None:
            try:
                self._region(region)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(exc)

        threads = [threading.Thread(target=region_run, args=(r,), daemon=True) for r in self.regions]
        for thread in threads:
            thread.start()
        try:
            for thread in threads:
                while thread.is_alive():
                    thread.join(0.2)
        except KeyboardInterrupt:  # Ctrl-C, SIGTERM: the executions would go on (and bill) without us
            stopped = self.stop_executions()
            print(f"cloudless-run: stopped {stopped} running execution(s) of the run", file=sys.stderr)
            raise
        if errors:
            raise errors[0]
        return self.regions

    def stop_executions(self) -> int:
        """StopExecution for every execution of the run still running (a function invoked by one finishes
        the range it runs; nothing new starts); how many were stopped."""
        stopped = 0
        for region, followed in self.regions.items():
            for record in followed.executions:
                if "status" in record:
                    continue
                try:
                    self.clients[region].stop_execution(
                        executionArn=record["arn"], error="Cloudless.Interrupted", cause="cloudless-run was stopped"
                    )
                    stopped += 1
                except Exception as exc:  # noqa: BLE001 - botocore's errors (one ended meanwhile): say, go on
                    why = _one_line(exc)
                    print(f"cloudless-run: {region}: could not stop {record['name']}: {why}", file=sys.stderr)
        return stopped

    def _region(self, region: str) -> None:
        followed, client = self.regions[region], self.clients[region]
        document = ExecutionInput(
            start=0, stop=followed.stop, attempt=0, time_limit_s=self.time_limit_s, run=self.run_id
        )
        while True:
            number = len(followed.executions)
            name = f"{self.run_id}-{number}"[-EXECUTION_NAME_LIMIT:]
            try:
                started = client.start_execution(
                    stateMachineArn=followed.stack.state_machine, name=name, input=json.dumps(document.to_json())
                )
            except Exception as exc:  # noqa: BLE001 - botocore's errors: one line
                raise RunError(f"{region}: could not start {followed.stack.state_machine}: {_one_line(exc)}") from None
            record: dict[str, Any] = {"name": name, "input": document.to_json(), "arn": started["executionArn"]}
            followed.executions.append(record)
            described = self._wait(region, started["executionArn"])
            record["status"] = described["status"]
            if described["status"] == "SUCCEEDED":
                output = json.loads(described.get("output") or "{}")
                record["output"] = output
                # A worker that diverged (or found that another did) returns instead of raising: the
                # execution succeeds, and the function that found out why wrote the abort record.
                aborted = followed.channel.try_get(protocol.abort_key(protocol.namespace(self.run_id, region)))
                if aborted is not None:
                    raise RunError(f"{region}: {protocol.AbortRecord.decode(aborted).message}")
                reached = int(output.get("iteration", followed.stop))
                self._follow(region, reached)
                if reached >= followed.stop:
                    return
                following = document.continued(output)
                if reached <= document.start:
                    # No progress: every round's workers answered as duplicates of an invocation of this
                    # attempt that holds the range's claim and died without a result. A new attempt
                    # claims anew (from the newest checkpoint, as after a failed execution).
                    if followed.retries >= self.retries:
                        raise RunError(f"{region}: execution {name} made no progress from iteration {reached}")
                    followed.retries += 1
                    following = replace(following, attempt=document.attempt + 1)
                document = following
                continue
            record["error"] = f"{described.get('error', '')}: {_cause(described.get('cause', ''))}".strip(": ")
            if described.get("error") == RUN_STOPPED_ERROR:  # a worker stopped the run: no retry mends it
                raise RunError(f"{region}: execution {name} stopped: {described.get('cause') or 'no cause given'}")
            aborted = followed.channel.try_get(protocol.abort_key(protocol.namespace(self.run_id, region)))
            if aborted is not None:  # a function recorded why (its model's code raised): a retry would too
                raise RunError(f"{region}: {protocol.AbortRecord.decode(aborted).message}")
            if followed.retries >= self.retries:
                raise RunError(
                    f"{region}: execution {name} {described['status'].lower()}: {record['error'] or 'no cause given'} "
                    f"(attempt {document.attempt + 1} of {self.retries + 1})"
                )
            followed.retries += 1
            resume = self._resume_point(region, followed.next_iteration)
            self._forget(region, resume, followed.next_iteration + 1)
            document = replace(document, attempt=document.attempt + 1, start=resume)

    def _wait(self, region: str, arn: str) -> dict[str, Any]:
        client = self.clients[region]
        while True:
            described = client.describe_execution(executionArn=arn)
            self._follow(region, self.regions[region].stop)
            if described["status"] in FINISHED:
                return described
            time.sleep(self.poll_s)

    def _follow(self, region: str, until: int) -> None:
        """Read the last stage's reports of the iterations done since the last look."""
        followed = self.regions[region]
        last = self.workflow.region(region).functions[-1]
        namespace = protocol.namespace(self.run_id, region)
        while followed.next_iteration < min(until, followed.stop):
            iteration = followed.next_iteration
            reports = []
            for replica in range(last.replicas):
                data = followed.channel.try_get(protocol.metrics_key(namespace, iteration, replica))
                if data is None:
                    return
                reports.append(protocol.MetricsReport.decode(data))
            losses = [x for r in reports for x in r.losses if x is not None]
            loss = sum(losses) / len(losses) if losses else math.nan
            followed.progress.append({"iteration": iteration, "loss": None if math.isnan(loss) else loss})
            self.on_progress(region, iteration, loss)
            followed.next_iteration += 1

    def _resume_point(self, region: str, reached: int) -> int:
        """The newest iteration up to `reached` at which every stage holds a checkpoint (0: none)."""
        followed = self.regions[region]
        functions = self.workflow.region(region).functions
        namespace = protocol.namespace(self.run_id, region)
        for at in range(min(reached, followed.stop), 0, -1):
            if all(followed.channel.exists(protocol.state_key(namespace, f.stage, at)) for f in functions):
                return at
        return 0

    def _forget(self, region: str, first: int, stop: int) -> None:
        """A failed execution's markers from `first` on: its iterations run again with a new attempt."""
        followed = self.regions[region]
        namespace = protocol.namespace(self.run_id, region)
        followed.channel.delete(protocol.abort_key(namespace))
        for iteration in range(first, min(stop, followed.stop) + 1):
            followed.channel.delete(protocol.stop_key(namespace, iteration))
            for function in self.workflow.region(region).functions:
                for replica in range(function.replicas):
                    followed.channel.delete(protocol.done_key(namespace, function.name, replica, iteration))
        followed.next_iteration = min(followed.next_iteration, first)
        del followed.progress[first:]


def drive(args: argparse.Namespace, build: Path, workflow: Workflow, iterations: int, out: Path) -> int:
    """`cloudless-run BUILD --invoker lambda --stack ...`: the exit status (2: bad input, 1: failed)."""
    import boto3

    from .run import fail, final_model  # the runner's own pieces (imported here: run imports this module)

    if args.storage:
        return fail("--storage: with --stack the storage is the stack's bucket")
    if args.resume:
        return fail("--resume: not with --stack yet; start the run again")
    if len(workflow.regions) > 1 and iterations != workflow.run.iterations:
        return fail("--iterations: a workflow of several regions trains its planned iterations on a stack")
    try:
        names = stack_names(workflow, list(args.stack))
        stacks = {
            region.name: read_stack(
                boto3.client("cloudformation", region_name=aws_region(region.name)),
                names[region.name],
                workflow,
                region,
            )
            for region in workflow.regions
        }
    except (ValueError, DeployError) as exc:
        return fail(str(exc))
    run_id = args.run_id or protocol.new_run_id()
    channels: dict[str, Channel] = {}
    try:
        model = recorded_model_file(workflow, args.model)
        for region in workflow.regions:
            channels[region.name] = RetryingChannel(open_channel(stacks[region.name].storage(workflow)))
            staged = stage_data(
                channels[region.name], region.name, model, sources=region.data_sources, name=data_name(region)
            )
            if not args.quiet:
                print(f"{describe_staged(staged)} in s3://{stacks[region.name].bucket}", flush=True)
        weights = stage_run_weights(model, workflow.regions, channels, run_id)  # a staged build's parameters
        if weights is not None and not args.quiet:
            print(weights, flush=True)
    except (DataError, ValueError) as exc:
        return fail(str(exc))
    settings = RunSettings(iterations=iterations, run_id=run_id)
    controller = Controller(workflow, channels[workflow.regions[0].name], _NoInvoker(), settings)
    totals = {region.name: controller.region_iterations(region) for region in workflow.regions}
    limit = args.time_limit or float(max(1, min(f.timeout_s for _, f in workflow.functions()) - 30))
    every = args.log_every or max(1, iterations // 20)

    def report(region: str, iteration: int, loss: float) -> None:
        done = iteration + 1
        if not args.quiet and (done % every == 0 or done == totals[region]):
            where = f"{region}  " if len(workflow.regions) > 1 else ""
            print(f"{where}iteration {done:>6}/{totals[region]}  loss {loss:.4f}", flush=True)

    driver = Driver(
        workflow,
        stacks,
        channels,
        run_id=run_id,
        iterations=totals,
        time_limit_s=float(limit),
        retries=args.retries,
        poll_s=POLL_S,
        on_progress=report,
    )
    if not args.quiet:
        for name, stack in stacks.items():
            print(f"run {run_id} on stack {stack.name} ({name}): {totals[name]} iterations", flush=True)
    began = time.time()
    failure: RunError | None = None
    model_files = ""
    try:
        followed = driver.run()
    except RunError as exc:
        failure, followed = exc, driver.regions
    metrics = RunMetrics(
        run_id=run_id,
        invoker="lambda",  # --invoker lambda --stack: the deployed state machines
        status="done" if failure is None else "failed",
        seconds=time.time() - began,
        error=None if failure is None else str(failure),
        regions={
            name: {
                "stack": f.stack.name,
                "bucket": f.stack.bucket,
                "iterations": f.stop,
                "executions": f.executions,
                "retries": f.retries,
                "progress": f.progress,
            }
            for name, f in followed.items()
        },
    )
    if failure is None:
        state = final_model(build, lambda region: channels[region], workflow, run_id, totals)  # each region's bucket
        keyed, _ = model_file_state(build, state)
        model_files = save_trained_model(out, build, workflow.regions, keyed)
    metrics.write(out)
    if failure is not None:
        print(f"cloudless-run: the run failed: {failure}", file=sys.stderr)
        return 1
    if not args.keep_storage:
        for name, channel in channels.items():
            try:
                channel.delete_prefix(protocol.namespace(run_id, name) + "/")
            except Exception as exc:  # noqa: BLE001 - the run itself is done
                print(f"cloudless-run: could not delete the run's keys in {name}: {_one_line(exc)}", file=sys.stderr)
    executions = sum(len(f.executions) for f in followed.values())
    print(
        f"trained {' + '.join(str(totals[r]) for r in totals)} iterations on the stack in {metrics.seconds:.1f} s "
        f"({executions} execution(s)); wrote {out}/: metrics.json, {model_files}"
    )
    return 0
