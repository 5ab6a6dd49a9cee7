"""Deploy-and-train: `cloudless-run BUILD --invoker lambda --stack NAME` trains on a deployed SAM stack.

Per region it reads the stack's outputs with CloudFormation (the run's bucket, the state machine, the
functions' names and ARNs: cloudless.ir.deployment), stages the region's training data into the bucket
(under the workflow's storage prefix, where the functions read it), and trains under the run's
coordinator (`StateMachineController`: controller.py's control plane, coordinator.py's plans), every
region at once: each range the coordinator plans for a region is one execution of the region's state
machine of one round, whose input {"run", "attempt", "time_limit_s", "start", "stop", "plan", "workers",
"max_rounds"} carries the run name (so that a new run in the same bucket trains anew), the attempt, the
time limit and the region's plan now (re-planned as capacities change and regions leave). Its progress
is what the last stage reports in storage. A failed execution is started again (attempt + 1, --retries
times) from the newest iteration every stage has a checkpoint of, after the completion markers of the
iterations it left are deleted; with several regions, a region out of retries leaves the run and the
others take its work. At the end the trained model is fetched into OUT/model.safetensors, with
OUT/metrics.json, and the run's keys are deleted (the staged data stays).

Credentials and regions are boto3's own (environment, profile, role); AWS_ENDPOINT_URL points every client
at another endpoint (the tests and the rehearsal use moto).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

from ...ir import protocol
from ...ir.catalog import AWS_REGION_PREFIX
from ...ir.deployment import (
    BUCKET_OUTPUT,
    RUN_STOPPED_ERROR,
    STATE_MACHINE_OUTPUT,
    ExecutionInput,
    function_arn_output,
    function_output,
    stack_name,
)
from ...ir.workflow import Region, Workflow
from ..control.controller import Controller
from ..control.invokers import Handle, Invocation, Invoker
from ..control.retrying_channel import RetryingChannel, StorageError
from ..control.run import fail, failure_line, final_model, run_settings
from ..control.run_outputs import left_figures
from ..control.run_state import Progress, RegionGone, RegionRun, RunDiverged, RunError, RunMetrics, RunSettings
from ..control.staged_weights import save_trained_model
from ..control.staging import (
    DataError,
    changed_since_compile,
    describe_staged,
    evaluate,
    model_file_state,
    recorded_model_file,
    stage_data,
    stage_run_weights,
)
from ..function.data import data_name
from ..storage.channels import Channel, open_channel
from ..storage.transient import RIDE_OUT_S, aws_client, is_transient_or_refused_credentials, ride_out

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
    arns: dict[str, str] = field(default_factory=dict)  # stage function -> its ARN, as the state machine has it

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
        {f.name: outputs.get(function_arn_output(f.name), outputs[function_output(f.name)]) for f in region.functions},
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


_T = TypeVar("_T")


def _ridden_out(call: Callable[[], _T]) -> _T:
    """A driver's Step Functions request: its transient errors, and credentials refused for seconds, ridden
    out for up to `transient.RIDE_OUT_S` (above botocore's own retries)."""
    return ride_out(call, RIDE_OUT_S, is_transient_or_refused_credentials)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class _NoInvoker(Invoker):
    """The state machines invoke the functions: the controller starts executions, not invocations."""

    name = "Step Functions"

    def start(self, invocation: Invocation) -> Handle:
        raise AssertionError("the state machine invokes the functions")


#: the fields of `protocol.Invocation` that say what the coordinator planned for a region (an
#: execution's `plan`, which every invocation of it carries)
PLAN_FIELDS = ("timeout", "iterations", "rounds", "since", "first_round", "replicas", "weight", "region_timeout")


class StateMachineController(Controller):
    """The run's control plane over deployed stacks: the coordinator's ranges (controller.py and
    coordinator.py: each region's plan, re-planned as capacity changes and regions leave) each run as one
    execution of the region's state machine of one round (`max_rounds` 1), carrying the region's plan
    (`plan`) and the workers of its replicas now (`workers`). An execution that fails is started again with
    the next attempt from the newest iteration every stage holds a checkpoint of; one that made no progress
    (every worker answered as a duplicate of an invocation that died) with the next attempt as it was.
    `take_down`: fault injection (`--fail-region` in a rehearsal), the region's functions stop answering."""

    def __init__(
        self,
        workflow: Workflow,
        stacks: dict[str, Stack],
        channels: dict[str, Channel],
        settings: RunSettings,
        *,
        stepfunctions: Callable[[str], Any] | None = None,
        on_progress: Callable[[Progress], None] = lambda progress: None,
        take_down: Callable[[str], None] | None = None,
    ) -> None:
        first = workflow.regions[0].name
        super().__init__(workflow, channels[first], _NoInvoker(), settings, on_progress=on_progress, channels=channels)
        make = stepfunctions or (lambda region: aws_client("stepfunctions", region_name=aws_region(region)))
        self.stacks, self.take_down = stacks, take_down
        self.clients = {region: make(region) for region in stacks}
        self.executions: dict[str, list[dict[str, Any]]] = {region: [] for region in stacks}
        # Each region's attempt: raised by each retry, kept by the ranges after it (a new range of an
        # earlier attempt could meet that attempt's claims, held by invocations that died).
        self.attempt = dict.fromkeys(stacks, 0)
        self.stopped = 0  # executions stopped (StopExecution) as the run was interrupted
        # An execution's name is unique in its state machine for 90 days: a resumed run's are new ones.
        self.execution_prefix = settings.run_id + (f"-resumed{int(time.time())}" if settings.resume else "")

    def stop_interrupted(self) -> int:
        """Resuming: stop the executions of the run that still run (its driver died without stopping them);
        their functions finish the range they run, and nothing new starts. How many."""
        stopped = 0
        for name, stack in self.stacks.items():
            pages = (
                self.clients[name]
                .get_paginator("list_executions")
                .paginate(stateMachineArn=stack.state_machine, statusFilter="RUNNING")
            )
            for page in pages:
                for execution in page["executions"]:
                    if execution["name"].startswith(f"{self.settings.run_id}-"):
                        self._stop_execution(name, {"name": execution["name"], "arn": execution["executionArn"]})
                        stopped += 1
        return stopped

    def _document(self, region: Region, start: int, stop: int, attempt: int) -> ExecutionInput:
        """The execution's input: the range, and the region's plan and workers now."""
        event = self._event(region.functions[0], 0, start, stop, attempt).to_json()
        plan = {name: event[name] for name in PLAN_FIELDS if name in event}
        arns = self.stacks[region.name].arns
        workers = tuple(
            {"function": arns[f.name], "stage": f.stage, "replica": replica}
            for f, count in zip(region.functions, self.plans[region.name].replicas, strict=True)
            for replica in range(count)
        )
        return ExecutionInput(
            start=start,
            stop=stop,
            attempt=attempt,
            time_limit_s=event["time_limit_s"],
            run=self.settings.run_id,
            plan=plan,
            workers=workers,
            max_rounds=1,
        )

    def _invoke_range(self, region: Region, start: int, stop: int, record: RegionRun) -> int:
        """Run start..stop-1 (as far as one round of the machine goes) as an execution; where it stopped."""
        name = region.name
        client, stack = self.clients[name], self.stacks[name]
        last = region.functions[-1]
        document = self._document(region, start, stop, self.attempt[name])
        next_iteration = start
        running: dict[str, Any] | None = None
        try:
            while True:
                number = len(self.executions[name])
                execution = f"{self.execution_prefix}-{number}"[-EXECUTION_NAME_LIMIT:]
                try:
                    # A retried start after a lost answer is StartExecution's own: same name and input, same execution
                    started = _ridden_out(
                        partial(
                            client.start_execution,
                            stateMachineArn=stack.state_machine,
                            name=execution,
                            input=json.dumps(document.to_json()),
                        )
                    )
                except Exception as exc:  # noqa: BLE001 - botocore's errors: one line
                    raise RunError(f"{name}: could not start {stack.state_machine}: {_one_line(exc)}") from None
                running = {"name": execution, "input": document.to_json(), "arn": started["executionArn"]}
                self.executions[name].append(running)
                described, next_iteration = self._wait(region, running, document, next_iteration, record)
                running["status"] = described["status"]
                if described["status"] == "SUCCEEDED":
                    output = json.loads(described.get("output") or "{}")
                    running["output"] = output
                    running = None
                    # A worker that diverged (or found that another did) returns instead of raising: the
                    # execution succeeds, and the function that found out why wrote the abort record.
                    self._raise_recorded(name)
                    reached = int(output.get("iteration", document.stop))
                    if reached > document.start:
                        self._follow(name, last, next_iteration, reached, record, wait=True)
                        self._forget_range(region, document.start, self._attempts(region, document.attempt))
                        return reached
                    # No progress: every worker answered as a duplicate of an invocation of this attempt that
                    # holds the range's claim and died without a result. A new attempt claims anew.
                    self._retry(name, f"execution {execution} made no progress from iteration {reached}", record)
                    self._abandon_attempt(name)
                    document = replace(document, attempt=self.attempt[name])
                    continue
                running = None
                error = f"{described.get('error', '')}: {_cause(described.get('cause', ''))}".strip(": ")
                self.executions[name][-1]["error"] = error
                if described.get("error") == RUN_STOPPED_ERROR:  # a worker stopped the run: no retry mends it
                    self._raise_recorded(name)
                    cause = described.get("cause") or "no cause given"
                    raise RunDiverged(f"{name}: execution {execution} stopped: {cause}")
                self._raise_recorded(name)  # a function recorded why (its model's code raised): a retry would too
                status = described["status"].lower()
                self._retry(name, f"execution {execution} {status}: {error or 'no cause given'}", record, document)
                resume = self._resume_point(region, min(next_iteration, document.stop))
                self._forget(region, resume, next_iteration + 1)
                next_iteration = min(next_iteration, resume)
                record.progress[:] = [entry for entry in record.progress if entry.iteration < resume]
                self._abandon_attempt(name)
                document = self._document(region, resume, stop, self.attempt[name])
                with self.lock:
                    self.ranges[name] = (resume, stop)  # a re-plan's cut names this execution's range
        except BaseException:
            if running is not None:
                self._stop_execution(name, running)
            with contextlib.suppress(Exception):  # best effort: the key timeout ends them otherwise
                self._abandon_attempt(name)
            raise

    def _abandon_attempt(self, name: str) -> None:
        """The region's next attempt: the invocations of the current one that still wait (for keys the failed
        execution's worker never wrote) find the newer number and stop (`protocol.attempt_key`)."""
        self.attempt[name] += 1
        key = protocol.attempt_key(self.namespace(name))
        self.storage(name).put(key, str(self.attempt[name]).encode())

    def _attempts(self, region: Region, attempt: int) -> dict[tuple[str, int], int]:
        """Every worker of the range and its last attempt (the markers to delete)."""
        replicas = self.plans[region.name].replicas
        return {(f.name, r): attempt for f, count in zip(region.functions, replicas, strict=True) for r in range(count)}

    def _retry(self, name: str, what: str, record: RegionRun, document: ExecutionInput | None = None) -> None:
        """Count a retry of the region's range, or end it: the run (one region) or the region's part (several)."""
        if record.retries >= self.settings.retries:
            attempt = f" (attempt {document.attempt + 1} of {self.settings.retries + 1})" if document else ""
            message = f"{name}: {what}{attempt}"
            if len(self.workflow.regions) > 1:  # the region leaves; the others go on
                raise RegionGone(message, tell=True)
            raise RunError(message)
        record.retries += 1

    def _raise_recorded(self, name: str) -> None:
        recorded = self._abort_record(name)
        if recorded is None:
            return
        if recorded.reason == "left":
            raise RegionGone(recorded.message, tell=False)
        raise RunError(f"{name}: {recorded.message}", resumable=False)

    def _wait(
        self, region: Region, running: dict[str, Any], document: ExecutionInput, next_iteration: int, record: RegionRun
    ) -> tuple[dict[str, Any], int]:
        """Follow the execution until it ends: its progress, the run's storage, the other regions, Ctrl-C and
        the injected region failures; (its description, the next iteration without a report)."""
        name, client = region.name, self.clients[region.name]
        last = region.functions[-1]
        last_look = time.time()
        while True:
            if self.cancelled.is_set():
                raise RunError("interrupted")
            try:
                described = _ridden_out(lambda: client.describe_execution(executionArn=running["arn"]))
            except Exception as exc:  # noqa: BLE001 - botocore's errors: one line
                raise RunError(f"{name}: could not follow {running['name']}: {_one_line(exc)}") from None
            next_iteration = self._follow(name, last, next_iteration, document.stop, record)
            for failure in self.settings.region_failures:  # also where the execution just reached it
                if failure.region == name and document.start <= failure.iteration <= next_iteration:
                    if self.take_down is not None:
                        self.take_down(name)
                    # It says nothing: the other regions find out by the region timeout.
                    raise RegionGone(f"{name} stopped answering at iteration {failure.iteration}", tell=False)
            if described["status"] in FINISHED:
                return described, next_iteration
            now = time.time()
            if now - last_look > self.settings.alive_check_s:
                self._check_alive(region, next_iteration)
                if len(self.workflow.regions) > 1:
                    with self.lock:
                        self._watch_departures()
                    if self.plans[name].left:
                        raise RegionGone(self.plans[name].left, tell=False)
                last_look = now
            time.sleep(self.settings.poll_s)

    def _stop_execution(self, name: str, running: dict[str, Any]) -> None:
        """StopExecution: a function invoked by it finishes the range it runs; nothing new starts."""
        try:
            _ridden_out(
                partial(
                    self.clients[name].stop_execution,
                    executionArn=running["arn"],
                    error="Cloudless.Interrupted",
                    cause="cloudless-run was stopped",
                )
            )
            running["status"] = "ABORTED"
            self.stopped += 1
        except Exception as exc:  # noqa: BLE001 - botocore's errors (it ended meanwhile): say, go on
            print(f"cloudless-run: {name}: could not stop {running['name']}: {_one_line(exc)}", file=sys.stderr)

    def _resume_point(self, region: Region, reached: int) -> int:
        """The newest iteration up to `reached` at which every stage holds a checkpoint (0: none)."""
        namespace = self.namespace(region.name)
        channel = self.storage(region.name)
        for at in range(reached, 0, -1):
            if all(channel.exists(protocol.state_key(namespace, f.stage, at)) for f in region.functions):
                return at
        return 0

    def _forget(self, region: Region, first: int, stop: int) -> None:
        """A failed execution's markers from `first` on: its iterations run again with a new attempt."""
        namespace = self.namespace(region.name)
        channel = self.storage(region.name)
        channel.delete(protocol.abort_key(namespace))
        for iteration in range(first, stop + 1):
            channel.delete(protocol.stop_key(namespace, iteration))
            for function in region.functions:
                for replica in range(function.replicas):
                    channel.delete(protocol.done_key(namespace, function.name, replica, iteration))


def drive(
    args: argparse.Namespace,
    build: Path,
    workflow: Workflow,
    iterations: int,
    out: Path,
    take_down: Callable[[str], None] | None = None,
    stepfunctions: Callable[[str], Any] | None = None,
) -> int:
    """`cloudless-run BUILD --invoker lambda --stack ...`: the exit status (2: bad input, 1: failed).
    `take_down`: a rehearsal's way to make a region's functions stop answering (`--fail-region`);
    `stepfunctions`: a rehearsal's Step Functions client of a region (faults injected into it)."""
    if args.storage:
        return fail("--storage: with --stack the storage is the stack's bucket")
    try:
        names = stack_names(workflow, list(args.stack))
        stacks = {
            region.name: read_stack(
                aws_client("cloudformation", region_name=aws_region(region.name)),
                names[region.name],
                workflow,
                region,
            )
            for region in workflow.regions
        }
    except (ValueError, DeployError) as exc:
        return fail(str(exc))
    run_id = args.resume or args.run_id or protocol.new_run_id()
    channels: dict[str, Channel] = {}
    try:
        model = recorded_model_file(workflow, args.model)
        for region in workflow.regions:
            channels[region.name] = RetryingChannel(open_channel(stacks[region.name].storage(workflow)))
            staged = stage_data(
                channels[region.name],
                region.name,
                model,
                sources=region.data_sources,
                name=data_name(region),
                deployed=not args.rehearse,  # a rehearsal's functions run here, and read this machine's folders
                granted=region.data_in_place,
            )
            if not args.quiet:
                print(f"{describe_staged(staged)} in s3://{stacks[region.name].bucket}", flush=True)
            changed = changed_since_compile(region, staged)
            if changed:
                print(f"cloudless-run: {changed}", file=sys.stderr, flush=True)
        weights = stage_run_weights(model, workflow.regions, channels, run_id)  # a staged build's parameters
        if weights is not None and not args.quiet:
            print(weights, flush=True)
    except (DataError, ValueError) as exc:
        return fail(str(exc))
    settings = run_settings(args, iterations, run_id, resume=bool(args.resume), poll_s=POLL_S)
    several = len(workflow.regions) > 1
    every = args.log_every or max(1, iterations // 20)
    totals: dict[str, int] = {}

    def report(progress: Progress) -> None:
        done = progress.iteration + 1
        totals[progress.region] = controller.plans[progress.region].end  # re-planned as the run goes
        if not args.quiet and (done % every == 0 or done == totals[progress.region]):
            where = f"{progress.region}  " if several else ""
            print(f"{where}iteration {done:>6}/{totals[progress.region]}  loss {progress.loss:.4f}", flush=True)

    try:
        controller = StateMachineController(
            workflow, stacks, channels, settings, on_progress=report, take_down=take_down, stepfunctions=stepfunctions
        )
    except RunError as exc:
        return fail(str(exc))
    totals.update({region.name: controller.region_iterations(region) for region in workflow.regions})
    if args.resume:
        resumed = {region.name: controller.start_of(region) for region in workflow.regions}
        if not any(resumed.values()):
            buckets = ", ".join(f"s3://{stack.bucket}" for stack in stacks.values())
            return fail(f"--resume {run_id}: {buckets} holds no checkpoint of that run; start it again")
        try:
            stopped = controller.stop_interrupted()
        except Exception as exc:  # noqa: BLE001 - botocore's errors: one line
            return fail(f"--resume {run_id}: could not list the run's executions: {_one_line(exc)}")
        where = ", ".join(f"{name} from iteration {at}" for name, at in resumed.items())
        also = f" (stopped {stopped} execution(s) of it still running)" if stopped else ""
        print(f"resuming run {run_id}: {where}{also}", flush=True)
    if not args.quiet:
        for name, stack in stacks.items():
            print(f"run {run_id} on stack {stack.name} ({name}): {totals[name]} iterations", flush=True)
    began = time.time()
    failure: RunError | StorageError | None = None
    model_files = ""
    try:
        records = controller.run()
    except (RunError, StorageError) as exc:
        failure, records = exc, controller.records
    except KeyboardInterrupt:  # Ctrl-C, SIGTERM: the executions would go on (and bill) without us
        print(f"cloudless-run: stopped {controller.stopped} running execution(s) of the run", file=sys.stderr)
        raise
    stayed = {name: at for name, at in controller.ends.items() if not controller.plans[name].left} or totals
    metrics = RunMetrics(
        run_id=run_id,
        invoker="lambda",  # --invoker lambda --stack: the deployed state machines
        status="done" if failure is None else "failed",
        seconds=time.time() - began,
        error=None if failure is None else str(failure),
        regions={
            name: {
                "stack": stack.name,
                "bucket": stack.bucket,
                "iterations": controller.ends.get(name, totals[name]),
                "executions": controller.executions[name],
                "retries": records.get(name, RegionRun()).retries,
                "progress": [
                    {"iteration": entry.iteration, "loss": None if math.isnan(entry.loss) else entry.loss}
                    for entry in records.get(name, RegionRun()).progress
                ],
            }
            | ({"round_ends": list(controller.round_ends(name))} if several else {})
            | (left_figures(controller, name) if controller.plans[name].left else {})
            for name, stack in stacks.items()
        },
    )
    if several:
        metrics.measured = {"elastic": controller.events}
    test = None
    if failure is None:
        state = final_model(build, controller.storage, workflow, run_id, stayed)  # each region's bucket
        keyed, _ = model_file_state(build, state)
        model_files = save_trained_model(out, build, workflow.regions, keyed)
        first = workflow.regions[0].name
        test = evaluate(build, workflow, first, controller.storage(first), state)  # as cloudless-run's
        if test is not None:
            metrics.measured = {**(metrics.measured or {}), "test": test}
    metrics.write(out)
    if failure is not None:
        print(failure_line(args, run_id, failure), file=sys.stderr)
        return 1
    if not args.keep_storage:
        try:
            controller.clean_up()  # the trained model is in OUT; the staged data stays for the next run
        except Exception as exc:  # noqa: BLE001 - the run itself is done
            print(f"cloudless-run: could not delete the run's keys: {_one_line(exc)}", file=sys.stderr)
    executions = sum(len(e) for e in controller.executions.values())
    trained = " + ".join(
        f"{controller.ends.get(name, totals[name])}{f' ({name})' if several else ''}" for name in stacks
    )
    print(
        f"trained {trained} iterations on the stack in {metrics.seconds:.1f} s "
        f"({executions} execution(s)); wrote {out}/: metrics.json, {model_files}"
    )
    if test:
        figures = f"test loss {test['loss']:.4f}"
        if "accuracy" in test:
            figures += f", accuracy {test['accuracy']:.1%}"
        print(f"{figures} on {test['samples']} samples")
    return 0
