"""The region catalog: regions, memory tiers, CPU shares, bandwidth, prices and limits (YAML).

A built-in default (catalogs/default.yaml, figures cited there) serves when no catalog is given.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from .schema import SchemaError, check_finite, read_yaml, validate

#: Catalog keys that were renamed: "mbps" read as megabits per second, but these are megabytes.
RENAMED_KEYS = {"min_mbps": "min_mb_per_s", "max_mbps": "max_mb_per_s", "mbps": "mb_per_s"}

#: A catalog region of provider aws is named AWS_REGION_PREFIX + its AWS region (aws-us-east-1).
AWS_REGION_PREFIX = "aws-"
#: The AWS regions (those cfn-lint knows, which the build's check lints SAM templates for: a region it
#: does not know could not be checked); tests/test_plan.py checks this against cfnlint.helpers.REGIONS.
AWS_REGIONS = frozenset(
    {
        "af-south-1",
        "ap-east-1",
        "ap-east-2",
        "ap-northeast-1",
        "ap-northeast-2",
        "ap-northeast-3",
        "ap-south-1",
        "ap-south-2",
        "ap-southeast-1",
        "ap-southeast-2",
        "ap-southeast-3",
        "ap-southeast-4",
        "ap-southeast-5",
        "ap-southeast-6",
        "ap-southeast-7",
        "ca-central-1",
        "ca-west-1",
        "cn-north-1",
        "cn-northwest-1",
        "eu-central-1",
        "eu-central-2",
        "eu-isoe-west-1",
        "eu-north-1",
        "eu-south-1",
        "eu-south-2",
        "eu-west-1",
        "eu-west-2",
        "eu-west-3",
        "eusc-de-east-1",
        "il-central-1",
        "me-central-1",
        "me-south-1",
        "mx-central-1",
        "sa-east-1",
        "us-east-1",
        "us-east-2",
        "us-gov-east-1",
        "us-gov-west-1",
        "us-iso-east-1",
        "us-iso-west-1",
        "us-isob-east-1",
        "us-isob-west-1",
        "us-isof-east-1",
        "us-isof-south-1",
        "us-west-1",
        "us-west-2",
    }
)
#: Lambda's limits (https://docs.aws.amazon.com/lambda/latest/dg/gettingstarted-limits.html): what an aws
#: region's tiers and timeout may be (the generated SAM template's MemorySize and Timeout).
LAMBDA_MEMORY_MB = (128, 10240)
LAMBDA_MAX_TIMEOUT_S = 900
#: "New AWS accounts have reduced concurrency and memory quotas" (the same page), figures AWS does not publish:
#: deploys of new accounts report "'MemorySize' value failed to satisfy constraint: Member must have value less
#: than or equal to 3008", and GetAccountSettings reports ConcurrentExecutions 10. No API reports the memory
#: quota (GetAccountSettings has concurrency and code storage only); AWS raises both with use or on request.
NEW_ACCOUNT_LAMBDA_MEMORY_MB = 3008
NEW_ACCOUNT_LAMBDA_CONCURRENCY = 10
#: Lambda's default concurrency quota, and its code in Service Quotas (where an increase is requested)
DEFAULT_LAMBDA_CONCURRENCY = 1000
LAMBDA_CONCURRENCY_QUOTA_CODE = "L-B99A9384"
#: Step Functions runs an iteration's (stage, replica) workers as one Map state, all at once (the stages wait
#: on each other's activations): an inline Map runs at most INLINE_MAP_MAX_CONCURRENCY iterations at once, a
#: Distributed Map (child workflow executions) at most DISTRIBUTED_MAP_MAX_CONCURRENCY
#: (https://docs.aws.amazon.com/step-functions/latest/dg/state-map.html). The generated state machine uses
#: the inline Map up to 40 workers and the Distributed Map above, so an aws region's plan built for SAM has
#: at most DISTRIBUTED_MAP_MAX_CONCURRENCY workers (and the catalog's limits.max_functions, Lambda's
#: concurrency quota).
INLINE_MAP_MAX_CONCURRENCY = 40
DISTRIBUTED_MAP_MAX_CONCURRENCY = 10_000
#: OpenFaaS editions (a region's `openfaas_edition`, default DEFAULT_OPENFAAS_EDITION): the Community Edition
#: (faas-netes) rejects `com.openfaas.scale.max` above OPENFAAS_CE_MAX_REPLICAS and deploys at most
#: OPENFAAS_CE_MAX_FUNCTIONS functions (per namespace: one region's stack.yaml is one namespace's functions);
#: OpenFaaS Pro has neither limit. The default is the edition a fresh `arkade install openfaas` gives.
OPENFAAS_EDITIONS = ("ce", "pro")
DEFAULT_OPENFAAS_EDITION = "ce"
OPENFAAS_CE_MAX_REPLICAS = 5
OPENFAAS_CE_MAX_FUNCTIONS = 15
#: A container image's repository name (the Docker distribution grammar, github.com/distribution/reference):
#: an optional registry host[:port] (a first component with a '.' or ':', or localhost), then path
#: components of lowercase letters and digits joined by '.', '_', '__' or dashes; at most 255 characters.
#: A region's `registry` (and cloudless-compile --registry) is such a name's prefix: the image of a
#: function is <registry>/<function>:<tag>.
_LABEL = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
_HOST = re.compile(rf"{_LABEL}(?:\.{_LABEL})*(?::[0-9]+)?")
_PATH_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
MAX_IMAGE_NAME = 255
#: the longest function name (a DNS-1035 label, as OpenFaaS requires)
MAX_FUNCTION_NAME = 63


def registry_problem(registry: str) -> str | None:
    """Why `registry` cannot prefix an image name (None when it can): `ghcr.io/acme`, `docker.io/acme`,
    `localhost:5000` and `acme` (a Docker Hub account) can."""
    if not registry:
        return "empty; expected a registry and path such as ghcr.io/acme or docker.io/acme"
    if "://" in registry:
        return "a registry host and path, without a scheme (ghcr.io/acme, not https://ghcr.io/acme)"
    if registry.endswith("/"):
        return "without a trailing '/' (ghcr.io/acme, not ghcr.io/acme/)"
    first, _, rest = registry.partition("/")
    components = registry.split("/")
    if "." in first or ":" in first or first == "localhost":
        if not _HOST.fullmatch(first):
            return f"{first!r} is not a registry host[:port]"
        components = rest.split("/") if rest else []
    for component in components:
        if not _PATH_COMPONENT.fullmatch(component):
            return (
                f"{component!r} is not a repository path component (lowercase letters and digits, joined by "
                "'.', '_' or '-')"
            )
    if len(registry) + 1 + MAX_FUNCTION_NAME > MAX_IMAGE_NAME:
        return f"{len(registry)} characters; an image name holds at most {MAX_IMAGE_NAME} with the function's name"
    return None


def aws_region_of(region_name: str) -> str | None:
    """The AWS region a catalog region named aws-<region> deploys to; None if the name is no such name."""
    if not region_name.startswith(AWS_REGION_PREFIX):
        return None
    region = region_name[len(AWS_REGION_PREFIX) :]
    return region if region in AWS_REGIONS else None


@dataclass(frozen=True)
class Prices:
    gb_second: float
    per_million_requests: float
    storage_put_per_1000: float
    storage_get_per_1000: float
    egress_per_gb: float
    #: AWS: the state machine's state transitions (a deployed round of invocations); 0: not charged
    state_transition_per_1000: float = 0.0


@dataclass(frozen=True)
class Region:
    name: str
    provider: str
    tiers_mb: tuple[int, ...]
    mb_per_vcpu: float
    max_vcpus: float
    gflops_per_vcpu: float | None
    #: megabytes (10^6 bytes) per second each way, at the smallest and the largest tier
    min_mb_per_s: float
    max_mb_per_s: float
    request_latency_s: float
    runtime_overhead_mb: float
    memory_gbps_per_vcpu: float
    prices: Prices
    max_memory_mb: int
    timeout_s: float
    max_functions: int
    sync_payload_bytes: int = 6 * 2**20
    async_payload_bytes: int = 256 * 2**10
    #: the OpenFaaS edition of the cluster this region's stack.yaml deploys to (OPENFAAS_EDITIONS)
    openfaas_edition: str = DEFAULT_OPENFAAS_EDITION
    #: where faas-cli pushes this region's images (an image name prefix, see registry_problem); None: none
    registry: str | None = None
    #: data residency: the regions its training data may move to (None: any; empty: it stays here)
    data_may_move_to: tuple[str, ...] | None = None
    #: capacity: the memory of all its concurrent functions together, MB (None: no limit but max_functions')
    max_total_memory_mb: int | None = None

    def vcpus(self, tier_mb: int) -> float:
        """The CPU share of a function of this memory (the platform ties CPU to memory)."""
        return min(self.max_vcpus, tier_mb / self.mb_per_vcpu)

    def bandwidth_bps(self, tier_mb: int) -> float:
        """Bytes per second each way between a function of this memory and storage (uploads and
        downloads run at once): linear in the tier between the catalog's min and max."""
        low, high = min(self.tiers_mb), max(self.tiers_mb)
        share = 0.0 if high == low else (tier_mb - low) / (high - low)
        return (self.min_mb_per_s + share * (self.max_mb_per_s - self.min_mb_per_s)) * 1e6

    @staticmethod
    def from_json(data: dict[str, Any]) -> Region:
        limits = data["limits"]
        return Region(
            name=data["name"],
            provider=data["provider"],
            tiers_mb=tuple(sorted(data["tiers_mb"])),
            mb_per_vcpu=data["cpu"]["mb_per_vcpu"],
            max_vcpus=data["cpu"]["max_vcpus"],
            gflops_per_vcpu=data["cpu"].get("gflops_per_vcpu"),
            min_mb_per_s=data["network"]["min_mb_per_s"],
            max_mb_per_s=data["network"]["max_mb_per_s"],
            request_latency_s=data["network"]["request_latency_s"],
            runtime_overhead_mb=data["memory"]["runtime_overhead_mb"],
            memory_gbps_per_vcpu=data["memory"]["bandwidth_gbps_per_vcpu"],
            prices=Prices(**data["prices"]),
            max_memory_mb=limits["max_memory_mb"],
            timeout_s=limits["timeout_s"],
            max_functions=limits["max_functions"],
            sync_payload_bytes=limits.get("sync_payload_bytes", 6 * 2**20),
            async_payload_bytes=limits.get("async_payload_bytes", 256 * 2**10),
            openfaas_edition=data.get("openfaas_edition", DEFAULT_OPENFAAS_EDITION),
            registry=data.get("registry"),
            data_may_move_to=None if data.get("data_may_move_to") is None else tuple(data["data_may_move_to"]),
            max_total_memory_mb=limits.get("max_total_memory_mb"),
        )


@dataclass(frozen=True)
class Bound:
    """A deployment platform's limit on a plan: its value, what sets it and how to lift it (the planner's
    messages name both)."""

    value: int
    what: str
    lift: str


@dataclass(frozen=True)
class PlatformLimits:
    """What the deployment files built for one region allow a plan; None: no such limit.

    `workers`: an iteration's (stage, replica) instances, which all run at once; `replicas`: one stage's;
    `stages`: the region's functions (one per stage)."""

    workers: Bound | None = None
    replicas: Bound | None = None
    stages: Bound | None = None


def platform_limits(region: Region, targets: Iterable[str]) -> PlatformLimits:
    """The limits of the platforms whose files are built for `region` (targets "openfaas", "sam"): SAM (aws
    regions only) runs an iteration's workers as one Step Functions Map, at most
    DISTRIBUTED_MAP_MAX_CONCURRENCY at once; OpenFaaS CE allows OPENFAAS_CE_MAX_REPLICAS replicas per function
    and OPENFAAS_CE_MAX_FUNCTIONS functions (Pro neither). The catalog's limits.max_functions holds for
    every target; it is the region's own figure (on aws, Lambda's concurrency quota)."""
    chosen = set(targets)
    workers = replicas = stages = None
    if "sam" in chosen and region.provider == "aws":
        workers = Bound(
            DISTRIBUTED_MAP_MAX_CONCURRENCY,
            f"the {DISTRIBUTED_MAP_MAX_CONCURRENCY} workers a Step Functions Distributed Map runs at once (an "
            f"iteration of {region.name} runs all its workers together)",
            "use fewer replicas or stages",
        )
    if "openfaas" in chosen and region.openfaas_edition == "ce":
        lift = f"set openfaas_edition: pro for region {region.name} in the catalog if its cluster runs OpenFaaS Pro"
        if region.provider == "aws":
            lift += ", or build --target sam only"
        replicas = Bound(
            OPENFAAS_CE_MAX_REPLICAS,
            f"OpenFaaS CE's {OPENFAAS_CE_MAX_REPLICAS} replicas per function (com.openfaas.scale.max) in {region.name}",
            lift,
        )
        stages = Bound(
            OPENFAAS_CE_MAX_FUNCTIONS,
            f"OpenFaaS CE's {OPENFAAS_CE_MAX_FUNCTIONS} functions (one per stage) in {region.name}",
            lift,
        )
    return PlatformLimits(workers, replicas, stages)


@dataclass(frozen=True)
class Link:
    """A wide-area link between two regions' storage: bytes per second one way, one request's round trip."""

    bandwidth_bps: float
    latency_s: float

    def transfer_s(self, nbytes: float, requests: int = 1) -> float:
        return requests * self.latency_s + nbytes / self.bandwidth_bps


#: When a catalog has no `wan` section (assumption: a cross-ocean pair of cloud regions, ~80 ms
#: round trip as public inter-region latency tables show, 100 MB/s for one bulk stream).
DEFAULT_WAN = Link(100e6, 0.08)


@dataclass(frozen=True)
class Catalog:
    source: str
    regions: tuple[Region, ...]
    wan_default: Link = DEFAULT_WAN
    wan_links: tuple[tuple[frozenset[str], Link], ...] = ()

    def link(self, a: str, b: str) -> Link:
        """The link between regions a and b; within one region, storage is local (no WAN)."""
        if a == b:
            raise ValueError(f"no WAN link within region {a}")
        for pair, link in self.wan_links:
            if pair == frozenset((a, b)):
                return link
        return self.wan_default

    def region(self, name: str | None) -> Region:
        if name is None:
            return self.regions[0]
        for region in self.regions:
            if region.name == name:
                return region
        known = ", ".join(r.name for r in self.regions)
        raise SchemaError(f"{self.source}: no region {name!r}; the catalog has {known}")


def _check_renamed(data: Any, source: str) -> None:
    """SchemaError naming the first key a catalog spells the old way (before the schema's generic
    "Additional properties" message, which would not say what the key became)."""

    def fail(where: str, old: str) -> None:
        raise SchemaError(f"{source}: key {where}/{old}: renamed to {RENAMED_KEYS[old]} (megabytes per second)")

    if not isinstance(data, dict):
        return
    regions = data.get("regions")
    for i, region in enumerate(regions if isinstance(regions, list) else []):
        network = region.get("network") if isinstance(region, dict) else None
        for old in ("min_mbps", "max_mbps"):
            if isinstance(network, dict) and old in network:
                fail(f"regions/{i}/network", old)
    wan = data.get("wan")
    if not isinstance(wan, dict):
        return
    if isinstance(wan.get("default"), dict) and "mbps" in wan["default"]:
        fail("wan/default", "mbps")
    links = wan.get("links")
    for i, link in enumerate(links if isinstance(links, list) else []):
        if isinstance(link, dict) and "mbps" in link:
            fail(f"wan/links/{i}", "mbps")


def _check_region(region: Region, source: str, where: str) -> None:
    """What the schema cannot say of one region, and what its platform's generated files would reject
    (AWS: the region name samconfig.toml deploys to, Lambda's memory and timeout limits)."""
    if region.min_mb_per_s > region.max_mb_per_s:
        raise SchemaError(f"{source}: key {where}/network: min_mb_per_s exceeds max_mb_per_s")
    too_big = [t for t in region.tiers_mb if t > region.max_memory_mb]
    if too_big:
        raise SchemaError(
            f"{source}: key {where}/tiers_mb: tier {too_big[0]} MB exceeds limits.max_memory_mb {region.max_memory_mb}"
        )
    largest = max(region.tiers_mb)
    if region.runtime_overhead_mb >= largest:
        raise SchemaError(
            f"{source}: key {where}/memory/runtime_overhead_mb: {region.runtime_overhead_mb:g} MB leaves no memory "
            f"for the model in the largest tier ({largest} MB)"
        )
    if region.registry is not None:
        problem = registry_problem(region.registry)
        if problem:
            raise SchemaError(f"{source}: key {where}/registry: {region.registry!r}: {problem}")
    if region.provider != "aws":
        return
    if aws_region_of(region.name) is None:
        raise SchemaError(
            f"{source}: key {where}/name: {region.name!r} is not an AWS region name; aws regions are named "
            f"{AWS_REGION_PREFIX}<region>, e.g. aws-us-east-1"
        )
    low, high = LAMBDA_MEMORY_MB
    if region.max_memory_mb > high:
        raise SchemaError(
            f"{source}: key {where}/limits/max_memory_mb: {region.max_memory_mb} MB; Lambda allows {low} to {high} MB"
        )
    if region.timeout_s > LAMBDA_MAX_TIMEOUT_S:
        raise SchemaError(
            f"{source}: key {where}/limits/timeout_s: {region.timeout_s:g} s; Lambda allows 1 to "
            f"{LAMBDA_MAX_TIMEOUT_S} s"
        )


def parse_catalog(data: Any, source: str) -> Catalog:
    _check_renamed(data, source)
    validate(data, "catalog", source)
    check_finite(data, source)
    regions = tuple(Region.from_json(r) for r in data["regions"])
    for i, region in enumerate(regions):
        _check_region(region, source, f"regions/{i}")
    names = [r.name for r in regions]
    if len(set(names)) != len(names):
        raise SchemaError(f"{source}: key regions: region names must be unique")
    for i, region in enumerate(regions):
        for j, name in enumerate(region.data_may_move_to or ()):
            if name == region.name:
                raise SchemaError(
                    f"{source}: key regions/{i}/data_may_move_to/{j}: {name!r} is the region itself; list the "
                    "other regions its data may move to ([]: it stays here)"
                )
            if name not in names:
                raise SchemaError(
                    f"{source}: key regions/{i}/data_may_move_to/{j}: no region {name!r}; the catalog has "
                    f"{', '.join(names)}"
                )
        if region.max_total_memory_mb is not None and region.max_total_memory_mb < min(region.tiers_mb):
            raise SchemaError(
                f"{source}: key regions/{i}/limits/max_total_memory_mb: {region.max_total_memory_mb} MB holds not "
                f"one function of the smallest tier ({min(region.tiers_mb)} MB)"
            )
    wan = data.get("wan")
    if wan is None:
        return Catalog(source, regions)
    links = []
    for i, entry in enumerate(wan.get("links", [])):
        for name in entry["between"]:
            if name not in names:
                raise SchemaError(
                    f"{source}: key wan/links/{i}/between: no region {name!r}; the catalog has {', '.join(names)}"
                )
        if entry["between"][0] == entry["between"][1]:
            raise SchemaError(f"{source}: key wan/links/{i}/between: a link joins two different regions")
        links.append((frozenset(entry["between"]), Link(entry["mb_per_s"] * 1e6, entry["latency_s"])))
    default = Link(wan["default"]["mb_per_s"] * 1e6, wan["default"]["latency_s"])
    return Catalog(source, regions, default, tuple(links))


def load_catalog(path: Path | None = None) -> Catalog:
    """The catalog at `path`, or the built-in default."""
    if path is None:
        text = resources.files("cloudless.ir").joinpath("catalogs", "default.yaml").read_text()
        return parse_catalog(read_yaml(text, "default catalog"), "default catalog")
    if not path.is_file():
        raise SchemaError(f"{path}: no such file; expected a region catalog (YAML)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SchemaError(f"{path}: cannot be read as text: {exc}") from exc
    return parse_catalog(read_yaml(text, str(path)), str(path))
