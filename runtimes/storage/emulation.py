"""Emulating a cloud function's resources on this machine: its network link to storage and its CPU share.

A function's link has an uplink and a downlink of `bytes_per_s` each (they run at once, as the cost
model assumes), and every request costs `latency_s` on top. Requests in the same direction queue
behind each other on their link, so two concurrent uploads take twice as long, as on a real NIC.

The CPU share is emulated as a CFS quota enforces it: a function of `share` < 1 vCPU may use
`share * 0.1` s of CPU per 0.1 s period, and is throttled once it has spent that.

Several regions: a function reaches another region's storage across the WAN link between the two
(`wan_channel`): an `EmulatedChannel` with the link's bandwidth (each way) and latency when the WAN
is emulated (`Resources.wan`), which always counts the requests and bytes of that region pair. Each
function process emulates the link on its own (a region's functions do not share one WAN queue).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from ...ir.workflow import WanLink
from .channels import Channel


@dataclass(frozen=True)
class Resources:
    """What one function gets: bytes per second each way to storage, request latency, vCPUs, and
    (`wan`) whether its requests to other regions' storage take the WAN link's time."""

    bytes_per_s: float | None = None
    latency_s: float = 0.0
    vcpus: float | None = None
    wan: bool = False

    def to_json(self) -> dict[str, float | bool | None]:
        document: dict[str, float | bool | None] = {
            "bytes_per_s": self.bytes_per_s,
            "latency_s": self.latency_s,
            "vcpus": self.vcpus,
        }
        if self.wan:
            document["wan"] = True
        return document

    @staticmethod
    def from_json(data: dict[str, float | bool | None]) -> Resources:
        bytes_per_s, vcpus = data.get("bytes_per_s"), data.get("vcpus")
        return Resources(
            None if bytes_per_s is None else float(bytes_per_s),
            float(data.get("latency_s") or 0.0),
            None if vcpus is None else float(vcpus),
            bool(data.get("wan", False)),
        )


class Link:
    """One direction of a function's network: transfers queue and take size / rate each."""

    def __init__(self, bytes_per_s: float | None) -> None:
        self.bytes_per_s = bytes_per_s
        self._free_at = 0.0
        self._lock = threading.Lock()

    def transfer(self, size: int) -> None:
        if not self.bytes_per_s or size <= 0:
            return
        with self._lock:
            start = max(time.monotonic(), self._free_at)
            self._free_at = start + size / self.bytes_per_s
            done = self._free_at
        pause = done - time.monotonic()
        if pause > 0:
            time.sleep(pause)


class EmulatedChannel(Channel):
    """A channel seen through a function's link: latency per request, bytes at the link's rate.
    It also counts the requests and bytes, which is what storage is billed by."""

    def __init__(self, inner: Channel, resources: Resources | None = None) -> None:
        self.inner = inner
        self.resources = resources or Resources()
        self.uplink = Link(self.resources.bytes_per_s)
        self.downlink = Link(self.resources.bytes_per_s)
        self.poll_s, self.max_poll_s = inner.poll_s, inner.max_poll_s
        self.counts = {"gets": 0, "puts": 0, "deletes": 0, "bytes_in": 0, "bytes_out": 0}
        self._count_lock = threading.Lock()

    def _request(self, kind: str, size: int = 0) -> None:
        with self._count_lock:
            self.counts[kind] += 1
            if size:
                self.counts["bytes_in" if kind == "gets" else "bytes_out"] += size
        if self.resources.latency_s > 0:
            time.sleep(self.resources.latency_s)

    def try_get(self, key: str) -> bytes | None:
        data = self.inner.try_get(key)
        self._request("gets", len(data) if data is not None else 0)
        if data is not None:
            self.downlink.transfer(len(data))
        return data

    def put(self, key: str, data: bytes) -> None:
        self._request("puts", len(data))
        self.uplink.transfer(len(data))
        self.inner.put(key, data)

    def claim(self, key: str, data: bytes) -> bool:
        self._request("puts", len(data))
        self.uplink.transfer(len(data))
        return self.inner.claim(key, data)

    def delete(self, key: str) -> None:
        self._request("deletes")  # free on S3, but a request all the same
        self.inner.delete(key)

    def delete_prefix(self, prefix: str) -> int:
        self._request("deletes")
        return self.inner.delete_prefix(prefix)

    def describe(self, key: str) -> str:
        return self.inner.describe(key)


def wan_link(links: tuple[WanLink, ...] | None, a: str, b: str) -> WanLink | None:
    """The link between regions `a` and `b` (either way round), if the workflow has one."""
    for link in links or ():
        if set(link.between) == {a, b}:
            return link
    return None


def wan_channel(peer: Channel, link: WanLink | None, emulate: bool) -> EmulatedChannel:
    """Another region's storage as a function sees it: across `link` (its bandwidth each way and its
    latency per request) when `emulate`, else at the machine's speed; counted either way."""
    if not emulate or link is None:
        return EmulatedChannel(peer)
    return EmulatedChannel(peer, Resources(bytes_per_s=link.mb_per_s * 1e6, latency_s=link.latency_s))


class CpuShare:
    """Holds a function to its CPU share, as the CFS quota of its container does: it may run
    `share * PERIOD_S` seconds of CPU per period, and once that is spent it is throttled until the
    quota is back. (Sleeping after every small step instead would leave the core's caches cold for
    each step, slowing the compute itself.) `with share.compute(): ...` around each compute step."""

    PERIOD_S = 0.1

    def __init__(self, vcpus: float | None) -> None:
        self.share = vcpus if vcpus and vcpus < 1.0 else None
        self.capacity = (self.share or 0.0) * self.PERIOD_S
        self.budget = self.capacity
        self.refilled = time.monotonic()

    def compute(self) -> _Charged:
        return _Charged(self)

    def charge(self, cpu_s: float) -> None:
        if self.share is None:
            return
        now = time.monotonic()
        self.budget = min(self.capacity, self.budget + (now - self.refilled) * self.share) - cpu_s
        self.refilled = now
        if self.budget < 0:  # throttled until the quota is whole again
            time.sleep((self.capacity - self.budget) / self.share)
            self.budget, self.refilled = self.capacity, time.monotonic()


class _Charged:
    def __init__(self, share: CpuShare) -> None:
        self.share = share
        self.began = 0.0

    def __enter__(self) -> None:
        self.began = time.thread_time()

    def __exit__(self, *exc: object) -> None:
        self.share.charge(time.thread_time() - self.began)
