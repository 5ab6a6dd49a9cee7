"""Several regions' storage: where each region's is (`--storage`), the WAN link between two regions
(emulated bandwidth and latency, always counted), each region's own request latency under
--emulate, and the measured cost from counted requests."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import pytest

from cloudless.ir.protocol import InvocationResult
from cloudless.ir.workflow import (
    DataSpec,
    Function,
    OptimizerSpec,
    Region,
    RegionPrices,
    RunSettings,
    StorageSpec,
    SyncSettings,
    WanLink,
    Workflow,
)
from cloudless.runtimes.control.cost import measured_cost, wan_pairs
from cloudless.runtimes.control.run import resources_of
from cloudless.runtimes.control.storage_locations import storage_locations
from cloudless.runtimes.storage.channels import DirectoryChannel
from cloudless.runtimes.storage.emulation import Resources, wan_channel, wan_link

PRICES = RegionPrices(
    gb_second=2e-5,
    per_million_requests=0.2,
    storage_put_per_1000=0.005,
    storage_get_per_1000=0.0004,
    egress_per_gb=0.02,
)


def region(name: str, latency: float) -> Region:
    function = Function(
        name="f-s0",
        stage=0,
        blocks=(0, 0),
        memory_mb=2048,
        cpu_millis=1000,
        network_mb_per_s=50.0,
        replicas=1,
        timeout_s=900,
        package=f"regions/{name}/functions/f-s0",
        inputs=(),
        outputs=(),
        shared_parameters=(),
    )
    return Region(name, "aws", 10, latency, (function,), iterations=10, weight=0.5, prices=PRICES)


def two_regions(server: str | None = None) -> Workflow:
    return Workflow(
        model="m",
        run=RunSettings("m", 20, 8, 8, 1, "gpipe", 5, 0),
        optimizer=OptimizerSpec("SGD", {"lr": 0.1}),
        sync=SyncSettings("pipelined-scatter-reduce", 1 << 20, 4, "asgd-ga" if server else "model-average", 2, server),
        storage=StorageSpec("b", "p"),
        data=DataSpec("m.py", ("x",), 1, "loss"),
        regions=(region("a", 0.01), region("b", 0.05)),
        steps=(),
        wan=(WanLink(("a", "b"), 2.0, 0.05),),
    )


def test_each_region_has_its_own_storage(tmp_path: Path) -> None:
    workflow = two_regions()
    default = storage_locations(workflow, None, tmp_path)
    assert default == {
        "a": str((tmp_path / "storage" / "a").resolve()),
        "b": str((tmp_path / "storage" / "b").resolve()),
    }
    # one plain location: every region under its own sub-prefix; REGION=URL names one region's
    assert storage_locations(workflow, ["s3://bucket/run"], tmp_path) == {
        "a": "s3://bucket/run/a",
        "b": "s3://bucket/run/b",
    }
    assert storage_locations(workflow, ["redis://h:6379/0#x", "b=/data/b"], tmp_path) == {
        "a": "redis://h:6379/0#x/a",
        "b": "/data/b",
    }
    assert storage_locations(workflow, ["a=s3://one/p", "b=s3://two/p"], tmp_path) == {
        "a": "s3://one/p",
        "b": "s3://two/p",
    }
    with pytest.raises(ValueError, match="no region 'c'"):
        storage_locations(workflow, ["c=/x"], tmp_path)
    with pytest.raises(ValueError, match="2 plain locations"):
        storage_locations(workflow, ["/x", "/y"], tmp_path)
    # ASGD-GA's server has storage too, even when it trains nothing
    assert sorted(storage_locations(two_regions(server="s"), None, tmp_path)) == ["a", "b", "s"]


def test_a_relative_storage_folder_is_the_same_folder_for_functions_running_in_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--storage store` names a folder of the current one: the functions, which run in their packages'
    folders, are given it whole (else they would wait for keys in a folder of their own)."""
    monkeypatch.chdir(tmp_path)
    assert storage_locations(two_regions(), ["store"], tmp_path / "out") == {
        "a": str(tmp_path.resolve() / "store" / "a"),
        "b": str(tmp_path.resolve() / "store" / "b"),
    }
    assert storage_locations(two_regions(), ["a=rel/a", "b=s3://two/p"], tmp_path) == {
        "a": str(tmp_path.resolve() / "rel" / "a"),
        "b": "s3://two/p",
    }


def test_emulate_gives_each_region_its_own_latency_and_the_wan() -> None:
    workflow = two_regions()
    args = argparse.Namespace(emulate=True, bandwidth=None, latency_ms=None)
    resources = resources_of(workflow, args)
    got = {r.name: resources(r.functions[0]) for r in workflow.regions}
    assert got["a"] == Resources(bytes_per_s=50e6, latency_s=0.01, vcpus=1.0, wan=True)
    assert got["b"].latency_s == 0.05 and got["b"].wan
    assert Resources.from_json(got["b"].to_json()) == got["b"]
    assert Resources.from_json({"bytes_per_s": None, "latency_s": 0.0, "vcpus": None}).wan is False


def test_the_wan_link_throttles_when_emulated_and_always_counts(tmp_path: Path) -> None:
    peer = DirectoryChannel(tmp_path / "b")
    link = wan_link(two_regions().wan, "b", "a")  # either way round
    assert link is not None and link.mb_per_s == 2.0
    data = bytes(400_000)  # 0.2 s at 2 MB/s, plus 0.05 s latency
    emulated = wan_channel(peer, link, emulate=True)
    began = time.monotonic()
    emulated.put("k", data)
    assert emulated.get("k", 5) == data
    took = time.monotonic() - began
    assert took >= 2 * (0.2 + 0.05) - 0.01
    assert emulated.counts["puts"] == 1 and emulated.counts["gets"] == 1
    assert emulated.counts["bytes_out"] == emulated.counts["bytes_in"] == len(data)
    plain = wan_channel(peer, link, emulate=False)  # counted, at the machine's speed: no rate, no latency
    assert plain.resources.bytes_per_s is None and plain.resources.latency_s == 0
    assert plain.get("k", 5) == data and plain.counts["bytes_in"] == len(data)


def test_the_measured_cost_counts_compute_requests_storage_and_egress() -> None:
    workflow = two_regions()
    wan = {"wan/b/gets": 10, "wan/b/puts": 2, "wan/b/bytes_in": 3_000_000_000, "wan/b/bytes_out": 1_000_000_000}
    results = {
        "a": [InvocationResult("done", "f-s0", 0, 0, storage={"gets": 1000, "puts": 1000, **wan})],
        "b": [InvocationResult("done", "f-s0", 0, 0, storage={"gets": 1000, "puts": 0})],
    }
    invocations = {
        "a": [{"function": "f-s0", "launched": 0.0, "ended": 100.0}],
        "b": [{"function": "f-s0", "launched": 0.0, "ended": 50.0}, {"function": "f-s0", "launched": 0, "ended": 50}],
    }
    cost = measured_cost(workflow, invocations, results, controller={"b": {"gets": 990, "puts": 0}})
    assert wan_pairs(results) == {
        "a->b": {"gets": 10, "puts": 2, "deletes": 0, "bytes_sent": 1_000_000_000, "bytes_received": 3_000_000_000}
    }
    a, b = cost["regions"]["a"], cost["regions"]["b"]
    assert a["gb_seconds"] == b["gb_seconds"] == 200.0  # 100 s or 2 x 50 s at 2 GB
    assert (a["invocations"], b["invocations"]) == (1, 2)
    assert (a["storage_gets"], a["storage_puts"]) == (1000, 1000)
    assert (b["storage_gets"], b["storage_puts"]) == (1000 + 990 + 10, 2)  # its own, the controller's, a's
    assert a["egress_bytes"] == 1_000_000_000 and b["egress_bytes"] == 3_000_000_000
    assert a["usd"]["compute"] == pytest.approx(200 * 2e-5)
    assert a["usd"]["storage"] == pytest.approx(0.0004 + 0.005)
    assert b["usd"]["storage"] == pytest.approx(2 * 0.0004 + 2 * 0.005 / 1000)
    assert a["usd"]["egress"] == pytest.approx(0.02) and b["usd"]["egress"] == pytest.approx(0.06)
    assert b["usd"]["requests"] == pytest.approx(2 * 0.2 / 1e6)
    assert cost["total_usd"] == pytest.approx(a["usd"]["total"] + b["usd"]["total"])
