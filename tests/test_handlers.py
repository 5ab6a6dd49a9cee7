"""The generated handlers run: in-process with Lambda- and OpenFaaS-shaped events, and behind a real
HTTP server shaped like OpenFaaS's python3-http template. OpenFaaS requests need the run's token (the
secret cloudless-token, in the X-Cloudless-Token header); error replies carry no path of the machine."""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cloudless.ir.protocol import STORAGE_ENV, TOKEN_HEADER, TOKEN_SECRET
from cloudless.ir.workflow import Workflow
from cloudless.runtimes.rehearsal.openfaas_gateway import load_handler, mount_secrets, serve
from cloudless.runtimes.storage.channels import DirectoryChannel
from tests.runtime_cases import front_end, write_packages, write_training_data

TOKEN = "5f0c3a9e1d7b4c2a8e6f0b1d3c5a7e9f"
#: what OpenFaaS mounts for the functions: the token (the storage secret is not needed with a folder)
SECRETS = {TOKEN_SECRET: TOKEN + "\n"}  # a file made with --from-file ends with a newline
AUTHORIZED = {TOKEN_HEADER: TOKEN}
#: an absolute path in a text (not the '//' of a URL, not a relative key)
ABSOLUTE_PATH = re.compile(r"(?<![\w:/.~-])/[\w.-]")


@pytest.fixture(scope="module")
def two_stage_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Workflow]:
    torch.set_num_threads(1)
    build = tmp_path_factory.mktemp("build")
    result = front_end()
    n = len(result.chain.blocks)
    workflow = write_packages(result, build, [(0, 1, 2), (2, n - 1, 1)], micro_batch=8, global_batch=32, iterations=2)
    return build, workflow


def _post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    request = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json", **(headers or {})}, method="POST"
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_every_handler_runs_an_iteration_through_both_entry_points(two_stage_build, tmp_path, monkeypatch) -> None:
    build, workflow = two_stage_build
    storage = tmp_path / "storage"
    region = workflow.regions[0]
    write_training_data(front_end(), DirectoryChannel(storage), region.name)
    monkeypatch.setenv(STORAGE_ENV, str(storage))
    first, last = region.functions
    first_handler = load_handler(build / first.package, "handler_s0")
    last_handler = load_handler(build / last.package, "handler_s1")
    results: dict[str, object] = {}

    def lambda_replica(replica: int) -> None:  # Lambda: the event is the invocation
        results[f"s0r{replica}"] = first_handler.handler({"iteration": 0, "replica": replica}, None)

    with serve(last_handler, SECRETS) as url:  # OpenFaaS: the body is the invocation, over real HTTP
        threads = [threading.Thread(target=lambda_replica, args=(r,)) for r in range(first.replicas)]
        for t in threads:
            t.start()
        status, body = _post(url, json.dumps({"iteration": 0, "replica": 0}).encode(), AUTHORIZED)
        for t in threads:
            t.join()
    assert status == 200, body
    assert body["status"] == "done" and body["stage"] == 1 and len(body["losses"]) == 4
    assert all(0 < loss < 5 for loss in body["losses"])
    for replica in range(first.replicas):
        assert results[f"s0r{replica}"]["status"] == "done"
        # Lambda's answer (a Step Functions state's input: 256 KB at most) leaves the per-iteration lists out
        assert {"stop", "reason"} <= set(results[f"s0r{replica}"]) and not {"losses", "spans"} & set(
            results[f"s0r{replica}"]
        )
    # The next iteration starts from the state each stage's replica 0 saved.
    assert (storage / region.name / "state" / "s0" / "it1").is_file()
    assert (storage / region.name / "state" / "s1" / "it1").is_file()

    # The in-process OpenFaaS entry point, a second time, for iteration 1 (stage 0 in threads again).
    threads = [
        threading.Thread(
            target=lambda r: results.__setitem__(
                f"it1s0r{r}", first_handler.handler({"start": 1, "stop": 2, "replica": r}, None)
            ),
            args=(r,),
        )
        for r in range(first.replicas)
    ]
    for t in threads:
        t.start()
    with mount_secrets([last_handler], SECRETS):  # the header's name in any case, as HTTP has it
        event = SimpleNamespace(body=json.dumps({"iteration": 1}).encode(), headers={"x-cloudless-token": TOKEN})
        reply = last_handler.handle(event, None)
    for t in threads:
        t.join()
    assert reply["statusCode"] == 200, reply
    assert json.loads(reply["body"])["start"] == 1


def test_bad_invocations_get_a_clear_error(two_stage_build, tmp_path, monkeypatch) -> None:
    build, workflow = two_stage_build
    monkeypatch.setenv(STORAGE_ENV, str(tmp_path / "storage"))
    handler = load_handler(build / workflow.regions[0].functions[0].package, "handler_bad")
    with mount_secrets([handler], SECRETS):
        reply = handler.handle(SimpleNamespace(body=b"{not json", headers=AUTHORIZED), None)
        assert reply["statusCode"] == 400 and "not JSON" in json.loads(reply["body"])["error"]
        reply = handler.handle(SimpleNamespace(body=b'{"iteration": "zero"}', headers=AUTHORIZED), None)
        error = json.loads(reply["body"])["error"]
        assert reply["statusCode"] == 400 and "start: expected an integer, got 'zero'" in error
        reply = handler.handle(SimpleNamespace(body=b'{"iteration": 0, "replica": 5}', headers=AUTHORIZED), None)
        assert reply["statusCode"] == 400 and "replicas 0..1" in json.loads(reply["body"])["error"]
        deep = b"[" * 100_000 + b"]" * 100_000  # deeper than Python's stack
        reply = handler.handle(SimpleNamespace(body=deep, headers=AUTHORIZED), None)
        assert reply["statusCode"] == 400 and "not JSON" in json.loads(reply["body"])["error"]
    with pytest.raises(ValueError, match="expected a JSON object"):
        handler.handler(["iteration", 0], None)
    monkeypatch.delenv(STORAGE_ENV)
    with pytest.raises(ValueError, match="no storage: set CLOUDLESS_STORAGE"):
        handler.handler({"iteration": 0}, None)


def test_the_wait_for_staged_data_honours_the_invocations_timeout(two_stage_build, tmp_path, monkeypatch) -> None:
    """No data was staged: the invocation's own timeout (2 s here) bounds the wait for it, not the
    600 s default."""
    build, workflow = two_stage_build
    monkeypatch.setenv(STORAGE_ENV, str(tmp_path / "storage"))
    handler = load_handler(build / workflow.regions[0].functions[0].package, "handler_no_data")
    with pytest.raises(Exception, match=r"data/.*meta.* did not appear within 2 s") as raised:
        handler.handler({"iteration": 0, "stop": 1, "timeout": 2}, None)
    assert type(raised.value).__name__ == "KeyTimeout"


def test_openfaas_requests_without_the_token_are_refused(two_stage_build, tmp_path, monkeypatch) -> None:
    """A missing or wrong token, or no token secret at all: 401 with one fixed message, before the body is
    read, and nothing is written to storage. The right token runs the request (the test above)."""
    build, workflow = two_stage_build
    storage = tmp_path / "storage"
    monkeypatch.setenv(STORAGE_ENV, str(storage))
    handler = load_handler(build / workflow.regions[0].functions[0].package, "handler_token")
    body = json.dumps({"iteration": 0, "replica": 0}).encode()
    wrong = [{}, {TOKEN_HEADER: ""}, {TOKEN_HEADER: TOKEN[:-1]}, {TOKEN_HEADER: TOKEN + "0"}, {"X-Other": TOKEN}]
    replies = []
    with serve(handler, SECRETS) as url:  # over HTTP, as the template passes the headers
        for headers in wrong:
            replies.append(_post(url, body, headers))
    with serve(handler, {}) as url:  # the secret is not mounted: nothing is accepted
        replies.append(_post(url, body, AUTHORIZED))
    with serve(handler, {TOKEN_SECRET: "\n"}) as url:  # an empty secret is no token either
        replies.append(_post(url, body, {TOKEN_HEADER: ""}))
    with mount_secrets([handler], SECRETS):  # in-process: an event without headers
        reply = handler.handle(SimpleNamespace(body=body), None)
        replies.append((reply["statusCode"], json.loads(reply["body"])))
    assert len(replies) == len(wrong) + 3
    for status, reply in replies:
        assert status == 401, reply
        assert reply == {"error": handler.UNAUTHORIZED}
        assert TOKEN not in json.dumps(reply)
    assert not storage.exists()  # no worker started: not even the storage folder was made


def test_error_replies_name_no_path_of_the_machine(two_stage_build, tmp_path, monkeypatch, capfd) -> None:
    build, workflow = two_stage_build
    package = build / workflow.regions[0].functions[0].package
    handler = load_handler(package, "handler_paths")
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv(STORAGE_ENV, str(blocker / "storage"))  # the storage folder cannot be made: a 500
    with serve(handler, SECRETS) as url:
        status, reply = _post(url, json.dumps({"iteration": 0, "replica": 0}).encode(), AUTHORIZED)
    assert status == 500, reply
    error = reply["error"]
    assert error.startswith(("NotADirectoryError: ", "FileExistsError: ")) and "<path>" in error, error
    for path in (str(tmp_path), str(package.resolve()), "site-packages"):
        assert path not in error
    assert not ABSOLUTE_PATH.search(error), error
    # The whole error, path and traceback, is in the function's log.
    log = capfd.readouterr().err
    assert str(blocker) in log and "Traceback" in log

    # What is taken out: absolute paths and file: URLs; what stays: storage URLs and relative keys.
    scrub = handler._PATH.sub
    assert scrub("<path>", "'/var/task/cloudless/runtimes/worker.py', line 3") == "'<path>', line 3"
    assert scrub("<path>", "in /usr/lib/python3.11/site-packages/torch/nn.py:") == "in <path>"
    assert scrub("<path>", "see file:///home/app/function/x") == "see <path>"
    for kept in ("s3://bucket/run/aws-us-east-1/it0/act/s0/mb0 did not appear", "redis://host:6379/0#run", "1/2"):
        assert scrub("<path>", kept) == kept


@pytest.mark.slow
def test_a_deployed_function_runs_as_many_torch_threads_as_its_cpu_share() -> None:
    """No OMP_NUM_THREADS (a Lambda or OpenFaaS container): threads from the function's CPU share, not from
    the host's cores; with it (the local invoker's --threads), its value."""
    import os
    import subprocess
    import sys

    shares = (580, 1000, 1770, 5790)
    probe = (
        "import torch; from cloudless.runtimes.function.worker import cap_threads\n"
        f"for share in {shares}:\n"
        "    torch.set_num_threads(7); cap_threads(share); print(torch.get_num_threads())"
    )
    bare = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    done = subprocess.run([sys.executable, "-c", probe], env=bare, capture_output=True, text=True, check=True)
    assert [int(x) for x in done.stdout.split()] == [1, 1, 2, 6]
    done = subprocess.run(
        [sys.executable, "-c", probe], env={**bare, "OMP_NUM_THREADS": "3"}, capture_output=True, text=True, check=True
    )
    assert [int(x) for x in done.stdout.split()] == [7, 7, 7, 7]  # the caller's choice stands
