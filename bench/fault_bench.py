"""Transient faults ridden out: what they cost in time, and that they change nothing.

    python bench/fault_bench.py [--iterations 30] [--repeats 3] [--quick]

The job is samples/mlp_digits.py compiled in 2 stages, trained by `cloudless-run` (each run a fresh
process) on storage with faults injected below the SDKs' retries (`--inject-storage-faults`: S3's 503
SlowDown and 500s, connections reset before a request or after it was served, bodies cut short; Redis
connections dropped), through the Lambda rehearsal, throttled invokes (`--inject-throttling`), and through
the OpenFaaS rehearsal, replicas OOMKilled mid-call and restarted (`--inject-faults`). Besides rates, the
bursts of issue 47's corpus: every storage request failing for 4 s from iteration 2 on (503 SlowDown,
connections reset, answers lost after S3 wrote), and Redis stopped mid-run and started again 5 s later
(its data kept, as a deployed Redis's is). S3 is moto's server over HTTP, Redis a real redis-server (skipped
when none is installed).

Printed per case: the median wall time of the whole command (start-up and evaluation included), its ratio
to the same path undisturbed (issue 47's target for a recovered fault: within 2x), and whether the trained
model is bit-identical to the undisturbed local run's. `--quick` (what CI runs): the local cases only, one
repeat, 10 iterations.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cloudless.ir.protocol import STORAGE_FAULTS_ENV

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
MODEL = ROOT / "samples" / "mlp_digits.py"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def model_digest(out: Path) -> str:
    return hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()


#: a burst: every storage request of every process of the run fails for BURST_S from its first request
#: on iteration BURST_ITERATION's keys (training under way)
BURST_ITERATION, BURST_S = 2, 4.0


@dataclass(frozen=True)
class Case:
    name: str
    undisturbed: str  # the case it is compared with
    options: list[str]
    burst: tuple[str, ...] | None = None  # the fault kinds of a burst
    disturb: Callable[[], None] | None = None  # called as the run starts, in a thread (a server restarted)


def run(
    build: Path, folder: Path, options: list[str], env: dict[str, str], case: Case | None = None
) -> tuple[float, str]:
    """One `cloudless-run` in a fresh process: (seconds, the trained model's digest)."""
    from cloudless.runtimes.storage.transient import StorageFaults

    out = folder / uuid.uuid4().hex[:8]
    command = [str(BIN / "cloudless-run"), str(build), "--out", str(out), "-q", *options]
    env = dict(env)
    if case is not None and case.burst:  # every process of the run, the functions' too, meets it
        burst = StorageFaults(1.0, seed=1, kinds=case.burst, from_iteration=BURST_ITERATION, seconds=BURST_S)
        env[STORAGE_FAULTS_ENV] = burst.encode()
    began = time.monotonic()
    disturbing = None
    if case is not None and case.disturb is not None:
        disturbing = threading.Thread(target=case.disturb)
        disturbing.start()
    finished = subprocess.run(command, env=env, capture_output=True, text=True)
    seconds = time.monotonic() - began
    if disturbing is not None:
        disturbing.join()
    if finished.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed:\n{finished.stderr}")
    return seconds, model_digest(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="local cases, 1 repeat, 10 iterations (CI)")
    args = parser.parse_args()
    if args.quick:
        args.iterations, args.repeats = 10, 1
    import logging

    import boto3
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # a line per request otherwise

    folder = Path(tempfile.mkdtemp(prefix="fault_bench_"))
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    redis = None
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "CLOUDLESS_"))}
        env.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
        env["CLOUDLESS_S3_ENDPOINT"] = endpoint
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="bench",
                     aws_secret_access_key="bench").create_bucket(Bucket="fault-bench")  # fmt: skip
        build = folder / "build"
        compile_command = [str(BIN / "cloudless-compile"), str(MODEL), "-o", str(build), "-q", "--stages", "2"]
        subprocess.run([*compile_command, "--repeats", "1"], check=True, capture_output=True, env=env)
        executable = shutil.which("redis-server")
        redis_url = None
        redis_command: list[str] = []
        if executable is not None:
            redis_port = free_port()
            (folder / "redis").mkdir()
            # written through, as a deployed Redis keeps its data across a restart
            redis_command = [executable, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", ""]
            redis_command += ["--appendonly", "yes", "--appendfsync", "always", "--dir", str(folder / "redis")]
            redis = subprocess.Popen(redis_command, stdout=subprocess.DEVNULL)
            redis_url = f"redis://127.0.0.1:{redis_port}/0"
            time.sleep(0.5)

        def restart() -> None:
            """Once the run is past its second iteration, Redis stops, and starts again 5 s later."""
            import redis as redis_py

            nonlocal redis
            client = redis_py.Redis.from_url(redis_url or "")
            began = time.monotonic()
            while not any(True for _ in client.scan_iter(match="*/it2/*", count=1000)):
                if time.monotonic() - began > 120:
                    raise SystemExit("the run never reached its third iteration")
                time.sleep(0.05)
            client.close()
            assert redis is not None
            redis.terminate()
            redis.wait()
            time.sleep(5)
            redis = subprocess.Popen(redis_command, stdout=subprocess.DEVNULL)

        iterations = ["--iterations", str(args.iterations), "--fault-seed", "1"]

        def s3() -> list[str]:
            return ["--storage", f"s3://fault-bench/{uuid.uuid4().hex[:8]}"]

        faults = ["--inject-storage-faults"]
        slow_down, resets, lost = ("slow-down",), ("reset-before", "answer-lost"), ("answer-lost",)
        cases = [
            Case("local, folder", "local, folder", []),
            Case("local, S3", "local, S3", s3()),
            Case("local, S3, 10% faults", "local, S3", [*s3(), *faults, "0.1"]),
            Case("local, S3, 30% faults", "local, S3", [*s3(), *faults, "0.3"]),
            Case(f"local, S3, all 503 SlowDown {BURST_S:.0f} s", "local, S3", s3(), burst=slow_down),
            Case(f"local, S3, all reset {BURST_S:.0f} s", "local, S3", s3(), burst=resets),
            Case(f"local, S3, all answers lost {BURST_S:.0f} s", "local, S3", s3(), burst=lost),
        ]
        if redis_url is not None:
            cases += [
                Case("local, Redis", "local, Redis", ["--storage", f"{redis_url}#a"]),
                Case("local, Redis, 20% faults", "local, Redis", ["--storage", f"{redis_url}#b", *faults, "0.2"]),
                Case("local, Redis, restarted 5 s", "local, Redis", ["--storage", f"{redis_url}#c"], None, restart),
            ]
        if not args.quick:
            lambda_ = ["--invoker", "lambda", "--rehearse"]
            lambda_case = "Lambda rehearsal"
            cases += [
                Case(lambda_case, lambda_case, lambda_),
                Case("Lambda rehearsal, 10% faults", lambda_case, [*lambda_, *faults, "0.1"]),
                Case(f"Lambda rehearsal, all 503 {BURST_S:.0f} s", lambda_case, lambda_, burst=slow_down),
                Case(f"Lambda rehearsal, all reset {BURST_S:.0f} s", lambda_case, lambda_, burst=resets),
                Case("Lambda rehearsal, 30% throttled", lambda_case, [*lambda_, "--inject-throttling", "0.3"]),
            ]
            openfaas = ["--invoker", "openfaas", "--rehearse", *s3()]
            openfaas_case = "OpenFaaS rehearsal, S3"
            cases += [
                Case(openfaas_case, openfaas_case, openfaas),
                Case("OpenFaaS rehearsal, S3, 10% faults", openfaas_case, [*openfaas, *faults, "0.1"]),
                Case(f"OpenFaaS rehearsal, S3, all 503 {BURST_S:.0f} s", openfaas_case, openfaas, burst=slow_down),
                Case("OpenFaaS rehearsal, S3, 30% OOMKilled", openfaas_case, [*openfaas, "--inject-faults", "0.3"]),
            ]
        times: dict[str, list[float]] = {}
        digests: dict[str, set[str]] = {}
        for _ in range(args.repeats):
            for case in cases:
                # a fresh prefix per repeat: every run stages its data and trains from the start
                fresh = [s3()[1] if o.startswith("s3://") else o for o in case.options]
                fresh = [f"{o}{uuid.uuid4().hex[:4]}" if o.startswith("redis://") else o for o in fresh]
                seconds, digest = run(build, folder, [*iterations, *fresh], env, case)
                times.setdefault(case.name, []).append(seconds)
                digests.setdefault(case.name, set()).add(digest)
        reference = digests["local, folder"]
        print(f"mlp_digits in 2 stages, {args.iterations} iterations, median of {args.repeats} run(s) each")
        print(f"{'case':44} {'seconds':>8} {'x undisturbed':>14}  model")
        for case in cases:
            median = statistics.median(times[case.name])
            ratio = median / statistics.median(times[case.undisturbed])
            same = "identical" if digests[case.name] == reference else "DIFFERS"
            print(f"{case.name:44} {median:8.1f} {ratio:14.2f}  {same}")
        if any(digests[case.name] != reference for case in cases):
            raise SystemExit("a run trained another model than the undisturbed local run")
    finally:
        server.stop()
        if redis is not None:
            redis.terminate()
            redis.wait()
        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
