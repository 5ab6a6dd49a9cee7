"""`cloudless-run BUILD/`: train a compiled workflow on this machine (or drive deployed functions).

By default each function invocation is a local process running its package's handler (or an
OpenFaaS or Lambda call with --invoker); storage is a folder (or Redis/S3 when named). It prints
progress, and writes into the output folder (default BUILD/run/): `metrics.json` (loss per
iteration, throughput, storage requests, invocations, test loss and accuracy), `trace.json` (the
timeline, Chrome trace format: open it in chrome://tracing or ui.perfetto.dev), `model.safetensors`
(the trained parameters and buffers under the model's own names), and `logs/RUN_ID/` (local invoker: each
invocation's stderr and stdout). Bad input is one line on stderr and exit status 2; a run that
fails is exit status 1.

This module reads the arguments and checks them, then hands the run to the one that drives it: the
controller with its invokers (control/run.py), a deployed region's state machine (clouds/deploy.py), or
a rehearsal that deploys the build into a local cloud first (rehearsal/).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path

from ..ir import protocol
from ..ir.arguments import OneLineParser
from ..ir.files import BUILD_MARKER, build_difference, load_workflow
from ..ir.folders import (
    STORAGE_MARKER,
    FolderError,
    check_output_folder,
    check_storage_folder,
    run_lock,
    write_run_marker,
    write_storage_marker,
)
from ..ir.schema import SchemaError
from .clouds.preflight import add_arguments as add_preflight_arguments
from .clouds.preflight import gate as preflight_gate
from .control.elastic import CapacityChange, RegionFailure, check_regions
from .control.invokers import (
    gateway_urls,
    openfaas_token,
)
from .control.retrying_channel import StorageError
from .control.run import fail, train
from .control.storage_locations import storage_folders
from .storage.transient import StorageFaults

#: the emulated figures a network can have (--bandwidth, --latency-ms): beyond them a figure is a typo, and
#: the functions' arithmetic on it overflows (1e-300 MB/s: a transfer's end is past any timestamp)
BANDWIDTH_MB_PER_S = (1e-3, 1e6)
LATENCY_MS = (0.0, 600_000.0)


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="cloudless-run", description="Run a compiled Cloudless workflow: train it for real on this machine."
    )
    parser.add_argument("build", type=Path, help="a build folder written by cloudless-compile")
    parser.add_argument(
        "--iterations",
        type=int,
        metavar="N",
        help="iterations to train (default: the workflow's); several regions: every region's planned "
        "iterations, and the rounds, scaled by N / the workflow's run.iterations",
    )
    parser.add_argument(
        "--storage",
        action="append",
        metavar="[REGION=]URL",
        help="where functions exchange tensors: a folder (default OUT/storage), s3://bucket/prefix or "
        "redis://host:port/db. Several regions: each has its own storage, by default OUT/storage/REGION; "
        "REGION=URL (repeatable) names a region's, and one plain URL holds every region under its own "
        "sub-prefix URL/REGION. A folder must be new, empty, or one an earlier run used (its "
        f"{STORAGE_MARKER}): the run deletes its keys from it at the end",
    )
    parser.add_argument("--out", type=Path, help="output folder (default BUILD/run)")
    parser.add_argument(
        "--model", type=Path, help="the model file whose load_shard gives the data (default: the one compiled)"
    )
    parser.add_argument(
        "--invoker",
        choices=["local", "openfaas", "lambda"],
        default="local",
        help="how functions are invoked: local processes (default), an OpenFaaS gateway, AWS Lambda",
    )
    parser.add_argument(
        "--gateway",
        action="append",
        default=[],
        metavar="URL",
        help="OpenFaaS gateway URL (--invoker openfaas; default http://127.0.0.1:8080); several regions: "
        "REGION=URL, one per region (repeatable)",
    )
    parser.add_argument(
        "--stack",
        action="append",
        default=[],
        metavar="NAME",
        help="--invoker lambda: train on this deployed SAM stack (its bucket and state machine; several regions: "
        "REGION=NAME, default <run>-<region>); see runtimes/clouds/deploy.py",
    )
    parser.add_argument(
        "--rehearse",
        action="store_true",
        help="deploy the build on this machine first and train through the deployed path: --invoker openfaas, a "
        "CE-like gateway (each replica a process behind a watchdog, the secrets and a new token); --invoker lambda, "
        "a local AWS endpoint (moto: the SAM stacks, Step Functions, Lambda); see docs/deploying.md",
    )
    parser.add_argument(
        "--token-file",
        type=Path,
        metavar="FILE",
        help=f"the file holding the functions' token, the value of the OpenFaaS secret {protocol.TOKEN_SECRET} "
        f"(--invoker openfaas; default: ${protocol.TOKEN_ENV})",
    )
    parser.add_argument(
        "--emulate",
        action="store_true",
        help="give each function its tier's resources: bandwidth and request latency to storage, CPU share; "
        "several regions: each region's request latency, and every request to another region's storage "
        "takes the WAN link's bandwidth and latency (workflow.yaml's wan)",
    )
    parser.add_argument(
        "--bandwidth",
        type=float,
        metavar="MB_PER_S",
        help=f"emulate this bandwidth (megabytes/s each way; {BANDWIDTH_MB_PER_S[0]:g} to {BANDWIDTH_MB_PER_S[1]:g}, "
        "1 kB/s to 1 TB/s: no network is outside it)",
    )
    parser.add_argument(
        "--latency-ms",
        type=float,
        help=f"emulate this latency per storage request (0 to {LATENCY_MS[1]:g} ms, 10 minutes: no request "
        "takes longer and still answers)",
    )
    parser.add_argument(
        "--inject-faults",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="kill this share (0-1) of invocations at random points; they are retried",
    )
    parser.add_argument(
        "--inject-storage-faults",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="make this share (0-1) of storage requests, the functions' and the driver's, fail as a cloud's do "
        "(S3: 503 SlowDown, 500, connections reset, answers lost after a write, bodies cut short; Redis: "
        "connections dropped): every one is ridden out. s3:// or redis:// storage, local or --rehearse",
    )
    parser.add_argument(
        "--inject-throttling",
        type=float,
        default=0.0,
        metavar="SHARE",
        help="--invoker lambda --rehearse: Lambda answers this share (0-1; 1: every one, to the end) of the "
        "functions' invokes TooManyRequestsException, which the state machine's Retry meets, and Step Functions "
        "as much of the driver's requests (at most half) ThrottlingException",
    )
    parser.add_argument("--fault-seed", type=int, default=0, help="seed of the injected faults")
    parser.add_argument(
        "--capacity-change",
        action="append",
        metavar="REGION@ITERATION=FUNCTIONS",
        help="several regions: from its iteration ITERATION, REGION runs at most FUNCTIONS functions at once; "
        "the coordinator fits its replicas (or, when its stages do not fit, the region leaves) and re-plans "
        "every region's remaining iterations (repeatable)",
    )
    parser.add_argument(
        "--fail-region",
        action="append",
        metavar="REGION@ITERATION",
        help="several regions, fault injection: REGION stops answering at its iteration ITERATION; the others "
        "go on without it after the region timeout (repeatable)",
    )
    parser.add_argument(
        "--region-timeout",
        type=float,
        metavar="S",
        help="several regions: how long a meet waits for another region before going on without it "
        f"(default {protocol.DEFAULT_REGION_TIMEOUT_S:g} s)",
    )
    parser.add_argument(
        "--time-limit", type=float, metavar="S", help="end each invocation before S seconds (default: timeout - 30 s)"
    )
    parser.add_argument("--retries", type=int, default=3, help="retries per failed invocation (default 3)")
    parser.add_argument(
        "--key-timeout",
        type=float,
        metavar="S",
        help=f"how long a function waits for any one key (default {protocol.DEFAULT_KEY_TIMEOUT_S:g} s)",
    )
    parser.add_argument(
        "--run-id", help="names this run's keys in storage and its logs (default: the time and 6 random hex digits)"
    )
    parser.add_argument(
        "--resume",
        metavar="RUN_ID",
        help="continue an interrupted or failed run (same build, storage and --out) from its last checkpoints",
    )
    parser.add_argument(
        "--keep-storage",
        action="store_true",
        help="keep the run's keys in storage when it ends (default: delete them; the staged data stays)",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per function process (default 1)")
    parser.add_argument("--log-every", type=int, help="print progress every N iterations (default: about 20 lines)")
    parser.add_argument("-q", "--quiet", action="store_true", help="print only the summary")
    parser.add_argument(
        "--no-verify-build",
        action="store_true",
        help="for development: run a build edited by hand (by default every file's digest in "
        f"{BUILD_MARKER} is checked first, and an edited build is refused)",
    )
    add_preflight_arguments(parser)  # --preflight-only and what the checks need (runtimes/clouds/preflight.py)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM (a `kill`, a container or CI stopping the job): the run stops as Ctrl-C stops it."""


def _terminate(signum: int, frame: object) -> None:
    raise Terminated


def main(argv: Sequence[str] | None = None) -> int:
    # Only the main thread may set a handler (a caller running main in a thread keeps the default).
    handles = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _terminate) if handles else None
    try:
        return _main(argv)
    except KeyboardInterrupt as exc:
        # The controller has killed its invocations; storage keeps what they wrote (--resume).
        how = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
        print(f"cloudless-run: {how}; the run's functions were stopped", file=sys.stderr)
        return 128 + signal.SIGTERM if isinstance(exc, Terminated) else 130
    except StorageError as exc:  # before or after the run itself (staging, the final model)
        print(f"cloudless-run: {exc}", file=sys.stderr)
        return 1
    finally:
        if handles:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    build: Path = args.build
    # Before anything runs: a build edited after the compile (a flipped bit in the weights, a
    # function.json's micro_batch, code appended to a stage.py) would train another model and exit 0.
    edited = None if args.no_verify_build else build_difference(build)
    refused = f"{build}: {edited}; recompile, or pass --no-verify-build to run it anyway"
    try:
        workflow = load_workflow(build / "workflow.yaml")
    except (FileNotFoundError, NotADirectoryError):
        return fail(f"{build}/workflow.yaml: not found; expected a build folder written by cloudless-compile")
    except OSError as exc:
        return fail(f"{build}/workflow.yaml: cannot be read: {exc.strerror or exc}")
    except SchemaError as exc:
        return fail(refused if edited else str(exc))  # an edited workflow.yaml: named as such
    if edited:
        return fail(refused)
    iterations = workflow.run.iterations if args.iterations is None else args.iterations
    for option, value, least in (
        ("--iterations", iterations, 1),
        ("--retries", args.retries, 0),
        ("--threads", args.threads, 1),
        ("--log-every", args.log_every, 1),
    ):
        if value is not None and value < least:
            return fail(f"{option} {value}: expected at least {least}")
    for option, number, what in (
        ("--time-limit", args.time_limit, "a positive number of seconds"),
        ("--key-timeout", args.key_timeout, "a positive number of seconds"),
        ("--region-timeout", args.region_timeout, "a positive number of seconds"),
    ):
        if number is not None and not (math.isfinite(number) and number > 0):
            return fail(f"{option} {number}: expected {what}")
    for option, number, (low, high), unit, physical in (
        ("--bandwidth", args.bandwidth, BANDWIDTH_MB_PER_S, "megabytes per second", "1 kB/s to 1 TB/s"),
        ("--latency-ms", args.latency_ms, LATENCY_MS, "milliseconds", "10 minutes"),
    ):
        if number is not None and not low <= number <= high:  # NaN too: it fails every comparison
            within = f"{physical}: any real network's is within"
            return fail(f"{option} {number}: expected {unit} from {low:g} to {high:g} ({within})")
    for option, share in (
        ("--inject-faults", args.inject_faults),
        ("--inject-storage-faults", args.inject_storage_faults),
    ):
        if not 0 <= share < 1:
            return fail(f"{option} {share}: expected a share in [0, 1)")
    if not 0 <= args.inject_throttling <= 1:
        return fail(f"--inject-throttling {args.inject_throttling}: expected a share in [0, 1]")
    if args.inject_throttling and not (args.rehearse and args.invoker == "lambda"):
        return fail("--inject-throttling: only with --invoker lambda --rehearse (the rehearsal's Lambda service)")
    if args.inject_storage_faults and args.invoker != "local" and not args.rehearse:
        return fail("--inject-storage-faults: only with --rehearse or local: a deployment's storage is the cloud's own")
    if args.inject_storage_faults:
        folders = [
            where for where in (args.storage or [""]) if not where.split("=", 1)[-1].startswith(("s3:", "redis"))
        ]
        if folders and not (args.rehearse and args.invoker == "lambda"):  # the Lambda rehearsal's storage is S3
            named = f"storage {folders[0]}" if folders[0] else "the default storage (OUT/storage)"
            return fail(
                f"--inject-storage-faults: {named} is a folder, which has no transient errors; "
                "give --storage s3://BUCKET/PREFIX or redis://HOST:PORT/DB"
            )
    try:
        changes = tuple(CapacityChange.parse(text) for text in args.capacity_change or ())
        failures = tuple(RegionFailure.parse(text) for text in args.fail_region or ())
        check_regions([r.name for r in workflow.regions], changes, failures)
    except ValueError as exc:
        return fail(str(exc))
    args.capacity_changes, args.region_failures = changes, failures  # parsed once, for train
    if args.region_timeout and len(workflow.regions) == 1:
        return fail("--region-timeout needs a workflow of several regions")
    if args.resume and args.run_id:
        return fail("give --run-id or --resume, not both")
    if (changes or failures) and args.resume:
        return fail("--resume cannot replay --capacity-change or --fail-region: start the run again")
    for option, name in (("--run-id", args.run_id), ("--resume", args.resume)):
        try:
            if name is not None:
                protocol.check_run_name(name, option)
        except ValueError as exc:
            return fail(str(exc))
        if name == STORAGE_MARKER:  # the run's keys would be a folder of that name, beside the marker
            return fail(f"{option} {name}: the name of a storage folder's marker; choose another")
    if args.rehearse and args.invoker == "local":
        return fail("--rehearse: only with --invoker openfaas or lambda, not local")
    if args.resume and args.rehearse and args.invoker == "lambda":
        return fail("--resume: not with --invoker lambda --rehearse (each deploys new stacks); start the run again")
    if args.rehearse and args.invoker == "openfaas" and args.token_file is not None:
        return fail("--token-file: a rehearsal makes its own token; give it to a real gateway's run only")
    token = None
    if args.invoker == "openfaas" and not args.rehearse:  # a rehearsal makes its own
        try:
            token = openfaas_token(args.token_file)
        except ValueError as exc:
            return fail(str(exc))
    elif args.token_file is not None:
        return fail(f"--token-file: only with --invoker openfaas, not {args.invoker}")
    if args.stack and args.invoker != "lambda":
        return fail(f"--stack: only with --invoker lambda, not {args.invoker}")
    if failures and args.invoker != "local" and not args.rehearse:
        return fail("--fail-region: fault injection takes a region's functions down: only with --rehearse or local")
    if args.invoker == "openfaas" and not args.rehearse:
        try:
            gateway_urls(workflow, list(args.gateway))
        except ValueError as exc:
            return fail(str(exc))
    rehearse_aws = args.rehearse and args.invoker == "lambda"
    for _, function in workflow.functions():
        if not (build / function.package / "handler.py").is_file():
            return fail(f"{build / function.package}: no handler.py; was the build written with --target?")
    preflight = preflight_gate(args, build, workflow)  # a deployment's quotas, capacity, images: before anything
    if preflight is not None:
        return preflight
    out = args.out or build / "run"
    inputs = [build / "workflow.yaml", Path(workflow.data.model_file), *([args.model] if args.model else [])]
    try:
        # Never a folder of the user's: an empty one, or an earlier run's output (its marker).
        check_output_folder(out, "run", protected=inputs)
        # Nor a storage folder (the run deletes its keys from it): new, empty, or one an earlier run
        # used (its marker); all checked before anything is written. (--stack: the stack's bucket.)
        folders = [] if args.stack or rehearse_aws else storage_folders(workflow, args.storage, out)
        for where, folder, given in folders:
            if given:
                check_storage_folder(folder, where, protected=inputs)
        for where, folder, given in folders:
            if given:
                write_storage_marker(folder, where)
        write_run_marker(out)
        for where, folder, given in folders:
            if not given:
                write_storage_marker(folder, where)  # OUT/storage
    except ValueError as exc:  # FolderError, or a --storage of no region or empty
        return fail(str(exc))
    injected = bool(args.inject_storage_faults)
    if injected:  # every storage client of this process and of the functions it starts
        os.environ[protocol.STORAGE_FAULTS_ENV] = StorageFaults(args.inject_storage_faults, args.fault_seed).encode()
    try:
        with run_lock(out):  # a recompile of the build waits for this run instead of moving its folder
            if rehearse_aws:
                from .rehearsal.aws import rehearse as rehearse_aws_stacks  # moto, the SAM translator: only here

                return rehearse_aws_stacks(args, build, workflow, iterations, out)
            if args.stack:
                from .clouds.deploy import drive  # boto3 only for this

                return drive(args, build, workflow, iterations, out)
            if args.rehearse:
                from .rehearsal.openfaas import rehearse  # the stack deployed here, then train against it

                return rehearse(args, build, workflow, iterations, out, train)
            return train(args, build, workflow, iterations, out, token)
    except FolderError as exc:
        return fail(str(exc))
    finally:
        if injected:
            os.environ.pop(protocol.STORAGE_FAULTS_ENV, None)


if __name__ == "__main__":
    sys.exit(main())
