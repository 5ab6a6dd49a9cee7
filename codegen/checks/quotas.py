"""Warnings about what a deployment's platform account or cluster may not hold, known at compile time: SAM
functions above a new AWS account's memory quota, iterations above its concurrency, and OpenFaaS stacks whose
requests exceed a small cluster. One line each, deterministic; `cloudless-run BUILD --preflight-only` reads
the real account's quotas and cluster's capacity (runtimes/clouds/preflight.py)."""

from __future__ import annotations

import re
from collections.abc import Mapping

import yaml

from ...ir.catalog import NEW_ACCOUNT_LAMBDA_CONCURRENCY, NEW_ACCOUNT_LAMBDA_MEMORY_MB
from ...ir.workflow import Workflow

#: a small Kubernetes cluster (an assumption, for a warning only): SMALL_CLUSTER_NODES nodes of
#: SMALL_NODE_CPUS CPUs and SMALL_NODE_GIB GiB each (a managed cluster's default node group, a laptop's kind)
SMALL_CLUSTER_NODES, SMALL_NODE_CPUS, SMALL_NODE_GIB = 3, 4, 16
_MEBIBYTES = re.compile(r"([0-9]+)Mi")
_MILLICORES = re.compile(r"([0-9]+)m")


def quota_warnings(files: Mapping[str, str], workflow: Workflow | None) -> list[str]:
    """The warnings of a build's regions/<region>/stack.yaml and template.yaml files ({path: text}), in path
    order. `workflow`: each region's workers (an iteration runs them all at once; None: not checked)."""
    workers = {r.name: sum(f.replicas for f in r.functions) for r in (workflow.regions if workflow else ())}
    found = []
    for file, text in sorted(files.items()):
        region = file.split("/")[1] if file.startswith("regions/") else ""
        if file.endswith("/stack.yaml"):
            found += _stack_warnings(file, text)
        elif file.endswith("/template.yaml"):
            found += _template_warnings(file, text, workers.get(region, 0))
    return found


def _stack_warnings(file: str, text: str) -> list[str]:
    """A stack whose requests (each function's, times its replicas) exceed a small cluster, or one of whose pods
    exceeds a small cluster's node. Requests as the stack files write them (2048Mi, 1000m)."""
    stack = yaml.safe_load(text)
    pods = []
    for function in (stack.get("functions") or {}).values() if isinstance(stack, dict) else []:
        asked = function.get("requests") or {}
        memory, cpu = _MEBIBYTES.fullmatch(str(asked.get("memory"))), _MILLICORES.fullmatch(str(asked.get("cpu")))
        if memory is None or cpu is None:
            continue
        replicas = int((function.get("labels") or {}).get("com.openfaas.scale.min", 1))
        pods += [(int(memory.group(1)) / 1024, int(cpu.group(1)) / 1000)] * replicas
    if not pods:
        return []
    gib, cpus = sum(p[0] for p in pods), sum(p[1] for p in pods)
    largest = max(pods)
    small = (SMALL_CLUSTER_NODES * SMALL_NODE_GIB, SMALL_CLUSTER_NODES * SMALL_NODE_CPUS)
    if gib <= small[0] and cpus <= small[1] and largest[0] <= SMALL_NODE_GIB and largest[1] <= SMALL_NODE_CPUS:
        return []
    return [
        f"{file}: the stack requests {gib:.1f} GiB and {cpus:g} CPUs ({len(pods)} pod{'s' * (len(pods) != 1)}, the "
        f"largest {largest[0]:.1f} "
        f"GiB and {largest[1]:g} CPUs); a small cluster ({SMALL_CLUSTER_NODES} nodes of {SMALL_NODE_CPUS} CPUs and "
        f"{SMALL_NODE_GIB} GiB) holds {small[0]} GiB and {small[1]} CPUs: cloudless-run BUILD --invoker openfaas "
        "--preflight-only checks your cluster"
    ]


def _template_warnings(file: str, text: str, workers: int) -> list[str]:
    """Functions above a new AWS account's memory quota; an iteration running more functions at once than a
    new account's concurrency."""
    found = []
    check = "cloudless-run BUILD --invoker lambda --preflight-only reads your account's quotas"
    resources = (yaml.safe_load(text) or {}).get("Resources", {})
    big = sorted(
        (-int(r["Properties"].get("MemorySize", 0)), str(r["Properties"].get("FunctionName", logical)))
        for logical, r in resources.items()
        if r.get("Type") == "AWS::Serverless::Function"
        and int(r["Properties"].get("MemorySize", 0)) > NEW_ACCOUNT_LAMBDA_MEMORY_MB
    )
    if big:
        named = ", ".join(f"{name} {-memory} MB" for memory, name in big)
        found.append(
            f"{file}: functions above a new AWS account's {NEW_ACCOUNT_LAMBDA_MEMORY_MB} MB memory quota ({named}): "
            f"sam deploy fails on such an account until AWS raises it; {check}"
        )
    if workers > NEW_ACCOUNT_LAMBDA_CONCURRENCY:
        found.append(
            f"{file}: an iteration runs {workers} functions at once; a new AWS account runs "
            f"{NEW_ACCOUNT_LAMBDA_CONCURRENCY} at once (its concurrency quota); {check}"
        )
    return found
