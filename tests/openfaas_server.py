"""A real HTTP server shaped like OpenFaaS's python3-http template (its index.py, with Flask), and a
small gateway shaped like the OpenFaaS gateway's asynchronous endpoint.

The template imports `handler` from the function folder, calls `handle(event, context)` with an
event carrying the request's body, headers, method, query and path, and turns the returned
{"statusCode", "body", "headers"} into the HTTP response.

Secrets: OpenFaaS mounts each secret a function lists as a file named like the secret in
/var/openfaas/secrets/. `mount_secrets` writes them into a folder of their own instead and points the
generated handlers there (their `SECRETS`, the folder they read secrets from); `serve` and
`serve_gateway` take the secrets to mount for as long as they serve.

The gateway answers `POST /async-function/<name>` with 202 Accepted and an X-Call-Id at once, and
runs the function later (OpenFaaS queues the request and a queue worker invokes the function): here
each request gets its own background thread that calls the function's `handle(event, context)`.
Concurrent requests to one function run in concurrent threads, the way a function with several
replicas runs several invocations at once. The reply only goes to the gateway's record of calls
(OpenFaaS would post it to an X-Callback-Url, if the caller gave one).
"""

from __future__ import annotations

import importlib.util
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

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
    def call_handler(path: str):  # noqa: ANN202 - a Flask view
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


@contextmanager
def serve(handler: ModuleType, secrets: Mapping[str, str] | None = None) -> Iterator[str]:
    """Serve the handler on a free loopback port, with `secrets` mounted; yields its URL."""
    server = make_server("127.0.0.1", 0, make_app(handler), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    with mount_secrets([handler], secrets):
        thread.start()
        try:
            yield f"http://127.0.0.1:{server.server_port}/"
        finally:
            server.shutdown()
            thread.join()


# --- the gateway's asynchronous endpoint ---------------------------------------------------------


@dataclass
class Call:
    """One queued invocation: what the function replied once it ran (None while it runs)."""

    function: str
    call_id: str
    body: bytes
    headers: Headers = field(default_factory=Headers)
    status: int | None = None
    reply: Any = None


@dataclass
class Gateway:
    """The running gateway: its URL and every call it accepted, in order."""

    url: str
    calls: list[Call] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds in all for the queued calls to end; True if they all did."""
        deadline = time.monotonic() + timeout
        for thread in list(self.threads):
            thread.join(max(0.0, deadline - time.monotonic()))
        return not any(thread.is_alive() for thread in self.threads)


def make_gateway_app(functions: Mapping[str, Any], gateway: Gateway) -> Flask:
    """`functions`: the handler module (anything with `handle(event, context)`) of each name served."""
    app = Flask("openfaas-gateway")
    lock = threading.Lock()

    @app.post("/async-function/<name>")
    def queue(name: str):  # noqa: ANN202 - a Flask view
        if name not in functions:
            return f"error finding function {name}: not found", 404, {"Content-Type": "text/plain"}
        event = Event()  # read in the request; the function runs after the reply
        # The queue keeps the request's headers and the queue worker sends them on to the function.
        event.headers = Headers(event.headers)
        call = Call(name, str(uuid.uuid4()), event.body, event.headers)

        def invoke() -> None:
            try:
                response = functions[name].handle(event, Context())
                call.status, call.reply = response.get("statusCode", 200), response.get("body", "")
            except Exception as exc:  # noqa: BLE001 - the template would answer 500
                call.status, call.reply = 500, f"{type(exc).__name__}: {exc}"

        thread = threading.Thread(target=invoke, name=f"{name} {call.call_id}", daemon=True)
        with lock:
            gateway.calls.append(call)
            gateway.threads.append(thread)
        thread.start()
        return "", 202, {"X-Call-Id": call.call_id}

    return app


@contextmanager
def serve_gateway(functions: Mapping[str, Any], secrets: Mapping[str, str] | None = None) -> Iterator[Gateway]:
    """Serve the gateway for these functions, with `secrets` mounted, on a free loopback port. Calls still
    running on exit are left to end on their own (daemon threads): a function waiting for a stage that
    never ran would otherwise hold the test up until its key timeout."""
    gateway = Gateway("")
    server = make_server("127.0.0.1", 0, make_gateway_app(functions, gateway), threaded=True)
    gateway.url = f"http://127.0.0.1:{server.server_port}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    with mount_secrets(functions.values(), secrets):
        thread.start()
        try:
            yield gateway
        finally:
            server.shutdown()
            thread.join()
