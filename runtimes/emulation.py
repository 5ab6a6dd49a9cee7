"""Emulating a cloud function's resources on this machine: its network link to storage and its CPU share.

A function's link has an uplink and a downlink of `bytes_per_s` each (they run at once, as the cost
model assumes), and every request costs `latency_s` on top. Requests in the same direction queue
behind each other on their link, so two concurrent uploads take twice as long, as on a real NIC.

The CPU share is emulated as a CFS quota would enforce it: after running `t` seconds on one core, a
function of `share` < 1 vCPU is held back `t * (1/share - 1)` more.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from .storage import Channel


@dataclass(frozen=True)
class Resources:
    """What one function gets: bytes per second each way to storage, request latency, vCPUs."""

    bytes_per_s: float | None = None
    latency_s: float = 0.0
    vcpus: float | None = None

    def to_json(self) -> dict[str, float | None]:
        return {"bytes_per_s": self.bytes_per_s, "latency_s": self.latency_s, "vcpus": self.vcpus}

    @staticmethod
    def from_json(data: dict[str, float | None]) -> Resources:
        return Resources(data.get("bytes_per_s"), float(data.get("latency_s") or 0.0), data.get("vcpus"))


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
        self.counts = {"gets": 0, "puts": 0, "bytes_in": 0, "bytes_out": 0}
        self._count_lock = threading.Lock()

    def _request(self, kind: str, size: int = 0) -> None:
        with self._count_lock:
            self.counts[kind] += 1
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
        self._request("puts")
        self.inner.delete(key)

    def describe(self, key: str) -> str:
        return self.inner.describe(key)


class CpuShare:
    """Holds a function back to its CPU share: `with share.compute(): ...` around each compute step."""

    def __init__(self, vcpus: float | None) -> None:
        self.stretch = (1.0 / vcpus - 1.0) if vcpus and vcpus < 1.0 else 0.0

    def compute(self) -> _Stretched:
        return _Stretched(self.stretch)


class _Stretched:
    def __init__(self, stretch: float) -> None:
        self.stretch = stretch
        self.began = 0.0

    def __enter__(self) -> None:
        self.began = time.thread_time()

    def __exit__(self, *exc: object) -> None:
        if self.stretch:
            time.sleep((time.thread_time() - self.began) * self.stretch)
