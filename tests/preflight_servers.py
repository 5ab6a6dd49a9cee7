"""Real HTTP servers standing in, for the pre-flight's tests, for what no emulator here answers: Lambda's account
settings and function configuration (moto implements neither GetAccountSettings nor a function's MemorySize
as deployed), the Kubernetes API's nodes and pods (read by the real kubectl), and a container registry's
Docker Registry HTTP API v2 with its anonymous token service (over TLS, as registries serve it). Each answers
with the real API's JSON shape and status codes."""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlparse

#: (method, path with query, headers) -> (status, headers, body)
Route = Callable[[str, str, dict[str, str]], tuple[int, dict[str, str], bytes]]


@dataclass
class Served:
    url: str
    requests: list[tuple[str, str]] = field(default_factory=list)


@contextmanager
def serve(route: Route, host: str = "127.0.0.1", tls: tuple[Path, Path] | None = None) -> Iterator[Served]:
    """A threaded HTTP(S) server on a free port of `host` answering every request with `route`."""
    served = Served("")

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            served.requests.append((self.command, self.path))
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            status, headers, body = route(self.command, self.path, {k.lower(): v for k, v in self.headers.items()})
            self.send_response(status)
            for key, value in headers.items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        do_GET = do_HEAD = do_POST = _answer

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer((host, 0), Handler)
    scheme = "http"
    if tls is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(str(tls[0]), str(tls[1]))
        server.socket = context.wrap_socket(server.socket, server_side=True)
        scheme = "https"
    served.url = f"{scheme}://{host}:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield served
    finally:
        server.shutdown()
        server.server_close()


def json_answer(status: int, document: Any, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    return status, {"Content-Type": "application/json", **(headers or {})}, json.dumps(document).encode()


def lambda_api(
    concurrency: int, unreserved: int, memory: dict[str, int], timeouts: dict[str, int] | None = None
) -> Route:
    """Lambda's REST API: GetAccountSettings and GetFunctionConfiguration (`memory`: function name -> MB;
    `timeouts`: function name -> seconds, default 900)."""

    def route(method: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        where = urlparse(path).path
        if where == "/2016-08-19/account-settings":
            limits = {
                "CodeSizeUnzipped": 262144000,
                "CodeSizeZipped": 52428800,
                "ConcurrentExecutions": concurrency,
                "TotalCodeSize": 80530636800,
                "UnreservedConcurrentExecutions": unreserved,
            }
            return json_answer(200, {"AccountLimit": limits, "AccountUsage": {"FunctionCount": 0, "TotalCodeSize": 0}})
        prefix, suffix = "/2015-03-31/functions/", "/configuration"
        if where.startswith(prefix) and where.endswith(suffix):
            name = where[len(prefix) : -len(suffix)]
            if name not in memory:
                error = {
                    "Type": "User",
                    "Message": f"Function not found: arn:aws:lambda:us-east-1:123456789012:function:{name}",
                }
                return json_answer(404, error, {"x-amzn-ErrorType": "ResourceNotFoundException"})
            configuration = {"FunctionName": name, "MemorySize": memory[name], "PackageType": "Image"}
            return json_answer(200, configuration | {"Timeout": (timeouts or {}).get(name, 900)})
        return json_answer(404, {"Type": "User", "Message": f"no route {path}"})

    return route


def node(name: str, cpu: str, memory: str, *, ready: bool = True, taint: str | None = None) -> dict[str, Any]:
    """A v1 Node as the API lists it."""
    return {
        "metadata": {"name": name},
        "spec": {"taints": [{"key": "node-role.kubernetes.io/control-plane", "effect": taint}]} if taint else {},
        "status": {
            "allocatable": {"cpu": cpu, "memory": memory, "pods": "110"},
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


def pod(node_name: str, cpu: str, memory: str, function: str | None = None, phase: str = "Running") -> dict[str, Any]:
    """A v1 Pod as the API lists it, on a node, with one container's requests."""
    labels = {"faas_function": function} if function else {"app": "other"}
    container = {"name": "c", "resources": {"requests": {"cpu": cpu, "memory": memory}}}
    return {
        "metadata": {"labels": labels},
        "spec": {"nodeName": node_name, "containers": [container]},
        "status": {"phase": phase},
    }


def kubernetes_api(nodes: list[dict[str, Any]], pods: list[dict[str, Any]]) -> Route:
    """The Kubernetes API paths kubectl get --raw reads: /version, /api/v1/nodes, /api/v1/pods."""

    def route(method: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        where = urlparse(path).path
        if where == "/version":
            return json_answer(200, {"major": "1", "minor": "31", "gitVersion": "v1.31.0"})
        if where == "/api/v1/nodes":
            return json_answer(200, {"kind": "NodeList", "apiVersion": "v1", "items": nodes})
        if where == "/api/v1/pods":
            return json_answer(200, {"kind": "PodList", "apiVersion": "v1", "items": pods})
        return json_answer(404, {"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404})

    return route


def kubeconfig(path: Path, server: str) -> Path:
    """A kubeconfig whose current context is the server, with a bearer token (what kubectl sends)."""
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "test", "cluster": {"server": server}}],
                "users": [{"name": "test", "user": {"token": "test-token"}}],
                "contexts": [{"name": "test", "context": {"cluster": "test", "user": "test"}}],
                "current-context": "test",
            }
        )
    )
    return path


def registry_api(public: set[str], tags: dict[str, set[str]]) -> Route:
    """Docker Registry HTTP API v2 with a token service (as Docker Hub and ghcr.io): a manifest request without
    a token is 401 with a Bearer challenge; the realm gives an anonymous token for pull of a public repository
    only (any other: 401, as a token service refuses anonymous access to a private one); the manifest is 200
    with a token for its repository, 404 for a tag not pushed. The realm is this server (its Host header)."""

    def route(method: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
        base = f"https://{headers['host']}"
        parsed = urlparse(path)
        if parsed.path == "/token":
            scope = parse_qs(parsed.query).get("scope", [""])[0]
            repository = scope.removeprefix("repository:").rsplit(":", 1)[0]
            if repository in public:
                return json_answer(200, {"token": f"anonymous:{repository}", "expires_in": 300})
            return json_answer(401, {"errors": [{"code": "UNAUTHORIZED", "message": "authentication required"}]})
        if parsed.path.startswith("/v2/") and "/manifests/" in parsed.path:
            repository, _, tag = parsed.path.removeprefix("/v2/").partition("/manifests/")
            if headers.get("authorization") != f"Bearer anonymous:{repository}":
                challenge = f'Bearer realm="{base}/token",service="test-registry",scope="repository:{repository}:pull"'
                errors = {"errors": [{"code": "UNAUTHORIZED", "message": "authentication required"}]}
                return json_answer(401, errors, {"WWW-Authenticate": challenge})
            if tag not in tags.get(repository, set()):
                return json_answer(404, {"errors": [{"code": "MANIFEST_UNKNOWN", "message": "manifest unknown"}]})
            kind = "application/vnd.oci.image.manifest.v1+json"
            return 200, {"Content-Type": kind, "Docker-Content-Digest": "sha256:" + "0" * 64}, b"{}"
        return json_answer(404, {"errors": [{"code": "NOT_FOUND"}]})

    return route


def own_address() -> str | None:
    """This machine's address on its network (not a loopback one), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect(("10.255.255.255", 9))  # no packet is sent: the kernel picks the route's source address
            address = probe.getsockname()[0]
        except OSError:
            return None
    return None if address.startswith("127.") else address


def self_signed(folder: Path, address: str) -> tuple[Path, Path]:
    """A certificate (and its key) for the IP address `address`, made with openssl."""
    cert, key = folder / "registry.pem", folder / "registry.key"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=registry",
            "-addext", f"subjectAltName=IP:{address}", "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    return cert, key
