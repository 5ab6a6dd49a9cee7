"""The measured cost of a run of several regions, from what its invocations did, at each region's prices.

What is counted (`measured_cost`), per region R at R's `RegionPrices`:
- compute: every invocation of R's functions, from its launch to its end as the controller saw it
  (a local process: start-up included, as a cold start is billed), x the function's memory in GB
  x `gb_second`; and one request per invocation x `per_million_requests` / 1e6;
- storage requests to R's storage, by whoever made them: R's functions', other regions' functions
  across the WAN, and the controller's (markers, progress) when counted (`controller`); a GET (a poll
  that finds nothing too, as S3 bills it) x `storage_get_per_1000` / 1000, a PUT or create-if-absent
  x `storage_put_per_1000` / 1000; deletes are free;
- egress: bytes leaving R across the WAN (what R's functions PUT into other regions' storage, what
  other regions' functions GET from R's storage, and training data moved out of R before the run)
  x `egress_per_gb` / 1e9.
Not counted: storage space (GB-months), the controller's own compute, and transfers within a region.
A region without prices has its counts but no figures in USD; the total then covers the priced ones.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from ...ir.protocol import DATA_META, WAN_COUNT_PREFIX, InvocationResult, data_key, shard_name
from ...ir.workflow import Workflow
from ..function.data import data_name
from ..storage.channels import Channel

#: what `measured_cost`'s figures cover, as written into metrics.json
COUNTED = (
    "compute: invocation wall time (launch to end) x memory GB x gb_second, plus per_million_requests per "
    "invocation; storage: GET and PUT requests to the region's storage (its functions', other regions' "
    "across the WAN, the controller's) x storage_get/put_per_1000; egress: bytes leaving the region "
    "(PUTs into other regions' storage, other regions' GETs from it, data moved out before the run) x "
    "egress_per_gb. Not counted: storage space, the controller's compute, transfers within a region."
)


def wan_pairs(results_by_region: Mapping[str, Iterable[InvocationResult]]) -> dict[str, dict[str, int]]:
    """Per region pair "A->B": the requests A's functions made to B's storage (gets, puts, deletes)
    and the bytes they moved: `bytes_sent` (A to B: their PUTs) and `bytes_received` (B to A: GETs)."""
    pairs: dict[str, dict[str, int]] = {}
    for region, results in results_by_region.items():
        for result in results:
            for key, value in result.storage.items():
                if not key.startswith(WAN_COUNT_PREFIX):
                    continue
                peer, kind = key.removeprefix(WAN_COUNT_PREFIX).rsplit("/", 1)
                pair = pairs.setdefault(
                    f"{region}->{peer}",
                    {"gets": 0, "puts": 0, "deletes": 0, "bytes_sent": 0, "bytes_received": 0},
                )
                name = {"bytes_out": "bytes_sent", "bytes_in": "bytes_received"}.get(kind, kind)
                pair[name] = pair.get(name, 0) + value
    return dict(sorted(pairs.items()))


def measured_cost(
    workflow: Workflow,
    invocations: Mapping[str, Iterable[Mapping[str, Any]]],
    results: Mapping[str, Iterable[InvocationResult]],
    *,
    controller: Mapping[str, Mapping[str, int]] | None = None,
    data_moves: Mapping[str, int] | None = None,
) -> dict[str, Any]:
    """The run's cost per region and in total (see the module's docstring for what is counted).
    `invocations`: per region its invocation log (function, launched, ended); `results`: per region its
    invocations' results (their storage counts); `controller`: per region the controller's requests to
    its storage; `data_moves`: per pair "A->B" the bytes of training data moved before the run."""
    results = {region: list(items) for region, items in results.items()}
    pairs = wan_pairs(results)
    names = [r.name for r in workflow.regions]
    server = workflow.sync.server
    if server and server not in names:
        names.append(server)
    regions: dict[str, dict[str, Any]] = {}
    for name in names:
        regions[name] = {"gb_seconds": 0.0, "invocations": 0, "storage_gets": 0, "storage_puts": 0, "egress_bytes": 0}
    for region in workflow.regions:
        entry = regions[region.name]
        memory = {f.name: f.memory_mb for f in region.functions}
        for invocation in invocations.get(region.name, ()):
            seconds = max(0.0, float(invocation["ended"]) - float(invocation["launched"]))
            entry["gb_seconds"] += seconds * memory[invocation["function"]] / 1024
            entry["invocations"] += 1
        for result in results.get(region.name, ()):
            entry["storage_gets"] += result.storage.get("gets", 0)
            entry["storage_puts"] += result.storage.get("puts", 0)
    for name, counts in (controller or {}).items():
        if name in regions:
            regions[name]["storage_gets"] += counts.get("gets", 0)
            regions[name]["storage_puts"] += counts.get("puts", 0)
    for pair, counts in pairs.items():
        source, target = pair.split("->")
        if target in regions:  # requests are billed to the storage's owner
            regions[target]["storage_gets"] += counts["gets"]
            regions[target]["storage_puts"] += counts["puts"]
            regions[target]["egress_bytes"] += counts["bytes_received"]
        if source in regions:
            regions[source]["egress_bytes"] += counts["bytes_sent"]
    for pair, size in (data_moves or {}).items():
        source = pair.split("->")[0]
        if source in regions:
            regions[source]["egress_bytes"] += size
    total = 0.0
    priced = {r.name: r.prices for r in workflow.regions}
    for name, entry in regions.items():
        entry["gb_seconds"] = round(entry["gb_seconds"], 6)
        prices = priced.get(name)
        if prices is None:
            entry["usd"] = None
            continue
        usd = {
            "compute": entry["gb_seconds"] * prices.gb_second,
            "requests": entry["invocations"] * prices.per_million_requests / 1e6,
            "storage": entry["storage_gets"] * prices.storage_get_per_1000 / 1000
            + entry["storage_puts"] * prices.storage_put_per_1000 / 1000,
            "egress": entry["egress_bytes"] * prices.egress_per_gb / 1e9,
        }
        usd["total"] = sum(usd.values())
        total += usd["total"]
        entry["usd"] = {k: round(v, 9) for k, v in usd.items()}
    return {
        "regions": regions,
        "wan": pairs,
        "data_moves": dict(sorted((data_moves or {}).items())),
        "total_usd": round(total, 9) if any(e["usd"] is not None for e in regions.values()) else None,
        "counted": COUNTED,
    }


def data_moves(workflow: Workflow, storage_of: Callable[[str], Channel]) -> dict[str, int]:
    """Per pair "A->B" the bytes of training data the plan moves from A to B: of the train split
    staged for B (in B's storage), the share of its samples that come from A's slices."""
    moves: dict[str, int] = {}
    for region in workflow.regions:
        moved = [s for s in region.data_sources if s.region != region.name]
        if not moved:
            continue
        channel = storage_of(region.name)
        name = data_name(region)
        raw = channel.try_get(data_key(name, "train", DATA_META))
        if raw is None:
            continue
        meta = json.loads(raw)
        samples, per_shard = int(meta["samples"]), int(meta["shard_samples"])
        size = 0
        for index in range(math.ceil(samples / per_shard)):
            shard = channel.try_get(data_key(name, "train", shard_name(index)))
            size += len(shard) if shard is not None else 0
        for source in moved:
            pair = f"{source.region}->{region.name}"
            moves[pair] = moves.get(pair, 0) + round(size * source.count / max(samples, 1))
    return dict(sorted(moves.items()))
