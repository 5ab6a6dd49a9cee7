"""The request handling of OpenFaaS's `python3-http-debian` template: what its index.py does with a request,
for the OpenFaaS rehearsal (`cloudless-run --invoker openfaas --rehearse`) and the tests.

Followed: https://github.com/openfaas/python-flask-template, template/python3-http-debian/index.py (MIT
licence, OpenFaaS Author(s)), and the template's Dockerfile (of-watchdog in `mode=http` runs
`fprocess="python index.py"` in /home/app with the function's folder copied into /home/app/function/,
`upstream_url=http://127.0.0.1:5000`). What this module keeps of it:
- Flask, one route for every path with the methods GET, PUT, POST, PATCH and DELETE, calling
  `handler.handle(event, context)` of `from function import handler`;
- the event: `body` (the raw bytes), `headers` (werkzeug's, case-insensitive), `method`, `query` (the
  arguments), `path`; the context: `hostname`, from $HOSTNAME (a pod's name);
- the reply: None is an empty 200; else `statusCode` (default 200), `body` (absent: ""; a dict: as JSON
  through Flask's jsonify; anything else: str() of it) and `headers` (a dict, or a list of pairs);
- served by waitress (`waitress.serve`).
Upstream's file itself is not copied into this repository; this module is written to its behaviour. Where
`faas-cli template pull` has put upstream's file beside the stack (report.md's step), a rehearsal runs that
one instead (`rehearse_openfaas.template_index`). Either listens on port 5000, as in a container of its own;
a rehearsal runs many on one machine, so its launcher has waitress serve on a free loopback port.

It imports nothing of Cloudless: run as /home/app/index.py, the function's handler imports its own
vendored copy of the runtime, as it does in the image.
"""

from __future__ import annotations

import os
from typing import Any

from flask import Flask, jsonify, request

METHODS = ["GET", "PUT", "POST", "PATCH", "DELETE"]


class Event:
    """What the handler gets of the request."""

    def __init__(self) -> None:
        self.body = request.get_data()
        self.headers = request.headers
        self.method = request.method
        self.query = request.args
        self.path = request.path


class Context:
    def __init__(self) -> None:
        self.hostname = os.environ.get("HOSTNAME", "localhost")


def reply(answer: Any) -> Any:
    """The handler's answer as Flask's (body, status, headers)."""
    if answer is None:
        return "", 200
    body = answer.get("body", "")
    if isinstance(body, dict):
        body = jsonify(body)
    elif "body" in answer:
        body = str(body)
    headers = answer.get("headers", [])
    if isinstance(headers, dict):
        headers = list(headers.items())
    return body, answer.get("statusCode", 200), headers


def make_app(handler: Any) -> Flask:
    """The template's app around `handler` (anything with `handle(event, context)`)."""
    app = Flask("index")

    @app.route("/", defaults={"path": ""}, methods=METHODS)
    @app.route("/<path:path>", methods=METHODS)
    def call_handler(path: str) -> Any:
        return reply(handler.handle(Event(), Context()))

    return app


def main() -> None:
    from function import handler  # the image's /home/app/function/
    from waitress import serve

    serve(make_app(handler), host="0.0.0.0", port=5000)  # a rehearsal's launcher picks a free loopback port


if __name__ == "__main__":
    main()
