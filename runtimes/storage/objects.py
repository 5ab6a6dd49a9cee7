"""The user's own objects where they lie: training data in a folder or an S3 bucket, read as it is.

Unlike a `Channel` (Cloudless's keys, sealed with an integrity header, written by the run), these are files
the user wrote, read byte for byte: whole, or a byte range (the index of a tar reads its headers only).
A read names the version it expects (S3's ETag, a file's size and modification time), so that an object
replaced while a run reads it is an error, never a mix of two datasets. Transient errors are ridden out
as a channel's are (`transient.ride_out`), and S3 reads meet `--inject-storage-faults` as storage does.
Every read is counted (`ObjectReads`): what the controller read, and what a function read, is on record.
"""

from __future__ import annotations

import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import urlparse

from ...ir.protocol import S3_ENDPOINT_ENV
from .transient import RIDE_OUT_S, StorageFaults, aws_client, inject_s3_faults, ride_out

_T = TypeVar("_T")


class ObjectError(ValueError):
    """An object cannot be read as named: missing, refused (403), or changed since it was indexed."""


@dataclass
class ObjectReads:
    """What a store read: requests and bytes (thread-safe)."""

    requests: int = 0
    bytes: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, size: int) -> None:
        with self._lock:
            self.requests += 1
            self.bytes += size


@dataclass(frozen=True)
class ObjectStat:
    """An object's size, and its version: what changes when it is written again."""

    size: int
    version: str


class ObjectStore(ABC):
    """Objects under a root (a folder, a bucket), named by their full location (`locate`)."""

    def __init__(self) -> None:
        self.reads = ObjectReads()

    @abstractmethod
    def stat(self, location: str) -> ObjectStat:
        """The object's size and version; ObjectError when there is none or it may not be read."""

    @abstractmethod
    def read(self, location: str, version: str, start: int = 0, end: int | None = None) -> bytes:
        """Bytes start .. end - 1 (end None: to the end) of the object, which must still be `version`."""

    def read_parts(self, location: str, version: str, parts: list[tuple[int, int]]) -> list[bytes]:
        """Bytes (offset, size) of the object, for each part in order of offset, from one read of it at
        `version`; each part is its own bytes, made once (a part shorter than its size: the object ends)."""
        data = self.read(location, version)
        return [data[offset : offset + size] for offset, size in parts]

    @abstractmethod
    def list(self, prefix: str) -> list[str]:
        """The locations of the objects whose location starts with `prefix`, in sorted order."""


class FolderObjects(ObjectStore):
    """Files, named by their absolute paths."""

    def stat(self, location: str) -> ObjectStat:
        try:
            found = os.stat(location)
        except FileNotFoundError:
            raise ObjectError(f"{location}: no such file") from None
        except OSError as exc:
            raise ObjectError(f"{location}: cannot be read: {exc.strerror}") from None
        if not Path(location).is_file():
            raise ObjectError(f"{location}: not a file")
        return ObjectStat(found.st_size, f"{found.st_size}-{found.st_mtime_ns}")

    def _open(self, location: str, version: str) -> Any:
        try:
            file = open(location, "rb")
        except FileNotFoundError:
            raise ObjectError(f"{location}: no such file (deleted while the run read it)") from None
        now = os.fstat(file.fileno())
        if f"{now.st_size}-{now.st_mtime_ns}" != version:
            file.close()
            raise ObjectError(f"{location}: changed since it was indexed (written again while the run read it)")
        return file

    def read(self, location: str, version: str, start: int = 0, end: int | None = None) -> bytes:
        with self._open(location, version) as file:
            file.seek(start)
            data = file.read() if end is None else file.read(end - start)
        self.reads.count(len(data))
        return data

    def read_parts(self, location: str, version: str, parts: list[tuple[int, int]]) -> list[bytes]:
        with self._open(location, version) as file:
            read = [os.pread(file.fileno(), size, offset) for offset, size in parts]
        self.reads.count(sum(len(part) for part in read))
        return read

    def list(self, prefix: str) -> list[str]:
        folder, _, head = prefix.rpartition("/")
        try:
            names = os.listdir(folder or "/")
        except OSError:
            return []
        return sorted(f"{folder}/{name}" for name in names if name.startswith(head) and Path(folder, name).is_file())


class S3Objects(ObjectStore):
    """Objects of S3 buckets, named `s3://bucket/key`; the endpoint of `$CLOUDLESS_S3_ENDPOINT` if set."""

    def __init__(self, ride_out_s: float = RIDE_OUT_S) -> None:
        super().__init__()
        self.ride_out_s = ride_out_s
        self.client = aws_client("s3", endpoint_url=os.environ.get(S3_ENDPOINT_ENV) or None)
        faults = StorageFaults.from_env()
        self.faults = inject_s3_faults(self.client, faults) if faults else None

    @staticmethod
    def _split(location: str) -> tuple[str, str]:
        parsed = urlparse(location)
        return parsed.netloc, parsed.path.lstrip("/")

    def _refused(self, location: str, exc: Any) -> ObjectError:
        code = exc.response.get("Error", {}).get("Code")
        if code in ("NoSuchKey", "404", "NotFound"):
            return ObjectError(f"{location}: no such object")
        if code in ("NoSuchBucket",):
            return ObjectError(f"{location}: no such bucket")
        if code in ("AccessDenied", "403", "Forbidden"):
            return ObjectError(f"{location}: access denied (403): these credentials may not read it")
        if code in ("PreconditionFailed", "412"):
            return ObjectError(f"{location}: changed since it was indexed (written again while the run read it)")
        return ObjectError(f"{location}: {code}: {exc}")

    def _call(self, location: str, request: Callable[[], _T]) -> _T:
        """`request()`, its transient errors ridden out; what S3 or botocore refuse, one ObjectError."""
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        try:
            return ride_out(request, self.ride_out_s)
        except ClientError as exc:
            raise self._refused(location, exc) from None
        except NoCredentialsError:
            raise ObjectError(
                f"{location}: no AWS credentials to read it with (set AWS_PROFILE, or AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY)"
            ) from None
        except BotoCoreError as exc:
            raise ObjectError(f"{location}: cannot be read: {exc}") from None

    def stat(self, location: str) -> ObjectStat:
        bucket, key = self._split(location)
        head = self._call(location, lambda: self.client.head_object(Bucket=bucket, Key=key))
        self.reads.count(0)
        return ObjectStat(int(head["ContentLength"]), str(head["ETag"]))

    def read(self, location: str, version: str, start: int = 0, end: int | None = None) -> bytes:
        bucket, key = self._split(location)
        options: dict[str, Any] = {"Bucket": bucket, "Key": key, "IfMatch": version}
        if start or end is not None:
            options["Range"] = f"bytes={start}-{'' if end is None else end - 1}"

        def get() -> bytes:  # a body cut short raises while it is read: ridden out with the request
            return cast(bytes, self.client.get_object(**options)["Body"].read())

        data = self._call(location, get)
        self.reads.count(len(data))
        return data

    def read_parts(self, location: str, version: str, parts: list[tuple[int, int]]) -> list[bytes]:
        """One GET at `version`, its body read as it streams: the gaps between parts skipped (a tar's
        headers), each part read into its own bytes."""
        bucket, key = self._split(location)

        def get() -> tuple[list[bytes], int]:  # a body cut short raises while it is read: ridden out with it
            body = self.client.get_object(Bucket=bucket, Key=key, IfMatch=version)["Body"]
            read, position = [], 0
            for offset, size in parts:
                while position < offset:  # skipped in pieces: a gap is a few header blocks
                    skipped = len(body.read(min(offset - position, 1 << 20)))
                    if not skipped:
                        break
                    position += skipped
                read.append(body.read(size))
                position += len(read[-1])
            return read, position + len(body.read())  # to the end: the connection is kept for the next GET

        read, total = self._call(location, get)
        self.reads.count(total)
        return read

    def list(self, prefix: str) -> list[str]:
        bucket, key = self._split(prefix)

        def pages() -> list[str]:
            found: list[str] = []
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=key):
                self.reads.count(0)
                found += [f"s3://{bucket}/{item['Key']}" for item in page.get("Contents", [])]
            return found

        return sorted(self._call(prefix, pages))


def store_for(location: str) -> ObjectStore:
    """The store of `location`: `s3://bucket/key`, or an absolute path."""
    if location.startswith("s3://"):
        return S3Objects()
    if not os.path.isabs(location):
        raise ObjectError(f"{location}: expected s3://BUCKET/KEY or an absolute path")
    return FolderObjects()
