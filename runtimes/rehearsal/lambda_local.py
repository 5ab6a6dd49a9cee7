"""Lambda on this machine, as the service runs a container image function: the rehearsal's invoke.

Each execution environment (sandbox) is a local process of the function's image entry point, the real
runtime interface client (`python -m awslambdaric <handler>`, the image's CMD) in the package folder
(the image's LAMBDA_TASK_ROOT), talking to its own Lambda Runtime API server here
(GET /2018-06-01/runtime/invocation/next, POST .../invocation/{id}/response and .../{id}/error,
POST .../init/error). As on Lambda, a sandbox runs one invocation at a time and stays warm for the next;
concurrent invocations get more sandboxes. The function's configuration (memory, timeout, environment) is
read from the endpoint's Lambda API at each invocation (a changed configuration retires warm sandboxes).
Between invocations a warm sandbox is frozen (SIGSTOP, its background threads included) as Lambda
freezes an execution environment, and thawed for the next:

- timeout: the invocation phase may last `Timeout` seconds from when the runtime takes the event (the init
  phase, module imports, gets INIT_LIMIT_S more, as Lambda's on-demand init); then the sandbox is killed
  and the invoke fails with Lambda's `Sandbox.Timedout`, "RequestId: ... Error: Task timed out after
  N.NN seconds";
- memory: the process's resident memory is read every WATCH_S; above `MemorySize` MB the sandbox is
  killed and the invoke fails with `Runtime.OutOfMemory` (Lambda's cgroup stops it at once; a spike
  shorter than WATCH_S goes unseen here);
- vCPU share: the handler caps torch's threads from its function's CPU share itself (as deployed); with
  `cloudless-run --emulate` the caller passes the share in CLOUDLESS_EMULATE (runtimes/storage/emulation.py);
- a function error is Lambda's error document {"errorType", "errorMessage", "stackTrace", "requestId"}
  (as awslambdaric posts it); Step Functions names the task's error after its errorType, with the
  document as the cause (asl.FunctionError); a runtime that exits is `Runtime.ExitError`, more
  concurrent invocations than the limit `Lambda.TooManyRequestsException`.

The process runs this machine's Python and packages, not the image's (the image build is not rehearsed).
"""

from __future__ import annotations

import itertools
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from ..storage.transient import StorageFaults
from .asl import FunctionError

RUNTIME_API = "/2018-06-01/runtime"
#: Lambda's on-demand init phase limit, seconds (beyond it Lambda retries the init within the invoke)
INIT_LIMIT_S = 10.0
#: how often a sandbox's process is looked at (exit, deadline, memory), seconds
WATCH_S = 0.05
#: Lambda's default concurrency quota of an account in a region
ACCOUNT_CONCURRENCY = 1000


@dataclass(frozen=True)
class FunctionImage:
    """What the image of a deployed function holds: its package folder and handler string (CMD), and the
    environment the platform adds (credentials, endpoint, emulation)."""

    task_root: Path
    handler: str
    environment: dict[str, str] = field(default_factory=dict)


@dataclass
class _Pending:
    request_id: str
    event: bytes
    arn: str
    timeout_s: float
    taken_at: float | None = None
    response: bytes | None = None
    error: dict[str, Any] | None = None
    done: threading.Event = field(default_factory=threading.Event)


def error_document(request_id: str, error_type: str, message: str) -> dict[str, Any]:
    """An error as Lambda reports one the platform raised (a timeout, a runtime that exited)."""
    return {"errorType": error_type, "errorMessage": f"RequestId: {request_id} Error: {message}"}


def _rss_mb(pid: int) -> float:
    """The process's resident memory, MB (0 once it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return 0.0


class Sandbox:
    """One execution environment: the runtime interface client's process and its Runtime API server."""

    def __init__(self, name: str, image: FunctionImage, configuration: dict[str, Any], region: str, log: Path) -> None:
        self.name, self.image, self.configuration, self.log = name, image, configuration, log
        self.inbox: queue.Queue[_Pending] = queue.Queue()
        self.current: _Pending | None = None
        self.init_error: dict[str, Any] | None = None
        self.initialised = threading.Event()
        self.started = time.monotonic()
        self.peak_mb = 0.0
        self.server = _QuietServer(("127.0.0.1", 0), _runtime_api(self))
        threading.Thread(target=self.server.serve_forever, name=f"runtime-api-{name}", daemon=True).start()
        self.tmp = Path(tempfile.mkdtemp(prefix=f"lambda-{name}-"))  # the sandbox's own /tmp
        host, port = str(self.server.server_address[0]), int(self.server.server_address[1])
        memory = int(configuration.get("MemorySize", 128))
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "TZ": ":UTC",
            "TMPDIR": str(self.tmp),
            "PYTHONDONTWRITEBYTECODE": "1",  # the package is the user's build: no __pycache__ in it
            "LAMBDA_TASK_ROOT": str(image.task_root),
            "_HANDLER": image.handler,
            "AWS_LAMBDA_RUNTIME_API": f"{host}:{port}",
            "AWS_LAMBDA_FUNCTION_NAME": name,
            "AWS_LAMBDA_FUNCTION_VERSION": "$LATEST",
            "AWS_LAMBDA_FUNCTION_MEMORY_SIZE": str(memory),
            "AWS_LAMBDA_LOG_GROUP_NAME": f"/aws/lambda/{name}",
            "AWS_LAMBDA_LOG_STREAM_NAME": log.stem,
            "AWS_REGION": region,
            "AWS_DEFAULT_REGION": region,
            **image.environment,
            **(configuration.get("Environment", {}).get("Variables", {}) or {}),
        }
        with log.open("ab") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "awslambdaric", image.handler],
                cwd=image.task_root,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: killed whole
            )

    # -- what the Runtime API server calls ---------------------------------------------------------

    def next_event(self) -> _Pending | None:
        self.initialised.set()
        while self.process.poll() is None:
            try:
                pending = self.inbox.get(timeout=0.2)
            except queue.Empty:
                continue
            pending.taken_at = time.monotonic()
            self.current = pending
            return pending
        return None

    def posted(self, request_id: str, response: bytes | None, error: dict[str, Any] | None) -> bool:
        pending = self.current
        if pending is None or pending.request_id != request_id:
            return False
        pending.response, pending.error = response, error
        self.current = None
        pending.done.set()
        return True

    def posted_init_error(self, error: dict[str, Any]) -> None:
        self.init_error = error

    # -- the invoke ---------------------------------------------------------------------------------

    def invoke(
        self, event: bytes, arn: str, timeout_s: float, memory_mb: float
    ) -> tuple[bytes | None, dict[str, Any] | None, bool]:
        """Run one invocation: (response, error document, whether the sandbox may be used again)."""
        pending = _Pending(uuid.uuid4().hex, event, arn, timeout_s)
        self._signal(signal.SIGCONT)  # thawed (frozen since its last invocation)
        self._write_log(f"START RequestId: {pending.request_id} Version: $LATEST")
        began = time.monotonic()
        self.inbox.put(pending)
        reusable = True
        while not pending.done.wait(WATCH_S):
            now = time.monotonic()
            self.peak_mb = max(self.peak_mb, _rss_mb(self.process.pid))
            if self.process.poll() is not None:
                if self.init_error is not None:
                    pending.error = {**self.init_error, "requestId": pending.request_id}
                else:
                    why = f"Runtime exited with error: exit status {self.process.returncode}"
                    pending.error = error_document(pending.request_id, "Runtime.ExitError", why)
                reusable = False
                break
            limit = (
                pending.taken_at + timeout_s
                if pending.taken_at is not None
                else self.started + INIT_LIMIT_S + timeout_s
            )
            if now > limit:
                self.kill()
                why = f"Task timed out after {timeout_s:.2f} seconds"
                pending.error = error_document(pending.request_id, "Sandbox.Timedout", why)
                reusable = False
                break
            if self.peak_mb > memory_mb:
                self.kill()
                why = "Runtime exited with error: signal: killed"
                pending.error = error_document(pending.request_id, "Runtime.OutOfMemory", why)
                reusable = False
                break
        self.current = None
        if reusable:  # as Lambda freezes an environment between invocations: its threads too
            self._freeze()
        took = (time.monotonic() - (pending.taken_at or began)) * 1000
        self._write_log(f"END RequestId: {pending.request_id}")
        self._write_log(
            f"REPORT RequestId: {pending.request_id}\tDuration: {took:.2f} ms\tMemory Size: {memory_mb:.0f} MB\t"
            f"Max Memory Used: {self.peak_mb:.0f} MB"
        )
        return pending.response, pending.error, reusable

    def _write_log(self, line: str) -> None:
        with self.log.open("ab") as out:
            out.write(f"{line}\n".encode())

    def _freeze(self) -> None:
        """SIGSTOP, and back once the process is stopped (the signal is delivered asynchronously)."""
        self._signal(signal.SIGSTOP)
        status = Path(f"/proc/{self.process.pid}/status")
        for _ in range(1000):
            try:
                if "State:\tT" in status.read_text():
                    return
            except OSError:
                return
            time.sleep(0.001)

    def _signal(self, number: int) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, number)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.process.wait()

    def close(self) -> None:
        self.kill()
        self.server.shutdown()
        self.server.server_close()
        shutil.rmtree(self.tmp, ignore_errors=True)


class _QuietServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A runtime killed mid-request (a timeout, the end of the rehearsal) resets its connection: not news."""


def _runtime_api(sandbox: Sandbox) -> type[BaseHTTPRequestHandler]:
    """The Lambda Runtime API of one sandbox (the endpoints awslambdaric calls)."""

    class RuntimeApi(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _reply(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            try:
                self.end_headers()
                self.wfile.write(body)
            except OSError:  # the runtime was killed meanwhile (a timeout, the end of the rehearsal)
                self.close_connection = True

        def _body(self) -> bytes:
            return self.rfile.read(int(self.headers.get("Content-Length") or 0))

        def do_GET(self) -> None:
            if self.path != f"{RUNTIME_API}/invocation/next":
                return self._reply(404, b'{"errorType": "InvalidRequest"}')
            pending = sandbox.next_event()
            if pending is None:  # the runtime is gone: nobody to answer
                self.close_connection = True
                return None
            deadline_ms = int((time.time() + pending.timeout_s) * 1000)
            headers = {
                "Lambda-Runtime-Aws-Request-Id": pending.request_id,
                "Lambda-Runtime-Deadline-Ms": str(deadline_ms),
                "Lambda-Runtime-Invoked-Function-Arn": pending.arn,
                "Lambda-Runtime-Trace-Id": f"Root=1-{uuid.uuid4().hex[:8]}-{uuid.uuid4().hex[:24]};Sampled=0",
            }
            return self._reply(200, pending.event, headers)

        def do_POST(self) -> None:
            body = self._body()
            parts = self.path.removeprefix(RUNTIME_API + "/").split("/")
            if parts == ["init", "error"]:
                sandbox.posted_init_error(_document(body, self.headers.get("Lambda-Runtime-Function-Error-Type")))
                return self._reply(202, b'{"status": "OK"}')
            if len(parts) == 3 and parts[0] == "invocation" and parts[2] in ("response", "error"):
                if parts[2] == "response":
                    known = sandbox.posted(parts[1], body, None)
                else:
                    error = _document(body, self.headers.get("Lambda-Runtime-Function-Error-Type"))
                    known = sandbox.posted(parts[1], None, error)
                if not known:
                    return self._reply(400, b'{"errorType": "InvalidRequestID"}')
                return self._reply(202, b'{"status": "OK"}')
            return self._reply(404, b'{"errorType": "InvalidRequest"}')

    return RuntimeApi


def _revision(configuration: dict[str, Any]) -> str:
    """What changes with every configuration update (a warm sandbox of another is retired)."""
    return str(configuration.get("RevisionId") or configuration.get("LastModified") or "")


def _document(body: bytes, error_type: str | None) -> dict[str, Any]:
    try:
        document = json.loads(body or b"{}")
    except ValueError:
        document = {"errorMessage": body.decode(errors="replace")}
    if not isinstance(document, dict):
        document = {"errorMessage": str(document)}
    if not document.get("errorType") and error_type:
        document["errorType"] = error_type
    return document


class LambdaService:
    """The invoke (`service(function, payload)`, asl.Invoke) of the functions in `images` (by deployed
    name); `configuration(function)` reads a function's configuration (GetFunctionConfiguration)."""

    def __init__(
        self,
        images: dict[str, FunctionImage],
        configuration: Callable[[str], dict[str, Any]],
        logs: Path,
        *,
        concurrency: int = ACCOUNT_CONCURRENCY,
        throttled: float = 0.0,
        seed: int = 0,
    ) -> None:
        self.images, self.configuration, self.logs, self.concurrency = images, configuration, logs, concurrency
        # fault injection: this share of invokes answers TooManyRequestsException
        self._throttled = StorageFaults(throttled, seed).drawer(("throttled",), per_process=False)
        logs.mkdir(parents=True, exist_ok=True)
        self._idle: dict[str, list[Sandbox]] = {}
        self._busy: set[Sandbox] = set()
        self._lock = threading.Lock()
        self._numbers = itertools.count()
        self._active = 0
        self._shut = False
        self._down: set[str] = set()  # functions whose region is gone (fault injection)
        self.started = 0  # sandboxes started (cold starts)
        self.invocations = 0

    @property
    def throttles(self) -> int:
        """Invokes answered TooManyRequestsException by the injected throttling."""
        return self._throttled.injected.get("throttled", 0)

    def __call__(self, function: str, payload: Any) -> Any:
        name = function.rsplit(":function:", 1)[-1].split(":")[0]  # an ARN or a name (no qualifier)
        image = self.images.get(name)
        if image is None:
            raise FunctionError("Lambda.ResourceNotFoundException", f"Function not found: {function}")
        if name in self._down:
            raise FunctionError("Lambda.ServiceException", f"{name}: its region is down (--fail-region)")
        configuration = self.configuration(name)
        revision = _revision(configuration)
        with self._lock:
            self.invocations += 1
            if self._active >= self.concurrency or self._throttled.draw() is not None:
                raise FunctionError("Lambda.TooManyRequestsException", "Rate Exceeded.")
            self._active += 1
            idle = self._idle.setdefault(name, [])
            stale = [s for s in idle if _revision(s.configuration) != revision]
            for old in stale:
                idle.remove(old)
            sandbox = idle.pop() if idle else None
            number = next(self._numbers)
        try:
            for old in stale:
                old.close()
            if sandbox is None:
                self.started += 1
                region = str(configuration.get("FunctionArn", "arn:aws:lambda:us-east-1")).split(":")[3]
                sandbox = Sandbox(name, image, configuration, region, self.logs / f"{name}-{number}.log")
            with self._lock:
                self._busy.add(sandbox)
            response, error, reusable = sandbox.invoke(
                json.dumps(payload).encode(),
                str(configuration.get("FunctionArn", function)),
                float(configuration.get("Timeout", 3)),
                float(configuration.get("MemorySize", 128)),
            )
        finally:
            with self._lock:
                self._active -= 1
                if sandbox is not None:
                    self._busy.discard(sandbox)
        with self._lock:
            keep = reusable and not self._shut
            if keep:
                self._idle.setdefault(name, []).append(sandbox)
        if not keep:
            sandbox.close()
        if error is not None:
            raise FunctionError(str(error.get("errorType") or "Lambda.Unknown"), json.dumps(error))
        try:
            return json.loads(response or b"null")
        except ValueError:
            return (response or b"").decode(errors="replace")

    def take_down(self, names: set[str]) -> None:
        """Fault injection: the region of these functions is gone. Their sandboxes are killed (an invocation
        under way ends as a killed runtime does), and every later invocation of them fails."""
        with self._lock:
            self._down |= names
            victims = [s for s in self._busy if s.name in names]
            for name in names:
                victims += self._idle.pop(name, [])
        for sandbox in victims:
            sandbox.kill()

    def close(self) -> None:
        """Every sandbox's process and server ended (warm ones and any still running)."""
        with self._lock:
            self._shut = True
            sandboxes = [s for idle in self._idle.values() for s in idle] + list(self._busy)
            self._idle.clear()
        for sandbox in sandboxes:
            sandbox.close()
