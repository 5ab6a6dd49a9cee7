"""The storage of a run over several regions, as the deployment files set it: one bucket per region, and
every function able to reach the other regions' storage."""

from __future__ import annotations

import json
from pathlib import Path

from ...ir.deployment import peer_condition, peer_parameter
from ...ir.protocol import PEERS_ENV, STORAGE_ENV
from ...ir.workflow import Workflow
from .base import build_relative, fail, load_yaml


def check_region_storage(build: Path, workflow: Workflow) -> None:
    """Several regions: one bucket per region, and every function reaches each other region's storage through
    CLOUDLESS_PEERS (OpenFaaS: that region's storage URL; SAM: the stack parameter naming its bucket, with
    read rights on it)."""
    storage: dict[str, str] = {}
    for region in workflow.regions:
        path = build / "regions" / region.name / "stack.yaml"
        if not path.exists():
            continue
        file = build_relative(build, path)
        for name, function in load_yaml(build, path)["functions"].items():
            where = storage.setdefault(region.name, str(function.get("environment", {}).get(STORAGE_ENV)))
            if function.get("environment", {}).get(STORAGE_ENV) != where:
                fail(file, f"functions/{name}/environment/{STORAGE_ENV}", f"not the region's storage {where!r}")
    order = list(storage)
    shared = [(a, b) for i, a in enumerate(order) for b in order[i + 1 :] if storage[a] == storage[b]]
    if shared:
        a, b = shared[0]
        fail(
            f"regions/{b}/stack.yaml",
            f"functions/*/environment/{STORAGE_ENV}",
            f"{storage[b]!r} is region {a!r}'s storage too: every region has its own bucket",
        )
    for region in workflow.regions:
        peers = [r.name for r in workflow.regions if r.name != region.name]
        path = build / "regions" / region.name / "stack.yaml"
        if path.exists():
            file = build_relative(build, path)
            for name, function in load_yaml(build, path)["functions"].items():
                key = f"functions/{name}/environment/{PEERS_ENV}"
                try:
                    value = json.loads(function.get("environment", {}).get(PEERS_ENV, ""))
                except ValueError:
                    fail(file, key, "missing or not JSON: the function cannot reach the other regions' storage")
                expected = {peer: storage.get(peer) for peer in peers}
                if value != expected:
                    fail(file, key, f"{value}, but the other regions' storage is {expected}")
        path = build / "regions" / region.name / "template.yaml"
        if path.exists():
            file = build_relative(build, path)
            template = load_yaml(build, path)
            parameters = template.get("Parameters") or {}
            for peer in peers:
                if peer_parameter(peer) not in parameters:
                    fail(file, f"Parameters/{peer_parameter(peer)}", f"missing: the bucket of peer region {peer!r}")
            for logical, resource in template["Resources"].items():
                if resource.get("Type") != "AWS::Serverless::Function":
                    continue
                key = f"Resources/{logical}/Properties/Environment/Variables/{PEERS_ENV}"
                variables = resource["Properties"].get("Environment", {}).get("Variables", {})
                peers_value = variables.get(PEERS_ENV)
                sub = peers_value.get("Fn::Sub") if isinstance(peers_value, dict) else None
                if not isinstance(sub, str):
                    fail(file, key, "missing: the function cannot reach the other regions' storage")
                for peer in peers:
                    if f"${{{peer_parameter(peer)}}}" not in sub:
                        fail(file, key, f"does not name peer region {peer!r}'s bucket (${{{peer_parameter(peer)}}})")
                statements = [
                    statement
                    for policy in resource["Properties"].get("Policies", [])
                    if isinstance(policy, dict)
                    for statement in policy.get("Statement", [])
                ]
                where = f"Resources/{logical}/Properties/Policies"
                for peer in peers:
                    named = f"${{{peer_parameter(peer)}}}"
                    rights = [st for st in statements if named in json.dumps(st)]
                    # each right on a peer's bucket holds only where its parameter is set: an empty one would
                    # make the ARN arn:aws:s3::: (the deploy before the peer exists)
                    unconditional = [st for st in rights if (st.get("Fn::If") or [None])[0] != peer_condition(peer)]
                    if unconditional:
                        fail(
                            file,
                            where,
                            f"a right on peer {peer!r}'s bucket without the condition {peer_condition(peer)}",
                        )
                    granted = [branch for st in rights for branch in st["Fn::If"][1:] if isinstance(branch, dict)]
                    if not any("s3:GetObject" in str(branch.get("Action")) for branch in granted):
                        fail(file, where, f"no read right on peer {peer!r}'s bucket")
