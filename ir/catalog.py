"""The region catalog: regions, memory tiers, CPU shares, bandwidth, prices and limits (YAML).

A built-in default (catalogs/default.yaml, figures cited there) serves when no catalog is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from cloudless.ir.schema import SchemaError, check_finite, read_yaml, validate


@dataclass(frozen=True)
class Prices:
    gb_second: float
    per_million_requests: float
    storage_put_per_1000: float
    storage_get_per_1000: float
    egress_per_gb: float


@dataclass(frozen=True)
class Region:
    name: str
    provider: str
    tiers_mb: tuple[int, ...]
    mb_per_vcpu: float
    max_vcpus: float
    gflops_per_vcpu: float | None
    min_mbps: float
    max_mbps: float
    request_latency_s: float
    runtime_overhead_mb: float
    memory_gbps_per_vcpu: float
    prices: Prices
    max_memory_mb: int
    timeout_s: float
    max_functions: int
    sync_payload_bytes: int = 6 * 2**20
    async_payload_bytes: int = 256 * 2**10

    def vcpus(self, tier_mb: int) -> float:
        """The CPU share of a function of this memory (the platform ties CPU to memory)."""
        return min(self.max_vcpus, tier_mb / self.mb_per_vcpu)

    def bandwidth_bps(self, tier_mb: int) -> float:
        """Bytes per second each way between a function of this memory and storage (uploads and
        downloads run at once): linear in the tier between the catalog's min and max."""
        low, high = min(self.tiers_mb), max(self.tiers_mb)
        share = 0.0 if high == low else (tier_mb - low) / (high - low)
        return (self.min_mbps + share * (self.max_mbps - self.min_mbps)) * 1e6

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
            min_mbps=data["network"]["min_mbps"],
            max_mbps=data["network"]["max_mbps"],
            request_latency_s=data["network"]["request_latency_s"],
            runtime_overhead_mb=data["memory"]["runtime_overhead_mb"],
            memory_gbps_per_vcpu=data["memory"]["bandwidth_gbps_per_vcpu"],
            prices=Prices(**data["prices"]),
            max_memory_mb=limits["max_memory_mb"],
            timeout_s=limits["timeout_s"],
            max_functions=limits["max_functions"],
            sync_payload_bytes=limits.get("sync_payload_bytes", 6 * 2**20),
            async_payload_bytes=limits.get("async_payload_bytes", 256 * 2**10),
        )


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


def parse_catalog(data: Any, source: str) -> Catalog:
    validate(data, "catalog", source)
    check_finite(data, source)
    regions = tuple(Region.from_json(r) for r in data["regions"])
    for i, region in enumerate(regions):
        if region.min_mbps > region.max_mbps:
            raise SchemaError(f"{source}: key regions/{i}/network: min_mbps exceeds max_mbps")
        too_big = [t for t in region.tiers_mb if t > region.max_memory_mb]
        if too_big:
            raise SchemaError(
                f"{source}: key regions/{i}/tiers_mb: tier {too_big[0]} MB exceeds limits.max_memory_mb "
                f"{region.max_memory_mb}"
            )
    names = [r.name for r in regions]
    if len(set(names)) != len(names):
        raise SchemaError(f"{source}: key regions: region names must be unique")
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
        links.append((frozenset(entry["between"]), Link(entry["mbps"] * 1e6, entry["latency_s"])))
    default = Link(wan["default"]["mbps"] * 1e6, wan["default"]["latency_s"])
    return Catalog(source, regions, default, tuple(links))


def load_catalog(path: Path | None = None) -> Catalog:
    """The catalog at `path`, or the built-in default."""
    if path is None:
        text = resources.files("cloudless.ir").joinpath("catalogs", "default.yaml").read_text()
        return parse_catalog(yaml.safe_load(text), "default catalog")
    if not path.is_file():
        raise SchemaError(f"{path}: no such file; expected a region catalog (YAML)")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise SchemaError(f"{path}: cannot be read as text: {exc}") from exc
    return parse_catalog(read_yaml(text, str(path)), str(path))
