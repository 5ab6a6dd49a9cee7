"""The generated handlers run: in-process with Lambda- and OpenFaaS-shaped events, and behind a real
HTTP server shaped like OpenFaaS's python3-http template."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from cloudless.ir.protocol import STORAGE_ENV
from cloudless.ir.workflow import Workflow
from cloudless.runtimes.storage import DirectoryChannel
from tests.openfaas_server import load_handler, serve
from tests.runtime_cases import front_end, write_packages, write_training_data


@pytest.fixture(scope="module")
def two_stage_build(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Workflow]:
    torch.set_num_threads(1)
    build = tmp_path_factory.mktemp("build")
    result = front_end()
    n = len(result.chain.blocks)
    workflow = write_packages(result, build, [(0, 1, 2), (2, n - 1, 1)], micro_batch=8, global_batch=32, iterations=2)
    return build, workflow


def _post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"}, method="POST")
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

    with serve(last_handler) as url:  # OpenFaaS: the body is the invocation, over real HTTP
        threads = [threading.Thread(target=lambda_replica, args=(r,)) for r in range(first.replicas)]
        for t in threads:
            t.start()
        status, body = _post(url, json.dumps({"iteration": 0, "replica": 0}).encode())
        for t in threads:
            t.join()
    assert status == 200, body
    assert body["status"] == "done" and body["stage"] == 1 and len(body["losses"]) == 4
    assert all(0 < loss < 5 for loss in body["losses"])
    for replica in range(first.replicas):
        assert results[f"s0r{replica}"]["status"] == "done"
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
    reply = last_handler.handle(SimpleNamespace(body=json.dumps({"iteration": 1}).encode()), None)
    for t in threads:
        t.join()
    assert reply["statusCode"] == 200, reply
    assert json.loads(reply["body"])["start"] == 1


def test_bad_invocations_get_a_clear_error(two_stage_build, tmp_path, monkeypatch) -> None:
    build, workflow = two_stage_build
    monkeypatch.setenv(STORAGE_ENV, str(tmp_path / "storage"))
    handler = load_handler(build / workflow.regions[0].functions[0].package, "handler_bad")
    reply = handler.handle(SimpleNamespace(body=b"{not json"), None)
    assert reply["statusCode"] == 400 and "not JSON" in json.loads(reply["body"])["error"]
    reply = handler.handle(SimpleNamespace(body=b'{"iteration": "zero"}'), None)
    assert reply["statusCode"] == 400 and "start: expected an integer, got 'zero'" in json.loads(reply["body"])["error"]
    reply = handler.handle(SimpleNamespace(body=b'{"iteration": 0, "replica": 5}'), None)
    assert reply["statusCode"] == 400 and "replicas 0..1" in json.loads(reply["body"])["error"]
    with pytest.raises(ValueError, match="expected a JSON object"):
        handler.handler(["iteration", 0], None)
    monkeypatch.delenv(STORAGE_ENV)
    with pytest.raises(ValueError, match="no storage: set CLOUDLESS_STORAGE"):
        handler.handler({"iteration": 0}, None)
