"""Pre-flight: what would stop a deployed run at its first step, checked before anything is started.

`cloudless-run BUILD --invoker lambda|openfaas` runs these checks before it stages data or invokes anything
(and `--preflight-only` runs them alone, before or after a deploy); each failure is one line naming what
needs what, what the account or cluster has, and the fix, and the run does not start (exit status 2). A
check that cannot be made from here (no cluster access configured, no kubectl) is skipped with a one-line
notice.

- **Lambda quotas** (`lambda_quotas`): an iteration runs every (stage, replica) worker of a region at once
  (one Map state), so the plan needs that many concurrent executions in the region's AWS region (the catalog
  regions that share an AWS region add up). GetAccountSettings gives the account's unreserved concurrency
  there (functions without reserved concurrency, as the generated ones are, share it): the applied quota,
  which Service Quotas (code L-B99A9384) would only repeat; it is named as where to ask for more. No API
  reports the memory quota (Lambda's adjustable quotas are concurrency, storage and network interfaces; new
  accounts are held at 3008 MB, catalog.NEW_ACCOUNT_LAMBDA_MEMORY_MB): a deployed
  function's MemorySize (GetFunctionConfiguration) is what the account accepted (and its Timeout at least the
  build's), and a function not deployed yet above that figure is a notice when the account's concurrency
  quota is a new account's.
- **The stacks' peers** (`peer_grants`, several regions): each region's stack holds its peers' buckets in its
  PeerBucket<Region> parameters, else the template grants nothing on them; one line names the sam deploy.
- **OpenFaaS capacity** (`cluster_capacity`): the stack's pods (each function's `requests` × its replicas)
  against the schedulable nodes' allocatable CPU and memory less what other pods already request, read from
  the Kubernetes API with the user's own `kubectl get --raw` (any kubeconfig authentication works; the
  OpenFaaS gateway reports no capacity: /system/info names the provider and its version only). Placed
  largest first onto the node with the most room: a pod no node can hold, or pods beyond the room left, fail.
- **Image visibility** (`anonymous_pull_problem`): OpenFaaS CE's faas-netes checks every image before it
  deploys it, from inside the cluster, with anonymous credentials (go-containerregistry's remote.Head,
  handlers/validate.go isAnonymous): an image it cannot pull without credentials is refused after the push.
  The check does what that registry client does (Docker Registry HTTP API v2: HEAD the manifest; on a 401
  Bearer challenge, ask the realm for an anonymous token of scope repository:<name>:pull and HEAD again).
  A registry on localhost or a loopback address is always refused: inside the cluster that is the pod itself.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import yaml

from ...ir.catalog import (
    AWS_REGION_PREFIX,
    DEFAULT_LAMBDA_CONCURRENCY,
    LAMBDA_CONCURRENCY_QUOTA_CODE,
    NEW_ACCOUNT_LAMBDA_MEMORY_MB,
)
from ...ir.deployment import lambda_function_name, peer_parameter, stack_name
from ...ir.workflow import Function, Workflow
from ..storage.transient import aws_client
from .deploy import DeployError, Stack, aws_region, read_stack, stack_names

#: how long one request of a check may take (a registry, the Kubernetes API)
REQUEST_TIMEOUT_S = 15.0
#: the manifest media types a registry client accepts (Docker v2 schema 2, OCI; their lists)
MANIFEST_TYPES = (
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.index.v1+json",
)
DOCKER_HUB = "index.docker.io"
DOCKER_HUB_API = "registry-1.docker.io"


@dataclass
class Findings:
    """What the checks found: failures stop the run; notices say what was not checked."""

    failures: list[str] = field(default_factory=list)
    notices: list[str] = field(default_factory=list)

    def add(self, other: Findings) -> None:
        self.failures += other.failures
        self.notices += other.notices


# --- Lambda ---------------------------------------------------------------------------------------------


def lambda_quotas(
    workflow: Workflow,
    lambda_client: Callable[[str], Any],
    deployed: Mapping[str, Mapping[str, str]] | None = None,
) -> Findings:
    """The account's Lambda concurrency in each AWS region against the plan's workers there, and (where the
    functions are deployed: `deployed`, catalog region -> stage function -> deployed name) each function's
    MemorySize and Timeout against the build's. `lambda_client(aws_region)` makes the client."""
    found = Findings()
    by_aws: dict[str, list[str]] = {}
    for region in workflow.regions:
        by_aws.setdefault(region.name.removeprefix(AWS_REGION_PREFIX), []).append(region.name)
    for aws, names in sorted(by_aws.items()):
        client = lambda_client(aws)
        limits: Mapping[str, Any] | None
        try:
            limits = client.get_account_settings()["AccountLimit"]
        except Exception as exc:  # noqa: BLE001 - botocore's errors (no credentials, access denied): one line
            # lambda:GetAccountSettings refused, or an endpoint without it: the quotas are not known, not short
            found.notices.append(f"{', '.join(names)}: Lambda quotas in {aws} not checked: {_line(exc)}")
            limits = None
        if limits is None:
            _memory_of_deployed(found, client, workflow, names, deployed, quota=None)
            continue
        unreserved = int(limits.get("UnreservedConcurrentExecutions", limits.get("ConcurrentExecutions", 0)))
        quota = int(limits.get("ConcurrentExecutions", unreserved))
        functions = [f for name in names for f in workflow.region(name).functions]
        needed = sum(f.replicas for f in functions)
        if needed > unreserved:
            shape = ", ".join(f"{f.name} x{f.replicas}" for f in functions)
            where = names[0] if len(names) == 1 else f"each of {', '.join(names)} (their share)"
            found.failures.append(
                f"{', '.join(names)}: the plan runs {needed} Lambda functions at once ({shape}); the account has "
                f"{unreserved} unreserved concurrent executions in {aws} (quota {quota}): request an increase of "
                f"Lambda's Concurrent executions (Service Quotas code {LAMBDA_CONCURRENCY_QUOTA_CODE}), or recompile "
                f"with limits.max_functions: {unreserved} for {where} in the catalog"
            )
        _memory_of_deployed(found, client, workflow, names, deployed, quota)
    return found


def _memory_of_deployed(
    found: Findings,
    client: Any,
    workflow: Workflow,
    names: list[str],
    deployed: Mapping[str, Mapping[str, str]] | None,
    quota: int | None,
) -> None:
    """Each deployed function's MemorySize and Timeout against the build's; a function not deployed yet above a new
    account's memory quota is a notice when the account's concurrency quota (`quota`) is a new account's."""
    for name in names:
        region_deployed = (deployed or {}).get(name)
        for function in workflow.region(name).functions:
            deployed_name = None if region_deployed is None else region_deployed.get(function.name)
            if deployed_name is not None:
                found.failures += _deployed_configuration(client, name, function, deployed_name)
            elif (
                function.memory_mb > NEW_ACCOUNT_LAMBDA_MEMORY_MB
                and quota is not None
                and quota < DEFAULT_LAMBDA_CONCURRENCY
            ):
                found.notices.append(
                    f"{name}: function {function.name} needs {function.memory_mb} MB; this account's concurrency "
                    f"quota ({quota}) is a new account's, whose memory quota is often "
                    f"{NEW_ACCOUNT_LAMBDA_MEMORY_MB} MB (no API reports it): if sam deploy says MemorySize must be "
                    "at most that, ask AWS support to raise it, or recompile with limits.max_memory_mb: "
                    f"{NEW_ACCOUNT_LAMBDA_MEMORY_MB}"
                )


def _deployed_configuration(client: Any, region: str, function: Function, deployed: str) -> list[str]:
    """The deployed function's MemorySize and Timeout against the build's: another memory is another plan;
    a shorter timeout kills every invocation that runs the planned range (an execution fails at once)."""
    try:
        configuration = client.get_function_configuration(FunctionName=deployed)
    except Exception as exc:  # noqa: BLE001 - botocore's errors (not found, access denied): one line
        return [f"{region}: function {function.name}: cannot read {deployed}: {_line(exc)}; deploy the build first"]
    redeploy = f"deploy this build (sam build --config-env {region} && sam deploy --config-env {region})"
    has, timeout = int(configuration.get("MemorySize", 0)), int(configuration.get("Timeout", 3))
    wrong = []
    if has != function.memory_mb:
        wrong.append(f"is deployed with {has} MB; this build needs {function.memory_mb} MB")
    if timeout < function.timeout_s:
        wrong.append(f"has a timeout of {timeout} s; this build needs {function.timeout_s} s")
    return [f"{region}: function {function.name} ({deployed}) {'; it '.join(wrong)}: {redeploy}"] if wrong else []


# --- OpenFaaS capacity ----------------------------------------------------------------------------------

_BINARY = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
_DECIMAL = {"n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "": Decimal(1), "k": Decimal(10**3)}
_DECIMAL |= {"M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12), "P": Decimal(10**15), "E": Decimal(10**18)}


def quantity(text: str | int | float) -> Decimal:
    """A Kubernetes resource quantity ("3800m", "16Gi", "1.5", "128974848", "1e3") as a number of units
    (cores, bytes). ValueError names the text."""
    value = str(text).strip()
    for suffixes in (_BINARY, _DECIMAL):
        for suffix in sorted(suffixes, key=len, reverse=True):
            if suffix and value.endswith(suffix):
                try:
                    return Decimal(value[: -len(suffix)]) * suffixes[suffix]
                except InvalidOperation:
                    break
    try:
        number = Decimal(value)
    except InvalidOperation:
        raise ValueError(f"{text!r}: not a Kubernetes quantity (e.g. 500m, 2Gi)") from None
    if not number.is_finite():
        raise ValueError(f"{text!r}: not a Kubernetes quantity (e.g. 500m, 2Gi)")
    return number


@dataclass(frozen=True)
class Pod:
    """One function replica's requests."""

    function: str
    cpu: Decimal  # cores
    memory: Decimal  # bytes


@dataclass
class Node:
    name: str
    cpu: Decimal  # free cores
    memory: Decimal  # free bytes


def stack_pods(stack: Mapping[str, Any]) -> list[Pod]:
    """Each function replica of an OpenFaaS stack file: its `requests` (else `limits`), scale.min replicas."""
    pods = []
    for name, function in sorted((stack.get("functions") or {}).items()):
        asked = function.get("requests") or function.get("limits") or {}
        replicas = int((function.get("labels") or {}).get("com.openfaas.scale.min", 1))
        cpu, memory = quantity(asked.get("cpu", 0)), quantity(asked.get("memory", 0))
        pods += [Pod(name, cpu, memory)] * replicas
    return pods


def schedulable_nodes(nodes: Mapping[str, Any], pods: Mapping[str, Any] | None, ignore: Iterable[str]) -> list[Node]:
    """The nodes a function pod may land on (Ready, not cordoned, no NoSchedule/NoExecute taint) with their
    allocatable CPU and memory less the requests of the pods already there (not finished, not one of the
    functions in `ignore`: the stack's own, which its deploy replaces). `nodes`, `pods`: the API's NodeList
    and PodList (None: pods unknown)."""
    skipped = set(ignore)
    free: dict[str, Node] = {}
    for item in nodes.get("items", []):
        spec, status = item.get("spec") or {}, item.get("status") or {}
        ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", []))
        tainted = any(t.get("effect") in ("NoSchedule", "NoExecute") for t in spec.get("taints") or [])
        if not ready or tainted or spec.get("unschedulable"):
            continue
        allocatable = status.get("allocatable") or {}
        name = item["metadata"]["name"]
        free[name] = Node(name, quantity(allocatable.get("cpu", 0)), quantity(allocatable.get("memory", 0)))
    for pod in (pods or {}).get("items", []):
        node = free.get((pod.get("spec") or {}).get("nodeName", ""))
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if node is None or labels.get("faas_function") in skipped:
            continue
        if (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
            continue
        for container in (pod.get("spec") or {}).get("containers", []):
            requests = (container.get("resources") or {}).get("requests") or {}
            node.cpu -= quantity(requests.get("cpu", 0))
            node.memory -= quantity(requests.get("memory", 0))
    return [free[name] for name in sorted(free)]


def capacity_problems(where: str, pods: list[Pod], nodes: list[Node], region: str) -> list[str]:
    """The stack's pods placed largest first, each onto the node with the most memory left that holds it.
    `where`: the stack file, first in each line; `region`: the catalog region to limit."""
    if not pods:
        return []
    total_cpu, total_memory = sum((p.cpu for p in pods), Decimal(0)), sum((p.memory for p in pods), Decimal(0))
    has_cpu = sum((max(n.cpu, Decimal(0)) for n in nodes), Decimal(0))
    has_memory = sum((max(n.memory, Decimal(0)) for n in nodes), Decimal(0))
    fix = (
        f"add nodes, or recompile with a catalog limiting {region}'s functions (limits.max_total_memory_mb, "
        "limits.max_functions, smaller tiers_mb)"
    )
    biggest = max(pods, key=lambda p: (p.memory, p.cpu))
    roomiest = max(nodes, key=lambda n: (n.memory, n.cpu, n.name), default=None)
    if roomiest is None or not any(n.cpu >= biggest.cpu and n.memory >= biggest.memory for n in nodes):
        largest = (
            "no schedulable node"
            if roomiest is None
            else (f"the roomiest node ({roomiest.name}) has {_gib(roomiest.memory)} and {_cpus(roomiest.cpu)} free")
        )
        return [
            f"{where}: function {biggest.function} requests {_gib(biggest.memory)} and {_cpus(biggest.cpu)} per "
            f"replica; {largest}: {fix}"
        ]
    room = [Node(n.name, n.cpu, n.memory) for n in nodes]
    for pod in sorted(pods, key=lambda p: (p.memory, p.cpu, p.function), reverse=True):
        fits = [n for n in room if n.cpu >= pod.cpu and n.memory >= pod.memory]
        if not fits:
            return [
                f"{where}: the stack requests {_gib(total_memory)} and {_cpus(total_cpu)} for {len(pods)} pods; the "
                f"cluster's schedulable nodes have {_gib(has_memory)} and {_cpus(has_cpu)} free ({len(nodes)} "
                f"nodes; {pod.function}'s replicas do not all fit): {fix}"
            ]
        node = max(fits, key=lambda n: (n.memory, n.cpu, n.name))
        node.cpu -= pod.cpu
        node.memory -= pod.memory
    return []


def _gib(value: Decimal) -> str:
    return f"{float(value) / 2**30:.1f} GiB"


def _cpus(value: Decimal) -> str:
    return f"{float(value):g} CPUs"


def kubectl_get(path: str, context: str | None) -> Mapping[str, Any]:
    """GET `path` of the Kubernetes API with the user's kubectl and kubeconfig. RuntimeError: one line."""
    command = ["kubectl", *(["--context", context] if context else []), "get", "--raw", path]
    command.append(f"--request-timeout={int(REQUEST_TIMEOUT_S)}s")
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=REQUEST_TIMEOUT_S * 2, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"kubectl get --raw {path}: {_line(exc)}") from None
    if done.returncode != 0:
        raise RuntimeError(f"kubectl get --raw {path}: {_line(done.stderr or done.stdout or 'failed')}")
    try:
        document = json.loads(done.stdout)
    except json.JSONDecodeError:
        raise RuntimeError(f"kubectl get --raw {path}: not JSON") from None
    if not isinstance(document, dict):
        raise RuntimeError(f"kubectl get --raw {path}: not a Kubernetes list")
    return document


def cluster_access() -> str | None:
    """Why the cluster cannot be read from here (None: kubectl and a kubeconfig or in-cluster access exist)."""
    if shutil.which("kubectl") is None:
        return "kubectl is not installed"
    configs = [p for p in os.environ.get("KUBECONFIG", "").split(os.pathsep) if p]
    if not any(Path(p).is_file() for p in configs or [str(Path.home() / ".kube" / "config")]):
        if not os.environ.get("KUBERNETES_SERVICE_HOST"):
            return "no cluster access is configured (KUBECONFIG, ~/.kube/config)"
    return None


def cluster_capacity(stacks: Mapping[str, Mapping[str, Any]], context: str | None) -> Findings:
    """Each region's stack (`stacks`: region -> parsed stack.yaml) against the cluster kubectl reaches."""
    found = Findings()
    missing = cluster_access()
    if missing is not None:
        found.notices.append(f"OpenFaaS capacity not checked: {missing}")
        return found
    try:
        nodes = kubectl_get("/api/v1/nodes", context)
    except RuntimeError as exc:
        found.notices.append(f"OpenFaaS capacity not checked: {exc}")
        return found
    try:
        pods: Mapping[str, Any] | None = kubectl_get("/api/v1/pods", context)
    except RuntimeError as exc:
        pods = None
        found.notices.append(f"other pods' requests not counted: {exc}")
    for region, stack in sorted(stacks.items()):
        try:
            wanted = stack_pods(stack)
            free = schedulable_nodes(nodes, pods, (stack.get("functions") or {}).keys())
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            found.failures.append(f"{region}: cannot read the stack or the cluster's nodes: {_line(exc)}")
            continue
        found.failures += capacity_problems(f"regions/{region}/stack.yaml", wanted, free, region)
    return found


# --- image visibility -----------------------------------------------------------------------------------


def image_reference(image: str) -> tuple[str, str, str]:
    """(registry host[:port], repository, tag or digest) of an image name, as Docker reads it: a first
    component with '.' or ':' (or localhost) is the registry, else Docker Hub (library/ for one component)."""
    name, at, digest = image.partition("@")
    tag = "latest"
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        name, tag = name[:colon], name[colon + 1 :]
    first, _, rest = name.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        registry, repository = first, rest
    else:
        registry, repository = DOCKER_HUB, name if "/" in name else f"library/{name}"
    return registry, repository, digest if at else tag


def loopback_registry(registry: str) -> bool:
    host = registry[1 : registry.find("]")] if registry.startswith("[") else registry.rsplit(":", 1)[0]
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _request(url: str, method: str, headers: Mapping[str, str]) -> tuple[int, Any, bytes]:
    """(status, headers, body) of one request; an HTTP error status is an answer, not an exception."""
    request = urllib.request.Request(url, method=method, headers=dict(headers))
    context = ssl.create_default_context()
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S, context=context) as answer:
            return answer.status, answer.headers, answer.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def _challenge(header: str) -> dict[str, str]:
    """The parameters of a `Bearer realm="...",service="...",scope="..."` challenge ({} if not Bearer)."""
    scheme, _, rest = header.strip().partition(" ")
    if scheme.lower() != "bearer":
        return {}
    params: dict[str, str] = {}
    for part in _split_params(rest):
        key, _, value = part.partition("=")
        params[key.strip().lower()] = value.strip().strip('"')
    return params


def _split_params(text: str) -> list[str]:
    parts, current, quoted = [], "", False
    for char in text:
        if char == '"':
            quoted = not quoted
        if char == "," and not quoted:
            parts.append(current)
            current = ""
        else:
            current += char
    return [*parts, current] if current.strip() else parts


def anonymous_pull_problem(image: str) -> str | None:
    """Why OpenFaaS CE could not pull `image` without credentials (one line with the fix), None if it can.
    OSError when the registry does not answer from here (unreachable, throttled, failing): not checked."""
    registry, repository, reference = image_reference(image)
    if loopback_registry(registry):
        return (
            f"image {image}: registry {registry} is this machine's loopback; faas-netes checks and pulls the image "
            "from inside the cluster, where that is the pod itself: push to a registry the cluster reaches (e.g. "
            "ghcr.io/<you>, public) and recompile with --registry"
        )
    # HTTPS only: go-containerregistry also tries plain HTTP for an RFC 1918 address; such a registry is not
    # reached here (a notice, not a failure)
    manifest = f"https://{DOCKER_HUB_API if registry == DOCKER_HUB else registry}/v2/{repository}/manifests/{reference}"
    accept = {"Accept": ", ".join(MANIFEST_TYPES)}
    status, headers, _ = _request(manifest, "HEAD", accept)
    if status == 401:
        challenge = _challenge(headers.get("WWW-Authenticate", ""))
        if not challenge.get("realm"):
            return _private(image, registry, f"the registry asks for credentials ({headers.get('WWW-Authenticate')})")
        query = {"scope": f"repository:{repository}:pull"}
        if challenge.get("service"):
            query["service"] = challenge["service"]
        joined = "&" if "?" in challenge["realm"] else "?"
        token_status, _, body = _request(f"{challenge['realm']}{joined}{urllib.parse.urlencode(query)}", "GET", {})
        if token_status != 200:
            return _private(image, registry, f"its token service refuses an anonymous pull (HTTP {token_status})")
        try:
            granted = json.loads(body)
            token = granted.get("token") or granted.get("access_token")
        except (json.JSONDecodeError, AttributeError):
            token = None
        if not token:
            return _private(image, registry, "its token service gives no anonymous token")
        status, _, _ = _request(manifest, "HEAD", {**accept, "Authorization": f"Bearer {token}"})
    if status == 200:
        return None
    if status in (401, 403):
        return _private(image, registry, f"an anonymous pull is refused (HTTP {status})")
    if status == 404:
        return (
            f"image {image}: not in {registry} (HTTP 404): push it first (faas-cli push -f regions/<region>/stack.yaml)"
        )
    raise OSError(f"{registry} answers HTTP {status} to a manifest request")  # throttled, down: not checked


def _private(image: str, registry: str, why: str) -> str:
    public = (
        "make the package public (its Package settings, Change visibility)"
        if registry == "ghcr.io"
        else ("make the repository public")
    )
    return (
        f"image {image}: {why}; OpenFaaS CE deploys only images it can pull anonymously: {public}, or run "
        "OpenFaaS Pro with a registry secret (then --openfaas-pro)"
    )


def image_visibility(images: Iterable[str]) -> Findings:
    found = Findings()
    for image in sorted(set(images)):
        try:
            problem = anonymous_pull_problem(image)
        except (OSError, ssl.SSLError, ValueError) as exc:
            found.notices.append(f"image {image}: not checked, the registry did not answer here: {_line(exc)}")
            continue
        if problem is not None:
            found.failures.append(problem)
    return found


# --- the run's pre-flight -------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """cloudless-run's pre-flight options."""
    parser.add_argument(
        "--preflight-only",
        action="store_true",
        help="check, without running anything, what would stop a deployed run (--invoker lambda: the account's "
        "Lambda concurrency and the deployed functions' memory; --invoker openfaas: the cluster's capacity for the "
        "stack and that OpenFaaS CE can pull its images); exit status 0 when it passes, 2 when not",
    )
    parser.add_argument(
        "--kube-context", metavar="NAME", help="--invoker openfaas: the kubeconfig context of the OpenFaaS cluster"
    )
    parser.add_argument(
        "--openfaas-pro",
        action="store_true",
        help="--invoker openfaas: the cluster runs OpenFaaS Pro, which pulls private images with a registry secret "
        "(their visibility is not checked)",
    )


def peer_grants(workflow: Workflow, stacks: Mapping[str, Stack]) -> list[str]:
    """Several regions: each region's stack must be given every peer's bucket (its PeerBucket<Region>
    parameters equal to the peers' BucketName outputs), else its functions have no right there (the
    template's rights on a peer hold only where its parameter is set). One line per stack, naming the
    sam deploy that gives them."""
    problems = []
    for region, stack in sorted(stacks.items()):
        wanted = {peer_parameter(peer): stacks[peer].bucket for peer in sorted(stacks) if peer != region}
        wrong = sorted(key for key, bucket in wanted.items() if stack.parameters.get(key) != bucket)
        if not wrong:
            continue
        has = ", ".join(f"{key} is {stack.parameters.get(key) or 'empty'}" for key in wrong)
        named = "" if stack.name == stack_name(workflow.run.name, region) else f" --stack-name {stack.name}"
        overrides = " ".join(f"{key}={bucket}" for key, bucket in sorted(wanted.items()))
        problems.append(
            f"{region}: stack {stack.name} does not grant its peers' buckets ({has}): deploy it with them: "
            f"sam deploy --config-env {region}{named} --parameter-overrides {overrides}"
        )
    return problems


def lambda_preflight(args: argparse.Namespace, workflow: Workflow) -> Findings:
    """--invoker lambda: the stacks (--stack, or with --preflight-only the default ones where they exist), their
    peers' grants, the account's concurrency and the deployed functions' memory. Without --stack the functions
    are invoked by the names the template gives them, so they must exist."""
    found = Findings()
    deployed: dict[str, Mapping[str, str]] = {}
    if args.stack or args.preflight_only:
        try:
            names = stack_names(workflow, list(args.stack))
        except ValueError as exc:
            if args.preflight_only:  # else the driver refuses it itself, with the same line
                found.failures.append(str(exc))
            return found
        stacks: dict[str, Stack] = {}
        for region in workflow.regions:
            client = aws_client("cloudformation", region_name=aws_region(region.name))
            try:
                stacks[region.name] = read_stack(client, names[region.name], workflow, region)
            except DeployError as exc:
                if not args.preflight_only:
                    return found  # the driver refuses the stack itself, with the same line
                if args.stack:
                    found.failures.append(str(exc))
                else:
                    found.notices.append(f"{exc}: its functions' memory and peers not checked")
        if len(stacks) == len(workflow.regions):
            found.failures += peer_grants(workflow, stacks)
        deployed = {region: stack.functions for region, stack in stacks.items()}
    else:
        deployed = {
            region.name: {f.name: lambda_function_name(f.name, region.name) for f in region.functions}
            for region in workflow.regions
        }
    found.add(lambda_quotas(workflow, lambda aws: aws_client("lambda", region_name=aws), deployed))
    return found


def gate(args: argparse.Namespace, build: Path, workflow: Workflow) -> int | None:
    """cloudless-run's pre-flight: None to go on; else the exit status (2: a check failed, or bad use; 0: it
    passed and --preflight-only). Nothing has been started or written when it runs."""
    if getattr(args, "rehearse", False):  # a rehearsal (rehearse-* branches) deploys locally: no real account
        return None
    for option, given in (("--kube-context", args.kube_context), ("--openfaas-pro", args.openfaas_pro)):
        if given and args.invoker != "openfaas":
            print(f"cloudless-run: {option}: only with --invoker openfaas, not {args.invoker}", file=sys.stderr)
            return 2
    if args.invoker == "local":
        if args.preflight_only:
            print(
                "cloudless-run: --preflight-only checks a deployment; give --invoker lambda or openfaas",
                file=sys.stderr,
            )
            return 2
        return None
    if args.invoker == "openfaas":
        found = openfaas_preflight(build, workflow, args.kube_context, args.openfaas_pro)
    else:
        found = lambda_preflight(args, workflow)
    code = report(found, args.quiet and not args.preflight_only)
    if code is None and args.preflight_only:
        skipped = f" ({len(found.notices)} not checked, see above)" if found.notices else ""
        print(f"pre-flight passed for --invoker {args.invoker}{skipped}; nothing was started")
        return 0
    return code


def openfaas_preflight(build: Path, workflow: Workflow, context: str | None, pro: bool) -> Findings:
    """Capacity and (CE) image visibility of every region's stack.yaml in the build."""
    stacks: dict[str, Mapping[str, Any]] = {}
    found = Findings()
    for region in workflow.regions:
        path = build / "regions" / region.name / "stack.yaml"
        if not path.is_file():
            found.notices.append(f"{path}: none (built without --target openfaas): its capacity and images not checked")
            continue
        try:
            stack = yaml.safe_load(path.read_text())
        except (OSError, yaml.YAMLError) as exc:
            found.failures.append(f"{path}: cannot be read: {_line(exc)}")
            continue
        stacks[region.name] = stack if isinstance(stack, dict) else {}
    found.add(cluster_capacity(stacks, context))
    if not pro:
        images = [str(f.get("image")) for s in stacks.values() for f in (s.get("functions") or {}).values()]
        found.add(image_visibility(images))
    return found


def report(found: Findings, quiet: bool = False) -> int | None:
    """Print the findings (one line each, on stderr); 2 if anything failed, else None (go on)."""
    for notice in found.notices:
        if not quiet:
            print(f"cloudless-run: pre-flight: {notice}", file=sys.stderr)
    for failure in found.failures:
        print(f"cloudless-run: pre-flight: {failure}", file=sys.stderr)
    if found.failures:
        print(f"cloudless-run: pre-flight failed ({len(found.failures)}); nothing was started", file=sys.stderr)
        return 2
    return None


def _line(exc: BaseException | str) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
