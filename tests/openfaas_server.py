"""A real HTTP server shaped like OpenFaaS's python3-http template (its index.py, with Flask).

The template imports `handler` from the function folder, calls `handle(event, context)` with an
event carrying the request's body, headers, method, query and path, and turns the returned
{"statusCode", "body", "headers"} into the HTTP response.
"""

from __future__ import annotations

import importlib.util
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from flask import Flask, request
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
def serve(handler: ModuleType) -> Iterator[str]:
    """Serve the handler on a free loopback port; yields its URL."""
    server = make_server("127.0.0.1", 0, make_app(handler), threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/"
    finally:
        server.shutdown()
        thread.join()
