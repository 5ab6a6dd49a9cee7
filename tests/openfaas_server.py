"""A real HTTP server shaped like OpenFaaS's python3-http template (its index.py, with Flask) behind a
watchdog's concurrency limit, and a small gateway shaped like the OpenFaaS CE gateway.

The template imports `handler` from the function folder, calls `handle(event, context)` with an
event carrying the request's body, headers, method, query and path, and turns the returned
{"statusCode", "body", "headers"} into the HTTP response. In front of it, the of-watchdog's
`max_inflight` (the stack sets "1"): a request arriving while the instance already runs that many is
answered 429 at once and never reaches the handler.

Secrets: OpenFaaS mounts each secret a function lists as a file named like the secret in
/var/openfaas/secrets/. `mount_secrets` writes them into a folder of their own instead and points the
generated handlers there (their `SECRETS`, the folder they read secrets from); `serve` and
`serve_gateway` take the secrets to mount for as long as they serve.

The gateway runs `replicas` instances of each function (each a server of its own on a loopback port) and
routes every call to one of them at random, as the CE provider does (no load balancing by busyness):
- `POST /function/<name>`, the synchronous route: the call is proxied to an instance and the instance's
  answer (a 429 included: CE does not retry it) goes back to the caller;
- `POST /async-function/<name>`: 202 Accepted and an X-Call-Id at once; the call is queued and delivered
  later. `queue="ce"` delivers them as CE's default queue-worker does, one at a time (max_inflight 1:
  the next is delivered when the previous call's function has answered), and a 429 is not retried;
  `queue="parallel"` delivers each at once in a thread of its own (a queue-worker with a large
  max_inflight). The reply only goes to the gateway's record of calls (OpenFaaS would post it to an
  X-Callback-Url, if the caller gave one).
"""

from __future__ import annotations

import importlib.util
import json
import queue as queues
import random
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from flask import Flask, request
from werkzeug.datastructures import Headers
from werkzeug.serving import make_server


class Event:
    def __init__(self) -> None:
        self.body = request.get_data()
        self.headers = request.headers
        self.method = request.method
        self.query = request.args
        self.path = request.path


class Context:
    hostname = "localhost"


def load_handler(package: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, package / "handler.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_app(handler: ModuleType) -> Flask:
    app = Flask("openfaas-python3-http")

    @app.route("/", defaults={"path": ""}, methods=["GET", "PUT", "POST", "PATCH", "DELETE"])
    @app.route("/<path:path>", methods=["GET", "PUT", "POST", "PATCH", "DELETE"])
    def call_handler(path: str):
        response = handler.handle(Event(), Context())
        return response.get("body", ""), response.get("statusCode", 200), response.get("headers", {})

    return app


@contextmanager
def mount_secrets(handlers: Iterable[Any], secrets: Mapping[str, str] | None) -> Iterator[Path | None]:
    """Mount `secrets` (name -> content) for these handlers, as OpenFaaS mounts a function's secrets: one
    file per secret, in a folder of their own that each generated handler's `SECRETS` names while this
    lasts (handlers without one, stubs, are left alone). None mounts nothing. Yields the folder."""
    if secrets is None:
        yield None
        return
    patched = [h for h in handlers if hasattr(h, "SECRETS")]
    saved = [h.SECRETS for h in patched]
    with tempfile.TemporaryDirectory(prefix="openfaas-secrets-") as folder:
        for name, content in secrets.items():
            (Path(folder) / name).write_text(content)
        for handler in patched:
            handler.SECRETS = Path(folder)
        try:
            yield Path(folder)
        finally:
            for handler, previous in zip(patched, saved, strict=True):
                handler.SECRETS = previous


class Watchdog:
    """The of-watchdog's `max_inflight` in front of an app: with that many requests running, another is
    answered 429 ("Concurrent request limit exceeded") without reaching the app. None: no limit."""

    def __init__(self, app: Any, max_inflight: int | None) -> None:
        self.app, self.max_inflight = app, max_inflight
        self.inflight = self.most = self.refused = 0
        self.lock = threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> Any:
        with self.lock:
            if self.max_inflight is not None and self.inflight >= self.max_inflight:
                self.refused += 1
                start_response("429 Too Many Requests", [("Content-Type", "text/plain")])
                return [f"Concurrent request limit exceeded. Max concurrent requests: {self.max_inflight}\n".encode()]
            self.inflight += 1
            self.most = max(self.most, self.inflight)
        try:
            # The template's reply is whole once the app returns (no streaming): read it before leaving.
            return list(self.app(environ, start_response))
        finally:
            with self.lock:
                self.inflight -= 1


@contextmanager
def serve(handler: Any, secrets: Mapping[str, str] | None = None, *, max_inflight: int | None = None) -> Iterator[str]:
    """Serve the handler on a free loopback port (behind a watchdog's `max_inflight`), with `secrets`
    mounted; yields its URL."""
    with _serving(Watchdog(make_app(handler), max_inflight)) as url, mount_secrets([handler], secrets):
        yield url


@contextmanager
def _serving(app: Any) -> Iterator[str]:
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/"
    finally:
        server.shutdown()
        thread.join()


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
    """The running gateway: its URL, every call it accepted in order, and each function's instances."""

    url: str
    calls: list[Call] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)
    instances: dict[str, list[Watchdog]] = field(default_factory=dict)
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


def _proxy(url: str, call: Call, timeout: float) -> tuple[int, bytes, str]:
    """POST the call to an instance: (status, body, content type), a 4xx/5xx answer included."""
    headers = {k: v for k, v in call.headers.items() if k.lower() not in ("host", "content-length")}
    request = urllib.request.Request(url, data=call.body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read(), response.headers.get("Content-Type", "text/plain")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers.get("Content-Type", "text/plain")


def make_gateway_app(
    urls: Mapping[str, list[str]],
    gateway: Gateway,
    *,
    queue: Literal["ce", "parallel"] = "ce",
    upstream_timeout: float = 600.0,
    seed: int = 0,
) -> Flask:
    """`urls`: the instances' URLs of each function served."""
    app = Flask("openfaas-gateway")
    lock = threading.Lock()
    rng = random.Random(seed)

    def deliver(call: Call) -> None:
        with lock:
            call.instance = rng.randrange(len(urls[call.function]))
        call.began = time.time()
        try:
            status, body, _ = _proxy(urls[call.function][call.instance], call, upstream_timeout)
            call.status, call.reply = status, body.decode(errors="replace")
        except OSError as exc:  # the gateway's upstream timeout, or the instance went away
            call.status, call.reply = 502, f"{type(exc).__name__}: {exc}"
        call.ended = time.time()

    def record(call: Call) -> None:
        with lock:
            gateway.calls.append(call)

    def unknown(name: str) -> tuple[str, int, dict[str, str]]:
        return f"error finding function {name}: not found", 404, {"Content-Type": "text/plain"}

    @app.post("/function/<name>")
    def call_sync(name: str):
        if name not in urls:
            return unknown(name)
        call = Call(name, str(uuid.uuid4()), request.get_data(), Headers(request.headers), route="sync")
        record(call)
        deliver(call)
        if call.status == 502:
            return call.reply, 502, {"Content-Type": "text/plain"}
        return call.reply, call.status, {"Content-Type": "application/json", "X-Call-Id": call.call_id}

    @app.post("/async-function/<name>")
    def call_async(name: str):
        if name not in urls:
            return unknown(name)
        # The queue keeps the request's headers and the queue worker sends them on to the function.
        call = Call(name, str(uuid.uuid4()), request.get_data(), Headers(request.headers), route="async")
        record(call)
        if queue == "ce":
            gateway.pending.put(call)
        else:
            thread = threading.Thread(target=deliver, args=(call,), name=f"{name} {call.call_id}", daemon=True)
            with lock:
                gateway.threads.append(thread)
            thread.start()
        return "", 202, {"X-Call-Id": call.call_id}

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
    each as `replicas[name]` instances (default 1) behind a watchdog's `max_inflight`, with `secrets`
    mounted, on free loopback ports. Calls still running on exit are left to end on their own (daemon
    threads): a function waiting for a stage that never ran would otherwise hold the test up until its
    key timeout."""
    gateway = Gateway("")
    with ExitStack() as stack:
        stack.enter_context(mount_secrets(functions.values(), secrets))
        urls: dict[str, list[str]] = {}
        for name, handler in functions.items():
            for _ in range((replicas or {}).get(name, 1)):
                watchdog = Watchdog(make_app(handler), max_inflight)
                gateway.instances.setdefault(name, []).append(watchdog)
                urls.setdefault(name, []).append(stack.enter_context(_serving(watchdog)))
        app = make_gateway_app(urls, gateway, queue=queue, upstream_timeout=upstream_timeout)
        gateway.url = stack.enter_context(_serving(app)).rstrip("/")
        try:
            yield gateway
        finally:
            gateway.pending.put(None)  # the queue worker stops after what it is delivering


def results(calls: Iterable[Call]) -> list[dict[str, Any]]:
    """The replies of these calls as JSON (None where a reply is not JSON)."""
    out = []
    for call in calls:
        try:
            out.append(json.loads(call.reply))
        except (TypeError, ValueError):
            out.append(None)
    return out
