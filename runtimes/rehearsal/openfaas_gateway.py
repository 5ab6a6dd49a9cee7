"""A gateway that behaves as OpenFaaS Community Edition's, in front of function instances behind an
of-watchdog-like front: the OpenFaaS rehearsal's (`runtimes/rehearsal/openfaas.py`: each instance a process)
and the tests' (`serve_gateway`: instances of handler modules in this process).

What it follows, from the sources:
- openfaas/faas gateway/main.go: `/function/<name>` (and `/async-function/<name>`) are not behind the
  gateway's basic auth; every `/system/...` route is (`auth.DecorateWithBasicAuth`: what `faas-cli login`
  stores and faas-cli sends on `secret create`, `deploy`, `list`).
- gateway/handlers/forwarding_proxy.go: the call is forwarded with its headers (hop-by-hop ones dropped) and
  the function's answer goes back as it is, a 429 included (no retry); an upstream error or the gateway's
  upstream timeout is a 502 with no body. Each call gets an X-Call-Id (callid_middleware.go).
- faas-netes k8s/proxy.go (EndpointResolver): the provider picks one of the function's ready endpoints at
  random (`rand.Intn`), busy or not.
- faas-netes pkg/handlers/secrets.go: POST/PUT/DELETE /system/secrets take {"name", "value" or "rawValue"}
  and answer 202; GET lists the names.
- The CE queue-worker delivers asynchronous calls one at a time and does not retry a 429.
- of-watchdog (faas-middleware concurrency-limiter, executor/http_runner.go): with `max_inflight` requests
  running, another is answered 429 "Concurrent request limit exceeded. Max concurrent requests: N" without
  reaching the function; a request running past `exec_timeout` is answered 504 with no body (header
  X-OpenFaaS-Internal: of-watchdog) while the function's own code runs on (http mode cannot stop it), and
  the watchdog counts it no longer in flight. Its HTTP server's write_timeout cuts an answer later than it.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hmac
import importlib.util
import json
import queue as queues
import random
import socket
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from flask import Flask, request
from werkzeug.datastructures import Headers
from werkzeug.serving import WSGIRequestHandler, make_server

from .openfaas_index import make_app

#: the of-watchdog's answer to a request beyond max_inflight
LIMIT_EXCEEDED = "Concurrent request limit exceeded. Max concurrent requests: {}\n"
#: the user name of the gateway's basic auth (the helm chart's, and faas-cli login's default)
ADMIN_USER = "admin"
#: hop-by-hop headers the gateway does not forward (forwarding_proxy.go's hopHeaders), and the ones the
#: HTTP client sets itself
_NOT_FORWARDED = {
    "connection",
    "proxy-connection",
    "keep-alive",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
    "host",
    "content-length",
}


def load_handler(package: Path, name: str) -> ModuleType:
    """A function package's handler.py as a module of this process (the tests' instances)."""
    spec = importlib.util.spec_from_file_location(name, package / "handler.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_secrets(folder: Path, secrets: Mapping[str, str | bytes]) -> None:
    """Mount `secrets` (name -> content) into `folder` as OpenFaaS does: one file per secret, named as it."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in secrets.items():
        (folder / name).write_bytes(content.encode() if isinstance(content, str) else content)


@contextmanager
def mount_secrets(handlers: Iterable[Any], secrets: Mapping[str, str] | None) -> Iterator[Path | None]:
    """In-process instances: mount `secrets` in a folder of their own that each generated handler's `SECRETS`
    names while this lasts (handlers without one, stubs, are left alone). None mounts nothing."""
    if secrets is None:
        yield None
        return
    patched = [h for h in handlers if hasattr(h, "SECRETS")]
    saved = [h.SECRETS for h in patched]
    with tempfile.TemporaryDirectory(prefix="openfaas-secrets-") as folder:
        write_secrets(Path(folder), secrets)
        for handler in patched:
            handler.SECRETS = Path(folder)
        try:
            yield Path(folder)
        finally:
            for handler, previous in zip(patched, saved, strict=True):
                handler.SECRETS = previous


class Watchdog:
    """The of-watchdog's front of one instance, as WSGI around the function's app: `max_inflight` (None or 0:
    no limit), `exec_timeout` and `write_timeout` seconds (None: none). The watchdog's HTTP server may write
    an answer only until `write_timeout` after the request came (Go's http.Server WriteTimeout): an answer
    later than that, or one still running then (before exec_timeout), never reaches the caller, whose
    connection is closed without one."""

    def __init__(
        self, app: Any, max_inflight: int | None, exec_timeout: float | None = None, write_timeout: float | None = None
    ) -> None:
        self.app, self.max_inflight = app, max_inflight or None
        self.exec_timeout, self.write_timeout = exec_timeout, write_timeout
        self.inflight = self.most = self.refused = self.timed_out = self.dropped = 0
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        with self.lock:
            if self.max_inflight is not None and self.inflight >= self.max_inflight:
                self.refused += 1
                start_response("429 Too Many Requests", [("Content-Type", "text/plain")])
                return [LIMIT_EXCEEDED.format(self.max_inflight).encode()]
            self.inflight += 1
            self.most = max(self.most, self.inflight)
        began = time.monotonic()
        try:
            if self.exec_timeout is None and self.write_timeout is None:
                # The template's reply is whole once the app returns (no streaming): read it before leaving.
                return list(self.app(environ, start_response))
            return self._within_timeouts(environ, start_response, began)
        finally:
            with self.lock:
                self.inflight -= 1

    def _within_timeouts(self, environ: dict[str, Any], start_response: Any, began: float) -> list[bytes]:
        answer: dict[str, Any] = {}

        def run() -> None:
            def capture(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Callable[[bytes], None]:
                answer["start"] = (status, headers)
                return lambda data: None

            try:
                answer["body"] = b"".join(self.app(environ, capture))
            except Exception as exc:  # noqa: BLE001 - the watchdog answers 500 for any upstream error
                answer["error"] = exc

        worker = threading.Thread(target=run, name="watchdog upstream", daemon=True)
        worker.start()
        worker.join(min(t for t in (self.exec_timeout, self.write_timeout) if t is not None))
        elapsed = time.monotonic() - began
        if self.write_timeout is not None and elapsed >= self.write_timeout:
            if not worker.is_alive() or self.exec_timeout is None or self.write_timeout < self.exec_timeout:
                return self._drop(environ)
        duration = [("X-Duration-Seconds", f"{elapsed:f}"), ("X-OpenFaaS-Internal", "of-watchdog")]
        if worker.is_alive():  # past exec_timeout: the caller is answered, the function's code runs on
            with self.lock:
                self.timed_out += 1
            start_response("504 Gateway Timeout", duration)
            return []
        if "error" in answer or "start" not in answer:
            start_response("500 Internal Server Error", duration)
            return []
        status, headers = answer["start"]
        start_response(status, [*headers, duration[0]])
        return [answer["body"]]

    def _drop(self, environ: dict[str, Any]) -> list[bytes]:
        """Past write_timeout: the connection closes with no answer (the server's write fails)."""
        with self.lock:
            self.dropped += 1
        connection = environ.get("werkzeug.socket")
        if connection is not None:
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        return []


class _QuietHandler(WSGIRequestHandler):
    """No line per request on the caller's stderr (a run prints its own progress)."""

    def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
        pass


@contextmanager
def serving(app: Any) -> Iterator[str]:
    """Serve a WSGI app on a free loopback port (a thread per request); yields its URL (with a final /)."""
    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=_QuietHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/"
    finally:
        server.shutdown()
        thread.join()


@contextmanager
def serve(handler: Any, secrets: Mapping[str, str] | None = None, *, max_inflight: int | None = None) -> Iterator[str]:
    """Serve a handler module in this process through the template's app behind a watchdog's `max_inflight`,
    with `secrets` mounted; yields its URL."""
    with serving(Watchdog(make_app(handler), max_inflight)) as url, mount_secrets([handler], secrets):
        yield url


# --- the gateway ---------------------------------------------------------------------------------


@dataclass
class Call:
    """One invocation through the gateway: the route, the instance it went to, and what the function
    replied (None while it runs)."""

    function: str
    call_id: str
    body: bytes
    headers: Headers = field(default_factory=Headers)
    route: str = "async"
    instance: int | None = None
    status: int | None = None
    reply: Any = None
    began: float = 0.0
    ended: float = 0.0


@dataclass
class Gateway:
    """The running gateway: its URL, every call it accepted in order, each function's instances' URLs (and,
    in-process, their watchdogs), the secrets created through it, and its basic-auth password (None: no
    auth on /system)."""

    url: str
    calls: list[Call] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)
    urls: dict[str, list[str]] = field(default_factory=dict)
    instances: dict[str, list[Watchdog]] = field(default_factory=dict)
    secrets: dict[str, bytes] = field(default_factory=dict)
    password: str | None = None
    pending: queues.Queue[Call | None] = field(default_factory=queues.Queue)

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds in all for the queued calls to end; True if they all did."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.pending.unfinished_tasks == 0:
                break
            time.sleep(0.01)
        calls = [t for t in self.threads if t.name != "queue-worker"]  # the queue worker runs until the end
        for thread in calls:
            thread.join(max(0.0, deadline - time.monotonic()))
        return self.pending.unfinished_tasks == 0 and not any(t.is_alive() for t in calls)


def _proxy(url: str, call: Call, timeout: float) -> tuple[int, bytes, list[tuple[str, str]]]:
    """POST the call to an instance: (status, body, headers), a 4xx/5xx answer included."""
    headers = {k: v for k, v in call.headers.items() if k.lower() not in _NOT_FORWARDED}
    request = urllib.request.Request(url, data=call.body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read(), list(response.headers.items())
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), list(exc.headers.items())


def basic_auth_header(password: str, user: str = ADMIN_USER) -> str:
    """The Authorization header faas-cli sends once logged in."""
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def make_gateway_app(
    gateway: Gateway,
    *,
    queue: Literal["ce", "parallel"] = "ce",
    upstream_timeout: float = 600.0,
    seed: int | None = 0,
) -> Flask:
    """The gateway's routes over `gateway.urls` (each function's instances' URLs: functions deployed later
    are served from then on). `queue`: "ce" delivers asynchronous calls one at a time, as CE's queue-worker;
    "parallel" each at once in a thread of its own (a queue-worker with a large max_inflight)."""
    app = Flask("openfaas-gateway")
    lock = threading.Lock()
    rng = random.Random(seed)
    urls = gateway.urls

    def deliver(call: Call) -> list[tuple[str, str]]:
        with lock:
            call.instance = rng.randrange(len(urls[call.function]))
        call.began = time.time()
        headers: list[tuple[str, str]] = []
        try:
            status, body, headers = _proxy(urls[call.function][call.instance], call, upstream_timeout)
            call.status, call.reply = status, body.decode(errors="replace")
        except OSError as exc:  # the gateway's upstream timeout, or the instance went away
            call.status, call.reply = 502, f"{type(exc).__name__}: {exc}"
        call.ended = time.time()
        return headers

    def accept(name: str, route: str) -> Call:
        """The request as a call, recorded (headers kept: the queue worker sends them on too)."""
        call = Call(name, str(uuid.uuid4()), request.get_data(), Headers(request.headers), route=route)
        with lock:
            gateway.calls.append(call)
        return call

    def unknown(name: str) -> tuple[str, int, dict[str, str]]:
        return f"error finding function {name}: not found", 404, {"Content-Type": "text/plain"}

    @app.post("/function/<name>")
    def call_sync(name: str) -> Any:
        if name not in urls:
            return unknown(name)
        call = accept(name, "sync")
        headers = deliver(call)
        if call.status == 502:  # forwarding_proxy.go: StatusBadGateway, no body
            return "", 502, {"X-Call-Id": call.call_id}
        kept = [(k, v) for k, v in headers if k.lower() not in _NOT_FORWARDED and k.lower() not in ("date", "server")]
        return call.reply, call.status, [*kept, ("X-Call-Id", call.call_id)]

    @app.post("/async-function/<name>")
    def call_async(name: str) -> Any:
        if name not in urls:
            return unknown(name)
        call = accept(name, "async")
        if queue == "ce":
            gateway.pending.put(call)
        else:
            thread = threading.Thread(target=deliver, args=(call,), name=f"{name} {call.call_id}", daemon=True)
            with lock:
                gateway.threads.append(thread)
            thread.start()
        return "", 202, {"X-Call-Id": call.call_id}

    @app.before_request
    def basic_auth() -> Any:
        if gateway.password is None or not request.path.startswith("/system/"):
            return None
        given = request.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode(), basic_auth_header(gateway.password).encode()):
            return None
        return "Unauthorized\n", 401, {"WWW-Authenticate": 'Basic realm="Restricted"'}

    @app.route("/system/secrets", methods=["GET", "POST", "PUT", "DELETE"])
    def secrets() -> Any:
        if request.method == "GET":
            listed = [{"name": name} for name in sorted(gateway.secrets)]
            return json.dumps(listed), 200, {"Content-Type": "application/json"}
        try:
            secret = json.loads(request.get_data())
            name = secret["name"]
            raw = secret.get("rawValue")  # faas-cli --from-file sends the bytes, base64
            value = base64.b64decode(raw) if raw else str(secret.get("value", "")).encode()
        except (ValueError, KeyError, TypeError, binascii.Error):
            return "", 400
        with lock:
            exists = name in gateway.secrets
            if request.method == "POST" and exists or request.method in ("PUT", "DELETE") and not exists:
                return "", 409 if exists else 404
            if request.method == "DELETE":
                del gateway.secrets[name]
            else:
                gateway.secrets[name] = value
        return "", 202

    @app.get("/system/functions")
    def functions() -> Any:
        listed = [{"name": name, "replicas": len(found)} for name, found in sorted(urls.items())]
        return json.dumps(listed), 200, {"Content-Type": "application/json"}

    @app.get("/healthz")
    def healthz() -> Any:
        return "OK", 200

    if queue == "ce":

        def queue_worker() -> None:  # one at a time, no retry of a 429
            while (call := gateway.pending.get()) is not None:
                try:
                    deliver(call)
                finally:
                    gateway.pending.task_done()

        worker = threading.Thread(target=queue_worker, name="queue-worker", daemon=True)
        gateway.threads.append(worker)
        worker.start()
    return app


@contextmanager
def gateway_serving(
    *, queue: Literal["ce", "parallel"] = "ce", upstream_timeout: float = 600.0, password: str | None = None
) -> Iterator[Gateway]:
    """A gateway with no function yet, on a free loopback port (`gateway.urls` gets each deployed one)."""
    gateway = Gateway("", password=password)
    app = make_gateway_app(gateway, queue=queue, upstream_timeout=upstream_timeout)
    with serving(app) as url:
        gateway.url = url.rstrip("/")
        try:
            yield gateway
        finally:
            gateway.pending.put(None)  # the queue worker stops after what it is delivering


@contextmanager
def serve_gateway(
    functions: Mapping[str, Any],
    secrets: Mapping[str, str] | None = None,
    *,
    replicas: Mapping[str, int] | None = None,
    max_inflight: int | None = 1,
    queue: Literal["ce", "parallel"] = "ce",
    upstream_timeout: float = 600.0,
) -> Iterator[Gateway]:
    """Serve the gateway for these functions (name -> handler module, anything with `handle(event, context)`),
    each as `replicas[name]` instances of this process (default 1) behind a watchdog's `max_inflight`, with
    `secrets` mounted, on free loopback ports. Calls still running on exit are left to end on their own
    (daemon threads): a function waiting for a stage that never ran would otherwise hold the caller up until
    its key timeout."""
    with ExitStack() as stack:
        stack.enter_context(mount_secrets(functions.values(), secrets))
        gateway = stack.enter_context(gateway_serving(queue=queue, upstream_timeout=upstream_timeout))
        for name, handler in functions.items():
            found = []
            for _ in range((replicas or {}).get(name, 1)):
                watchdog = Watchdog(make_app(handler), max_inflight)
                gateway.instances.setdefault(name, []).append(watchdog)
                found.append(stack.enter_context(serving(watchdog)))
            gateway.urls[name] = found
        yield gateway


def results(calls: Iterable[Call]) -> list[dict[str, Any]]:
    """The replies of these calls as JSON (None where a reply is not JSON)."""
    out = []
    for call in calls:
        try:
            out.append(json.loads(call.reply))
        except (TypeError, ValueError):
            out.append(None)
    return out
