"""Storage channels: how functions hand each other tensors. One interface, three back ends.

- `DirectoryChannel`: a local folder (the embedded default, and what `cloudless-run` uses).
- `S3Channel`: an S3 bucket and prefix through boto3 (AWS, or any S3-protocol endpoint).
- `RedisChannel`: a Redis server.

Reads name the exact key and poll with bounded back-off until it appears (never LIST); writes are
atomic (a reader sees nothing or the whole value); `claim` writes only if the key is absent, which
is how a duplicate invocation recognises that another one got there first.
"""

from __future__ import annotations

import os
import tempfile
import threading
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import cast
from urllib.parse import urlparse

from cloudless.ir.protocol import S3_ENDPOINT_ENV


class KeyTimeout(TimeoutError):
    """A key did not appear within the wait."""


class Channel(ABC):
    """Exact-key blob storage. Back ends implement `try_get`, `put`, `claim` and `delete`."""

    #: polling starts at `poll_s` and doubles up to `max_poll_s`: a pipeline stage waits for its
    #: neighbours' tensors all the time, and every poll interval is added to its iteration time
    poll_s = 0.001
    max_poll_s = 0.01

    @abstractmethod
    def try_get(self, key: str) -> bytes | None:
        """The value at `key`, or None."""

    @abstractmethod
    def put(self, key: str, data: bytes) -> None:
        """Write `data` at `key` atomically."""

    @abstractmethod
    def claim(self, key: str, data: bytes) -> bool:
        """Write `data` at `key` if nothing is there; True if this call wrote it."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove `key` (absent is fine)."""

    def get(self, key: str, timeout: float = 600.0, cancelled: threading.Event | None = None) -> bytes:
        """The value at `key`, waiting for it to be written (bounded polling with back-off); a set
        `cancelled` event ends the wait early (with KeyTimeout)."""
        deadline = time.monotonic() + timeout
        wait = self.poll_s
        while True:
            data = self.try_get(key)
            if data is not None:
                return data
            if time.monotonic() >= deadline or (cancelled is not None and cancelled.is_set()):
                raise KeyTimeout(f"{self.describe(key)} did not appear within {timeout:g} s")
            time.sleep(wait)
            wait = min(wait * 2, self.max_poll_s)

    def exists(self, key: str) -> bool:
        return self.try_get(key) is not None

    def describe(self, key: str) -> str:
        return key


class DirectoryChannel(Channel):
    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._folders: set[Path] = set()  # made already: a put then costs no mkdir

    def _path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"storage key {key!r} must be relative and stay inside the channel")
        return self.root / key

    def try_get(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def _staged(self, key: str, data: bytes) -> tuple[Path, str]:
        path = self._path(key)
        if path.parent not in self._folders:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._folders.add(path.parent)
        fd, temp = tempfile.mkstemp(prefix=".put.", dir=path.parent)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
        return path, temp

    def put(self, key: str, data: bytes) -> None:
        path, temp = self._staged(key, data)
        os.replace(temp, path)

    def claim(self, key: str, data: bytes) -> bool:
        path, temp = self._staged(key, data)
        try:
            os.link(temp, path)  # fails if the key exists: create-if-absent, with the content in place
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(temp)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def describe(self, key: str) -> str:
        return str(self._path(key))


class S3Channel(Channel):
    poll_s = 0.005
    max_poll_s = 0.02  # a GET costs 0.4 µUSD: polling every 20 ms for a minute costs 1.2 mUSD

    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None) -> None:
        import boto3  # only functions that use S3 need it

        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.client = boto3.client("s3", endpoint_url=endpoint_url or os.environ.get(S3_ENDPOINT_ENV))

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def try_get(self, key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)

    def claim(self, key: str, data: bytes) -> bool:
        from botocore.exceptions import ClientError

        try:
            # S3 conditional write: fails with 412 when the object exists.
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data, IfNoneMatch="*")
            return True
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False
            raise

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def describe(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"


class RedisChannel(Channel):
    def __init__(self, url: str, prefix: str = "") -> None:
        import redis  # only functions that use Redis need it

        self.client = redis.Redis.from_url(url)
        self.prefix = prefix.strip("/")

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def try_get(self, key: str) -> bytes | None:
        return cast("bytes | None", self.client.get(self._key(key)))  # bytes: decode_responses is off

    def put(self, key: str, data: bytes) -> None:
        self.client.set(self._key(key), data)  # SET replaces the value atomically

    def claim(self, key: str, data: bytes) -> bool:
        return bool(self.client.set(self._key(key), data, nx=True))

    def delete(self, key: str) -> None:
        self.client.delete(self._key(key))

    def describe(self, key: str) -> str:
        return f"redis {self._key(key)}"


def open_channel(location: str) -> Channel:
    """A channel from a location: a folder path, `s3://bucket/prefix`, or `redis://host:port/db[#prefix]`."""
    parsed = urlparse(location)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ValueError(f"storage {location!r}: expected s3://bucket/prefix")
        return S3Channel(parsed.netloc, parsed.path)
    if parsed.scheme in ("redis", "rediss"):
        return RedisChannel(location.split("#")[0], parsed.fragment)
    if parsed.scheme in ("", "file"):
        return DirectoryChannel(parsed.path if parsed.scheme == "file" else location)
    raise ValueError(f"storage {location!r}: expected a folder, s3://bucket/prefix or redis://host:port/db")
