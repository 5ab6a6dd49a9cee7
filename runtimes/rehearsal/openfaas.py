"""`cloudless-run BUILD --invoker openfaas --rehearse`: the build's OpenFaaS deployment rehearsed on this
machine, then trained through the same OpenFaaS invoker a real gateway gets.

Per region, what `faas-cli` and OpenFaaS CE would do with the region's stack.yaml (`read_stack`):
- a gateway (`openfaas_gateway`: CE's routes, random routing among a function's instances, 429s passed back
  unretried, 502 past its upstream timeout, basic auth on /system/...) with a fresh admin password, as the
  helm chart makes one; the run's token and the storage credentials are created through its
  /system/secrets as `faas-cli secret create` does (report.md's steps);
- each function deployed as faas-netes deploys it (pkg/handlers/deploy.go, validate.go): CE's limits on
  `com.openfaas.scale.min`/`max` (at most 5) and on the number of functions (15); `scale.min` replicas
  (default 1; CE does not scale); each replica a process of its own: an of-watchdog-like front
  (`max_inflight`, `exec_timeout`, `write_timeout` from the function's environment, as the watchdog reads
  them; `read_timeout` is the time to read a request, which a rehearsal's small bodies never near) that
  starts the template's index.py (upstream's, where `faas-cli template pull` put it beside the stack, else
  `openfaas_index`, written to its behaviour) as /home/app/index.py with the function's folder as
  /home/app/function/ (the image's layout), under waitress, in a process of its own;
- the function's `environment` as written, but CLOUDLESS_STORAGE, which names the run's storage (the
  stack's names the deployed bucket); its `secrets` only, each a file in a folder of the function's own
  (named to the handler by protocol.SECRETS_DIR_ENV: a deployed one reads /var/openfaas/secrets);
- its `limits.cpu` as the function's CPU share, emulated as `--emulate` does (emulation.CpuShare, a CFS
  quota's throttling), and no OMP_NUM_THREADS, so the handler caps torch's threads from its share itself.
A replica whose process ends is started again (Kubernetes' restartPolicy Always; of-watchdog ends when its
function's process does), and held to its `limits.memory` (`enforce_memory`: killed above it, OOMKilled,
then started again). What it cannot show: the image build and pull (the packages run on this machine's
Python and wheels), Kubernetes scheduling and the cluster's capacity, the network.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path
from typing import Any

import yaml

from ...ir.protocol import (
    EMULATE_ENV,
    PEERS_ENV,
    S3_ENDPOINT_ENV,
    SECRETS_DIR_ENV,
    STORAGE_ENV,
    STORAGE_FAULTS_ENV,
    STORAGE_SECRET,
    TOKEN_SECRET,
)
from ...ir.workflow import Workflow
from ..control.invokers import Invocation, _die_with_parent
from ..control.storage_locations import local_folder, storage_locations
from ..storage.emulation import Resources
from .lambda_local import _rss_mb
from .openfaas_gateway import Gateway, Watchdog, basic_auth_header, gateway_serving, serving

#: OpenFaaS CE's limits (faas-netes pkg/handlers/validate.go MaxReplicas; the CE EULA's 15 functions)
CE_MAX_REPLICAS, CE_MAX_FUNCTIONS = 5, 15
#: how long a replica may take to start serving (its handler imports torch): seconds
START_TIMEOUT_S = 180.0
#: the gateway's upstream timeout beyond the largest exec_timeout (the stack's header: at least that)
UPSTREAM_MARGIN_S = 15.0
#: storage credentials a rehearsal passes to its functions' secret cloudless-storage, if set here
CREDENTIALS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION")
_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


#: where `faas-cli template pull stack -f stack.yaml`, run in a region's folder (report.md), puts the
#: template's index.py
PULLED_INDEX = Path("template") / "python3-http-debian" / "index.py"
#: how a replica starts index.py: as `python index.py` in /home/app, but with waitress serving on a free
#: loopback port (the template's 5000 is a container's own) and saying which, first
LAUNCHER = """
import runpy, waitress

def serve(app, host=None, port=None, **options):
    server = waitress.create_server(app, host="127.0.0.1", port=0, **options)
    print(f"serving on {server.effective_port}", flush=True)
    server.run()

waitress.serve = serve
runpy.run_path("index.py", run_name="__main__")
"""


class RehearsalError(ValueError):
    """A stack the rehearsal cannot deploy, or a replica that did not start: one line."""


def parse_duration(text: str, where: str) -> float:
    """A Go duration as of-watchdog reads its timeouts ("900s", "1m30s", "500ms"; a bare number is seconds)."""
    text = str(text).strip()
    if re.fullmatch(r"\d+(\.\d+)?", text):
        return float(text)
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise RehearsalError(f"{where}: {text!r}: expected a duration such as 900s, 1m30s or 500ms")
    return sum(float(number) * _UNIT_S[unit] for number, unit in parts)


def parse_cpu(text: str, where: str) -> float:
    """A Kubernetes CPU quantity ("579m", "2", "0.5") in vCPUs."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)(m?)", str(text).strip())
    if not match:
        raise RehearsalError(f"{where}: {text!r}: expected a CPU quantity such as 500m or 2")
    return float(match.group(1)) / (1000 if match.group(2) else 1)


#: Kubernetes' memory quantity suffixes, in bytes
_MEMORY_UNITS = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


def parse_memory(text: str, where: str) -> float:
    """A Kubernetes memory quantity ("10240Mi", "10Gi", "512M", "1e9") in MiB."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?(?:e\d+)?)([kMGT]i?|Ki)?", str(text).strip())
    if not match:
        raise RehearsalError(f"{where}: {text!r}: expected a memory quantity such as 512Mi or 10Gi")
    return float(match.group(1)) * _MEMORY_UNITS[match.group(2) or ""] / 2**20


@dataclass(frozen=True)
class StackFunction:
    """One function of a stack file, as the rehearsal deploys it."""

    name: str
    handler: Path
    replicas: int
    environment: dict[str, str]
    secrets: tuple[str, ...]
    cpu: float | None
    max_inflight: int | None
    exec_timeout: float | None
    write_timeout: float | None
    memory_mib: float | None = None  # limits.memory: the container is killed above it (OOMKilled)


def read_stack(path: Path) -> list[StackFunction]:
    """The functions of a stack file, checked as faas-netes checks a CE deploy (RehearsalError)."""
    try:
        stack = yaml.safe_load(path.read_text())
        functions = stack["functions"]
        assert isinstance(functions, dict) and functions
    except (OSError, yaml.YAMLError, KeyError, TypeError, AssertionError) as exc:
        raise RehearsalError(f"{path}: not a stack file with functions ({type(exc).__name__})") from None
    if len(functions) > CE_MAX_FUNCTIONS:
        raise RehearsalError(f"{path}: {len(functions)} functions; OpenFaaS CE deploys at most {CE_MAX_FUNCTIONS}")
    found = []
    for name, spec in functions.items():
        where = f"{path}: function {name}"
        labels = {str(k): str(v) for k, v in (spec.get("labels") or {}).items()}
        for label in ("com.openfaas.scale.min", "com.openfaas.scale.max"):
            if label in labels and labels[label].isdigit() and int(labels[label]) > CE_MAX_REPLICAS:
                raise RehearsalError(f"{where}: {label} is set too high for Community Edition (at most 5)")
        environment = {str(k): str(v) for k, v in (spec.get("environment") or {}).items()}
        limits = spec.get("limits") or {}
        inflight = environment.get("max_inflight")
        if inflight is not None and not inflight.isdigit():
            raise RehearsalError(f"{where}: max_inflight {inflight!r}: expected a whole number")
        exec_timeout, write_timeout = environment.get("exec_timeout"), environment.get("write_timeout")
        found.append(
            StackFunction(
                name=str(name),
                handler=(path.parent / str(spec.get("handler", ""))).resolve(),
                replicas=int(labels.get("com.openfaas.scale.min", "1")),
                environment=environment,
                secrets=tuple(str(s) for s in spec.get("secrets") or ()),
                cpu=parse_cpu(limits["cpu"], f"{where} limits.cpu") if "cpu" in limits else None,
                memory_mib=parse_memory(limits["memory"], f"{where} limits.memory") if "memory" in limits else None,
                max_inflight=int(inflight) if inflight else None,
                exec_timeout=parse_duration(exec_timeout, f"{where} exec_timeout") if exec_timeout else None,
                write_timeout=parse_duration(write_timeout, f"{where} write_timeout") if write_timeout else None,
            )
        )
    return found


# --- one replica: the watchdog's process, and the template's index.py as its child --------------------


def _upstream(url: str) -> Callable[[dict[str, Any], Any], list[bytes]]:
    """The watchdog's proxy to the function's index.py (http mode): the request as it came, the answer as
    it is."""

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        length = int(environ.get("CONTENT_LENGTH") or 0)
        body = environ["wsgi.input"].read(length) if length else b""
        headers = {k[5:].replace("_", "-").title(): v for k, v in environ.items() if k.startswith("HTTP_")}
        if environ.get("CONTENT_TYPE"):
            headers["Content-Type"] = environ["CONTENT_TYPE"]
        headers.pop("Host", None)
        query = f"?{environ['QUERY_STRING']}" if environ.get("QUERY_STRING") else ""
        target = url + environ.get("PATH_INFO", "/") + query
        request = urllib.request.Request(target, data=body or None, headers=headers, method=environ["REQUEST_METHOD"])
        try:
            with urllib.request.urlopen(request) as response:
                status, reply, answer_headers = response.status, response.read(), response.headers
        except urllib.error.HTTPError as exc:
            status, reply, answer_headers = exc.code, exc.read(), exc.headers
        kept = [(k, v) for k, v in answer_headers.items() if k.lower() not in ("connection", "transfer-encoding")]
        start_response(f"{status} {_reason(status)}", kept)
        return [reply]

    return app


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return "Unknown"


def _first_line(stream: Any, deadline: float, what: str) -> str:
    """The first line a child prints (it says where it serves), within the deadline."""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([stream], [], [], 0.2)
        if ready:
            return stream.readline().decode(errors="replace").strip()
    raise RehearsalError(f"{what}: did not start serving within {START_TIMEOUT_S:g} s")


def watchdog_main(argv: list[str]) -> int:
    """The replica's process (`python -m cloudless.runtimes.rehearsal.openfaas watchdog HOME MAX_INFLIGHT
    EXEC_TIMEOUT WRITE_TIMEOUT`, seconds, 0 for none): start `python index.py` in HOME (of-watchdog's
    fprocess), then serve the front on a free loopback port; prints `serving on PORT` once the function
    serves. Its stderr is the function's log."""
    home, inflight, timeout, write_timeout = Path(argv[0]), int(argv[1]), float(argv[2]), float(argv[3])
    child = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER], cwd=home, stdout=subprocess.PIPE, preexec_fn=_function_child
    )
    assert child.stdout is not None
    line = _first_line(child.stdout, time.monotonic() + START_TIMEOUT_S, f"{home}/index.py")
    if not line.startswith("serving on "):
        print(f"index.py did not start: {line or f'exit status {child.wait()}'}", file=sys.stderr)
        return 1

    def relay() -> None:  # what the function prints goes to the log, as the watchdog logs it
        assert child.stdout is not None
        for text in child.stdout:
            sys.stderr.write(f"stdout: {text.decode(errors='replace')}")

    def reap() -> None:  # of-watchdog ends when its fprocess does; Kubernetes then restarts the container
        child.wait()
        print(f"index.py ended: exit status {child.returncode}", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=relay, daemon=True).start()
    threading.Thread(target=reap, daemon=True).start()
    front = Watchdog(
        _upstream(f"http://127.0.0.1:{line.split()[-1]}"), inflight, timeout or None, write_timeout or None
    )
    with serving(front) as url:
        print(f"serving on {url.rstrip('/').rsplit(':', 1)[1]}", flush=True)
        signal.sigwait([signal.SIGTERM, signal.SIGINT])
    if child.poll() is None:
        child.terminate()
        return 0
    return 1


def _function_child() -> None:
    """index.py's process: the signals its watchdog waits for unblocked again, and it dies with it."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM, signal.SIGINT])
    _die_with_parent()


@dataclass
class Replica:
    """One replica: how it is started, its process now, where it serves, and how often it was restarted."""

    function: str
    index: int
    command: list[str]
    env: dict[str, str]
    log: Path
    process: subprocess.Popen[bytes] | None = None
    url: str = ""
    restarts: int = 0
    down: bool = False  # its region is gone (--fail-region): not started again
    memory_mib: float | None = None  # its function's limits.memory
    oom_kills: int = 0

    def start(self) -> None:
        with self.log.open("ab") as err:
            self.process = subprocess.Popen(
                self.command, stdout=subprocess.PIPE, stderr=err, env=self.env, preexec_fn=_die_with_parent
            )

    def await_serving(self, deadline: float) -> None:
        """Until it says where it serves (RehearsalError if it does not)."""
        assert self.process is not None and self.process.stdout is not None
        what = f"{self.function} replica {self.index}"
        line = _first_line(self.process.stdout, deadline, what)
        if not line.startswith("serving on "):
            tail = self.log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
            raise RehearsalError(f"{what} did not start: {tail[0][:300]} (its log: {self.log})")
        self.url = f"http://127.0.0.1:{line.split()[-1]}/"

    def stop(self) -> None:
        if self.process is not None:
            _stop(self.process)


def template_index(region_folder: Path) -> Path:
    """The template's index.py a rehearsal runs: upstream's where `faas-cli template pull` put it, else ours."""
    pulled = region_folder / PULLED_INDEX
    return pulled if pulled.is_file() else Path(__file__).with_name("openfaas_index.py")


def _home(function: StackFunction, scratch: Path, index: Path) -> Path:
    """The image's /home/app: index.py, and function/ holding the handler's folder (linked, not copied:
    the build stays as it is)."""
    home = scratch / "home" / function.name
    (home / "function").mkdir(parents=True)
    shutil.copyfile(index, home / "index.py")
    (home / "function" / "__init__.py").touch()  # the template's Dockerfile makes function/ a package
    for entry in function.handler.iterdir():
        if entry.name != "__init__.py":
            (home / "function" / entry.name).symlink_to(entry)
    return home


def _environment(function: StackFunction, folder: Path, overrides: Mapping[str, str], index: int) -> dict[str, str]:
    """A replica's environment: a container's (no variable of this shell but those a process needs to run
    here), the stack's, the rehearsal's overrides; its secrets' folder and CPU share."""
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TMPDIR", "HOME")}
    env.update(function.environment)
    env.update(overrides)
    env.update(
        {
            "HOSTNAME": f"{function.name}-{index}",
            SECRETS_DIR_ENV: str(folder),
            "PYTHONDONTWRITEBYTECODE": "1",  # the build stays as it is
            "PYTHONUNBUFFERED": "1",
        }
    )
    if function.cpu is not None:
        env[EMULATE_ENV] = json.dumps(Resources(vcpus=function.cpu).to_json())
    return env


def deploy(
    gateway: Gateway,
    functions: list[StackFunction],
    overrides: Mapping[str, str],
    scratch: Path,
    logs: Path,
    stack: ExitStack,
    index_py: Path,
    replicas: list[Replica] | None = None,
) -> list[Replica]:
    """Deploy the functions behind the gateway: each function's secrets (from the gateway's store; one
    missing is an error, as faas-netes has it) into its folder, its replicas started together; returns them
    once all serve (each stopped when `stack` closes)."""
    replicas = [] if replicas is None else replicas  # the caller's, watched as they start
    logs.mkdir(parents=True, exist_ok=True)
    for function in functions:
        missing = [name for name in function.secrets if name not in gateway.secrets]
        if missing:
            raise RehearsalError(f"deploy {function.name}: secret {missing[0]} not found; create it first")
        folder = scratch / "secrets" / function.name
        folder.mkdir(parents=True)
        for name in function.secrets:
            (folder / name).write_bytes(gateway.secrets[name])
        home = _home(function, scratch, index_py)
        for index in range(function.replicas):
            command = [sys.executable, "-m", "cloudless.runtimes.rehearsal.openfaas", "watchdog", str(home)]
            command += [str(t or 0) for t in (function.max_inflight, function.exec_timeout, function.write_timeout)]
            env = _environment(function, folder, overrides, index)
            replica = Replica(function.name, index, command, env, logs / f"{function.name}-{index}.log")
            replica.memory_mib = function.memory_mib
            replica.log.write_bytes(b"")
            replica.start()
            stack.callback(replica.stop)
            replicas.append(replica)
    deadline = time.monotonic() + START_TIMEOUT_S
    for replica in replicas:
        replica.await_serving(deadline)
    for function in functions:
        gateway.urls[function.name] = [r.url for r in replicas if r.function == function.name]
    return replicas


def _tree_rss_mib(pid: int) -> float:
    """The resident memory of a process and its descendants (a container's), MiB."""
    total, pending = 0.0, [pid]
    while pending:
        process = pending.pop()
        total += _rss_mb(process)
        for children in Path(f"/proc/{process}/task").glob("*/children"):
            try:
                pending += [int(child) for child in children.read_text().split()]
            except (OSError, ValueError):
                continue  # it ended meanwhile
    return total


def enforce_memory(replicas: list[Replica], stopping: threading.Event) -> None:
    """A container's memory limit, as the kernel enforces it under Kubernetes: a replica whose processes
    hold more than its function's limits.memory is killed (OOMKilled, in its log), and Kubernetes (here
    `keep_running`) starts it again; a call it was serving ends without an answer."""
    while not stopping.wait(0.2):
        for replica in list(replicas):
            process = replica.process
            if replica.memory_mib is None or process is None or process.poll() is not None:
                continue
            used = _tree_rss_mib(process.pid)
            if used > replica.memory_mib:
                process.kill()  # its index.py dies with it
                replica.oom_kills += 1
                with replica.log.open("a") as log:
                    log.write(f"OOMKilled: {used:.0f} MiB resident, over limits.memory ({replica.memory_mib:.0f} Mi)\n")


def keep_running(replicas: list[Replica], gateway: Gateway, stopping: threading.Event) -> None:
    """Kubernetes' restartPolicy Always: a replica whose process ended is started again, and the gateway
    routes to it where it now serves (calls meanwhile fail as calls to a pod being restarted do)."""
    while not stopping.wait(0.2):
        for replica in replicas:
            if replica.process is None or replica.process.poll() is None or stopping.is_set() or replica.down:
                continue
            replica.restarts += 1
            replica.start()
            try:
                replica.await_serving(time.monotonic() + START_TIMEOUT_S)
            except RehearsalError:
                continue  # it ended again: the next round starts it again
            gateway.urls[replica.function][replica.index] = replica.url


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def create_secret(url: str, password: str, name: str, value: bytes) -> None:
    """`faas-cli secret create NAME --from-file FILE` against the gateway (logged in with `password`)."""
    body = json.dumps({"name": name, "rawValue": base64.b64encode(value).decode()}).encode()
    headers = {"Authorization": basic_auth_header(password), "Content-Type": "application/json"}
    request = urllib.request.Request(f"{url}/system/secrets", data=body, headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=30) as response:
        if response.status != 202:
            raise RehearsalError(f"secret create {name}: the gateway answered {response.status}")


@dataclass
class RegionGateway:
    """A region's rehearsed deployment: its gateway and replicas, and the admin password."""

    region: str
    gateway: Gateway
    password: str
    index: Path
    replicas: list[Replica] = field(default_factory=list)

    def take_down(self) -> None:
        """Fault injection (`--fail-region`): every replica killed and none started again; the gateway
        answers as one whose functions are gone."""
        for replica in self.replicas:
            replica.down = True
            if replica.process is not None and replica.process.poll() is None:
                replica.process.kill()

    def kill(self, invocation: Invocation) -> bool:
        """Fault injection (`--inject-faults`): the replica serving the invocation's call is killed, as the
        kernel kills a container over its memory limit (OOMKilled, in its log); Kubernetes starts it again
        (`keep_running`). False if no replica is serving the call now."""
        event = invocation.event
        for call in reversed(self.gateway.calls):
            if call.function != invocation.function.name or call.status is not None or call.instance is None:
                continue
            try:
                body = json.loads(call.body)
            except ValueError:
                continue
            wanted = (event.run, invocation.replica, event.start, invocation.attempt)
            if (body.get("run"), body.get("replica"), body.get("start"), body.get("attempt")) != wanted:
                continue
            replica = next(r for r in self.replicas if r.function == call.function and r.index == call.instance)
            process = replica.process
            if process is None or process.poll() is not None:
                return False
            process.kill()
            replica.oom_kills += 1
            with replica.log.open("a") as log:
                log.write("OOMKilled: --inject-faults\n")
            return True
        return False


@contextmanager
def rehearse_region(
    region_folder: Path,
    secret_values: Mapping[str, bytes],
    overrides: Mapping[str, str],
    logs: Path,
    *,
    queue: str = "ce",
) -> Iterator[RegionGateway]:
    """The region's stack deployed behind a gateway of its own (see the module's docstring): the secrets
    created through the gateway, then the functions; everything stopped on exit."""
    functions = read_stack(region_folder / "stack.yaml")
    upstream = max((f.exec_timeout or 0.0 for f in functions), default=0.0) + UPSTREAM_MARGIN_S
    password = secrets.token_hex(16)
    with ExitStack() as stack:
        gateway = stack.enter_context(
            gateway_serving(queue=queue, upstream_timeout=upstream, password=password)  # type: ignore[arg-type]
        )
        for name, value in secret_values.items():
            create_secret(gateway.url, password, name, value)
        scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="cloudless-rehearsal-")))
        index = template_index(region_folder)
        stopping = threading.Event()
        replicas: list[Replica] = []
        limiter = threading.Thread(target=enforce_memory, args=(replicas, stopping), daemon=True)
        limiter.start()
        stack.callback(limiter.join)
        stack.callback(stopping.set)  # a deploy that fails: the limiter ends after the replicas
        deploy(gateway, functions, overrides, scratch, logs, stack, index, replicas)
        restarter = threading.Thread(target=keep_running, args=(replicas, gateway, stopping), daemon=True)
        restarter.start()
        stack.callback(restarter.join)
        stack.callback(stopping.set)  # first (last in, first out): no restart or kill while the replicas stop
        yield RegionGateway(region_folder.name, gateway, password, index, replicas)


def storage_secret() -> bytes:
    """The secret cloudless-storage as report.md has it made (NAME=value lines), of the credentials set here."""
    return "".join(f"{name}={os.environ[name]}\n" for name in CREDENTIALS if os.environ.get(name)).encode()


def rehearse(
    args: argparse.Namespace,
    build: Path,
    workflow: Workflow,
    iterations: int,
    out: Path,
    train: Callable[..., int],
) -> int:
    """`cloudless-run --invoker openfaas --rehearse`: every region's deployment rehearsed behind a gateway of
    its own (its functions' storage the region's, their peers the other regions'), then `train` (run.py's
    _train, the OpenFaaS invoker's path) against the gateways with the rehearsal's token; the exit status."""
    missing = [r.name for r in workflow.regions if not (build / "regions" / r.name / "stack.yaml").is_file()]
    if missing:
        where = build / "regions" / missing[0] / "stack.yaml"
        print(f"cloudless-run: --rehearse: {where}: not found; compile for OpenFaaS", file=sys.stderr)
        return 2
    try:
        locations = storage_locations(workflow, args.storage, out)
    except ValueError as exc:
        print(f"cloudless-run: {exc}", file=sys.stderr)
        return 2

    def reachable(location: str) -> str:  # a folder as the functions' processes see it
        here = local_folder(location)
        return str(here.resolve()) if here is not None else location

    token = secrets.token_hex(32)  # report.md: openssl rand -hex 32
    values = {STORAGE_SECRET: storage_secret(), TOKEN_SECRET: f"{token}\n".encode()}
    deployed: dict[str, RegionGateway] = {}
    try:
        with ExitStack() as stack:
            for region in workflow.regions:
                overrides = {STORAGE_ENV: reachable(locations[region.name])}
                if len(workflow.regions) > 1:
                    peers = {r.name: reachable(locations[r.name]) for r in workflow.regions if r.name != region.name}
                    overrides[PEERS_ENV] = json.dumps(peers)
                for name in (S3_ENDPOINT_ENV, STORAGE_FAULTS_ENV):  # the local S3 endpoint; faults to inject
                    if os.environ.get(name):
                        overrides[name] = os.environ[name]
                logs = out / "logs" / "openfaas" / (region.name if len(workflow.regions) > 1 else "")
                folder = build / "regions" / region.name
                deployed[region.name] = stack.enter_context(rehearse_region(folder, values, overrides, logs))
                if not args.quiet:
                    gateway = deployed[region.name].gateway
                    shape = ", ".join(f"{f} x{len(u)}" for f, u in gateway.urls.items())
                    print(
                        f"rehearsal: OpenFaaS gateway {gateway.url} ({region.name}): {shape}; logs {logs}", flush=True
                    )
                    print(f"rehearsal: the template's index.py: {deployed[region.name].index}", flush=True)
            several = len(workflow.regions) > 1
            args.gateway = [f"{name}={d.gateway.url}" if several else d.gateway.url for name, d in deployed.items()]
            return train(
                args,
                build,
                workflow,
                iterations,
                out,
                token,
                lambda region: deployed[region].take_down(),
                lambda region, invocation: deployed[region].kill(invocation),
            )
    except RehearsalError as exc:
        print(f"cloudless-run: --rehearse: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    if sys.argv[1:2] == ["watchdog"]:
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM, signal.SIGINT])  # sigwait's, in every thread
        sys.exit(watchdog_main(sys.argv[2:]))
    sys.exit("usage: python -m cloudless.runtimes.rehearsal.openfaas watchdog HOME MAX_INFLIGHT EXEC_S WRITE_S")
