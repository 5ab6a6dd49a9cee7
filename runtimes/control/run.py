"""A run under the controller: stage the data, invoke the functions (local processes, an OpenFaaS gateway
or Lambda), and write the outputs (`metrics.json`, `trace.json`, the trained model) once it ends.

`cloudless-run`'s arguments are read and checked by runtimes/cli.py; `train` is what it calls for a run
whose iterations this machine's controller drives, and `final_model` assembles the trained model from
storage for every driver (clouds/deploy.py too).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ...ir import protocol
from ...ir.deployment import lambda_function_name
from ...ir.workflow import Function, Workflow
from ..function.data import data_name
from ..storage.channels import Channel, open_channel
from ..storage.emulation import EmulatedChannel, Resources
from ..storage.tensors import unpack
from .controller import Controller
from .invokers import (
    Invocation,
    Invoker,
    LambdaInvoker,
    LocalProcessInvoker,
    OpenFaaSInvoker,
    RegionInvokers,
    gateway_urls,
)
from .retrying_channel import RetryingChannel, StorageError
from .run_outputs import chrome_trace, left_figures, several_regions_figures, summarise
from .run_state import Progress, RegionRun, RunError, RunMetrics, RunSettings
from .staged_weights import save_trained_model
from .staging import (
    DataError,
    changed_since_compile,
    describe_staged,
    evaluate,
    frozen_weights,
    model_file_state,
    newer_global_version,
    recorded_model_file,
    save_peft_adapter,
    stage_data,
    stage_run_weights,
    trained_state,
    untouched_tensors,
)
from .storage_locations import shown, storage_locations


def fail(message: str) -> int:
    print(f"cloudless-run: {message}", file=sys.stderr)
    return 2


def deployed_lambda_names(workflow: Workflow, region: str) -> dict[str, str]:
    """Each function of the region by the name its SAM template deploys it under (mlp-digits-s0-aws-us-east-1)."""
    return {f.name: lambda_function_name(f.name, region) for f in workflow.region(region).functions}


def resources_of(workflow: Workflow, args: argparse.Namespace) -> Callable[[Function], Resources | None]:
    """Per function, what --emulate / --bandwidth / --latency-ms give it (None: the machine's own)."""
    if not (args.emulate or args.bandwidth or args.latency_ms):
        return lambda function: None
    latency = {region.name: region.request_latency_s for region in workflow.regions}
    wan = bool(args.emulate and len(workflow.regions) > 1)

    def resources(function: Function) -> Resources:
        mb_per_s = args.bandwidth or (function.network_mb_per_s if args.emulate else None)
        region = Path(function.package).parts[1]  # regions/<region>/functions/<function>
        own = latency.get(region, workflow.regions[0].request_latency_s)
        return Resources(
            bytes_per_s=mb_per_s * 1e6 if mb_per_s else None,
            latency_s=args.latency_ms / 1000 if args.latency_ms is not None else (own if args.emulate else 0.0),
            vcpus=function.cpu_millis / 1000 if args.emulate else None,
            wan=wan,
        )

    return resources


def final_model(
    build: Path,
    channel: Channel | Callable[[str], Channel],
    workflow: Workflow,
    run_id: str,
    iterations: dict[str, int],
) -> dict[str, torch.Tensor]:
    """The trained model (original names). Several regions: after model averaging or synchronous
    SGD every region holds the same model; under ASGD-GA each stage's newest global version is the
    model, and the region that wrote it last holds it (or, where that region left the run after it,
    the server's storage does). `channel`: the storage, or per region its own. Frozen parameters are
    the packages' own (`build`)."""
    storage_of = channel if callable(channel) else lambda region: channel
    regions = [region for region in workflow.regions if region.name in iterations]  # those that stayed
    stages = regions[0].stages
    first = regions[0].name
    state = frozen_weights(build, regions[0], storage_of(first), protocol.namespace(run_id, first))
    if len(workflow.regions) == 1 or workflow.sync.inter_region != "asgd-ga":
        name = regions[0].name
        state.update(trained_state(storage_of(name), protocol.namespace(run_id, name), stages, iterations[name]))
        return state
    for s in range(stages):
        newest: tuple[int, dict[str, torch.Tensor]] | None = None
        for entry in regions:
            key = protocol.state_key(protocol.namespace(run_id, entry.name), s, iterations[entry.name])
            values = unpack(storage_of(entry.name).get(key, 60))
            version = int(values.get(protocol.BASE_VERSION, torch.tensor(0)))
            if newest is None or version > newest[0]:
                newest = (version, values)
        assert newest is not None
        state.update(protocol.module_values(newest[1]))
        server = workflow.sync.server
        if server is not None:
            later = newer_global_version(storage_of(server), protocol.namespace(run_id, server), s, newest[0])
            state.update(later or {})
    return state


def resume_hint(args: argparse.Namespace, run_id: str) -> str:
    """How to continue a failed run from its checkpoints: the command, with the options that name the same
    build, storage, output, functions and training length (a storage password masked; the token by its file)."""
    command = ["cloudless-run", str(args.build), "--resume", run_id]
    if args.iterations:
        command += ["--iterations", str(args.iterations)]
    if args.out:
        command += ["--out", str(args.out)]
    for where in args.storage or ():
        command += ["--storage", shown(where)]
    if args.model:
        command += ["--model", str(args.model)]
    if args.invoker != "local":
        command += ["--invoker", args.invoker, *(["--rehearse"] if args.rehearse else [])]
    for gateway in () if args.rehearse else args.gateway or ():  # a rehearsal's gateways are new each time
        command += ["--gateway", gateway]
    if args.token_file:
        command += ["--token-file", str(args.token_file)]
    for stack in args.stack or ():
        command += ["--stack", stack]
    return f"to continue it: {shlex.join(command)}"


def failure_line(args: argparse.Namespace, run_id: str, failure: BaseException) -> str:
    """The failed run's last line: its cause and, when it can be continued, how (`resume_hint`). A Lambda
    rehearsal's stacks and buckets are gone once it ends: nothing is left to resume there."""
    resumable = not isinstance(failure, RunError) or failure.resumable
    if not resumable or (args.rehearse and args.invoker == "lambda"):
        return f"cloudless-run: the run failed: {failure}"
    return f"cloudless-run: the run failed: {str(failure).rstrip('.')}; {resume_hint(args, run_id)}"


def run_settings(args: argparse.Namespace, iterations: int, run_id: str, **driver: Any) -> RunSettings:
    """The run's settings from cloudless-run's arguments (cli.py checked them), as every driver reads them;
    `driver`: what only one driver sets (faults and resuming locally, the state machines' poll period)."""
    return RunSettings(
        iterations=iterations,
        run_id=run_id,
        time_limit_s=args.time_limit,
        key_timeout_s=args.key_timeout or protocol.DEFAULT_KEY_TIMEOUT_S,
        retries=args.retries,
        region_timeout_s=args.region_timeout or protocol.DEFAULT_REGION_TIMEOUT_S,
        capacity_changes=args.capacity_changes,
        region_failures=args.region_failures,
        **driver,
    )


def train(
    args: argparse.Namespace,
    build: Path,
    workflow: Workflow,
    iterations: int,
    out: Path,
    token: str | None = None,
    take_down: Callable[[str], None] | None = None,
    kill: Callable[[str, Invocation], bool] | None = None,
) -> int:
    """Stage the data, run the workflow, write the outputs into `out`; the exit status. `token`: what the
    OpenFaaS functions require (--invoker openfaas); `take_down`: a rehearsal's way to make a region's
    functions stop answering (--fail-region); `kill`: its way to kill the instance running an invocation of
    a region (--inject-faults)."""
    try:
        locations = storage_locations(workflow, args.storage, out)
    except ValueError as exc:
        return fail(str(exc))
    storage = locations[workflow.regions[0].name]
    # Unique: two runs started in the same second must not share keys or logs.
    run_id = args.resume or args.run_id or protocol.new_run_id()
    regions = workflow.regions
    region = regions[0].name
    try:
        gateways = gateway_urls(workflow, list(args.gateway)) if args.invoker == "openfaas" else {}
    except ValueError as exc:
        return fail(str(exc))
    try:
        # Each region's own storage; its requests are counted (several regions: the controller's cost)
        counters = {name: EmulatedChannel(open_channel(where)) for name, where in locations.items()}
        channels: dict[str, Channel] = {name: RetryingChannel(counter) for name, counter in counters.items()}
        channel: Channel = channels[region]
        model = recorded_model_file(workflow, args.model)
        staged = {
            entry.name: stage_data(
                channels[entry.name], entry.name, model, sources=entry.data_sources, name=data_name(entry)
            )
            for entry in regions
        }
        weights = stage_run_weights(model, regions, channels, run_id)  # a staged build's parameters
        if weights is not None:
            print(weights, flush=True)
    except (DataError, ValueError) as exc:
        return fail(str(exc))
    settings = run_settings(
        args, iterations, run_id, resume=bool(args.resume), fault_rate=args.inject_faults, fault_seed=args.fault_seed
    )
    invoker: Invoker
    if args.invoker == "local":
        invoker = LocalProcessInvoker(
            build.resolve(),
            storage if len(regions) == 1 else locations,
            out / "logs" / run_id,
            resources=resources_of(workflow, args),
            threads=args.threads,
        )
    elif args.invoker == "openfaas":
        invoker = RegionInvokers(
            {
                name: OpenFaaSInvoker(
                    url,
                    channels[name],
                    protocol.namespace(run_id, name),
                    token=token,
                    kill=None if kill is None else partial(kill, name),
                )
                for name, url in gateways.items()
            },
            take_down,
        )
    else:
        invoker = RegionInvokers(
            {
                entry.name: LambdaInvoker(
                    channels[entry.name],
                    protocol.namespace(run_id, entry.name),
                    deployed_lambda_names(workflow, entry.name),
                )
                for entry in regions
            },
            take_down,
        )
    every = args.log_every or max(1, iterations // 20)
    began = time.time()
    # Per region: (time, iterations done) of the last line; the rate excludes start-up.
    last_prints: dict[str, list[float]] = {entry.name: [] for entry in regions}
    totals: dict[str, int] = {}

    def report(progress: Progress) -> None:
        done = progress.iteration + 1
        last_print = last_prints[progress.region]
        if not last_print:
            last_print[:] = [progress.time, done]
        totals[progress.region] = controller.plans[progress.region].end  # re-planned as the run goes
        if args.quiet or (done % every and done != totals[progress.region]):
            return
        rate = ""
        if done > last_print[1]:
            per_s = (done - last_print[1]) * workflow.run.global_batch / max(progress.time - last_print[0], 1e-9)
            rate = f"  {per_s:,.0f} samples/s"
        where = f"{progress.region}  " if len(regions) > 1 else ""
        print(f"{where}iteration {done:>6}/{totals[progress.region]}  loss {progress.loss:.4f}{rate}", flush=True)
        last_print[:] = [progress.time, done]

    try:
        controller = Controller(workflow, channel, invoker, settings, on_progress=report, channels=channels)
    except RunError as exc:
        return fail(str(exc))
    totals.update({entry.name: controller.region_iterations(entry) for entry in regions})
    if args.resume:
        # Several regions: each from its own newest whole checkpoint (what the others sent it since
        # is still in their storage, and it sends the same again).
        resumed = {entry.name: controller.start_of(entry) for entry in regions}
        if not any(resumed.values()):
            return fail(f"--resume {run_id}: {shown(storage)} holds no checkpoint of that run; start it again")
        if len(regions) == 1:
            print(f"resuming run {run_id} from iteration {resumed[region]}", flush=True)
        else:
            where = ", ".join(f"{name} from iteration {at}" for name, at in resumed.items())
            print(f"resuming run {run_id}: {where}", flush=True)
    if not args.quiet:
        for entry in regions:
            functions = entry.functions
            shape = " + ".join(f"{f.replicas}" for f in functions)
            where = f" in {entry.name}" if len(regions) > 1 else ""
            print(
                f"run {run_id}{where}: {len(functions)} stage(s), replicas {shape}, {totals[entry.name]} "
                f"iterations of {workflow.run.global_batch} samples; storage {shown(locations[entry.name])}",
                flush=True,
            )
        for name, data in staged.items():
            print(f"{describe_staged(data)}{f' in {name}' if len(regions) > 1 else ''}", flush=True)
    for entry in regions:  # quiet or not
        changed = changed_since_compile(entry, staged[entry.name])
        if changed:
            print(f"cloudless-run: {changed}", file=sys.stderr, flush=True)
    failure: RunError | StorageError | None = None
    counted = {name: dict(counter.counts) for name, counter in counters.items()}
    interrupted: KeyboardInterrupt | None = None
    try:
        records = controller.run()
    except (RunError, StorageError) as exc:
        failure, records = exc, controller.records
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: metrics.json says how far it got, then main says why
        interrupted, failure, records = exc, RunError("interrupted"), controller.records
    seconds = time.time() - began
    test = None
    stayed = {name: at for name, at in controller.ends.items() if not controller.plans[name].left} or totals
    model_files = "model.safetensors"
    if failure is None:
        state = final_model(build, controller.storage, workflow, run_id, stayed)
        keyed, unused = model_file_state(build, state)
        if unused:  # never trained: as build_model() builds them, so that the file loads strictly
            keyed |= untouched_tensors(model, unused)
        model_files = save_trained_model(out, build, regions, keyed)
        if workflow.data.adapter == "peft":
            try:
                save_peft_adapter(model, keyed, out / "adapter")
            except DataError as exc:
                failure = RunError(f"the model trained, but its adapter was not saved: {exc}")
        test = evaluate(build, workflow, region, channel, state)
    record = records.get(region, RegionRun())
    measured = summarise(record, workflow, settings, seconds, test)
    metrics = RunMetrics(
        run_id=settings.run_id,
        invoker=args.invoker,
        status="done" if failure is None else "interrupted" if interrupted is not None else "failed",
        seconds=seconds,
        error=None if failure is None else str(failure),
        measured=measured,
    )
    if len(regions) > 1:
        metrics.regions = {
            name: {k: v for k, v in summarise(r, workflow, settings, seconds, None).items() if k != "test"}
            | {"iterations": controller.ends.get(name, totals[name]), "round_ends": list(controller.round_ends(name))}
            | (left_figures(controller, name) if controller.plans[name].left else {})
            for name, r in records.items()
        }
        measured.update(several_regions_figures(args, workflow, controller, records, locations, counters, counted))
    metrics.write(out)
    (out / "trace.json").write_text(json.dumps(chrome_trace(record, workflow, began), allow_nan=False) + "\n")
    if failure is None and not args.keep_storage:  # a failed run stays resumable
        try:
            controller.clean_up()  # the trained model is in OUT; the staged data stays for the next run
        except Exception as exc:  # noqa: BLE001 - any back end's error: the run itself is done
            print(f"cloudless-run: could not delete the run's keys from {shown(storage)}: {exc}", file=sys.stderr)
    if interrupted is not None:
        raise interrupted
    if failure is not None:
        print(failure_line(args, run_id, failure), file=sys.stderr)
        return 1
    trained = (
        " + ".join(f"{controller.ends.get(name, totals[name])} ({name})" for name in records)
        if len(records) > 1
        else str(iterations)
    )
    line = f"trained {trained} iterations in {seconds:.1f} s"
    if measured["samples_per_s"]:
        ms = measured["median_iteration_s"] * 1000
        line += f" ({measured['samples_per_s']:,.0f} samples/s, {ms:.1f} ms/iteration)"
    faults, retries = sum(r.faults for r in records.values()), sum(r.retries for r in records.values())
    if faults or retries:
        line += f"; {faults} injected fault(s), {retries} retried invocation(s)"
    print(line)
    if test:
        figures = f"test loss {test['loss']:.4f}"
        if "accuracy" in test:
            figures += f", accuracy {test['accuracy']:.1%}"
        print(f"{figures} on {test['samples']} samples")
    adapter = " adapter/," if workflow.data.adapter is not None else ""
    print(f"wrote {out}/: metrics.json, trace.json, {model_files},{adapter} logs/{settings.run_id}/")
    return 0
