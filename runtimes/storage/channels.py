"""Storage channels: how functions hand each other tensors. One interface, three back ends.

- `DirectoryChannel`: a local folder (the embedded default, and what `cloudless-run` uses).
- `S3Channel`: an S3 bucket and prefix through boto3 (AWS, or any S3-protocol endpoint).
- `RedisChannel`: a Redis server.

Reads name the exact key and poll with bounded back-off until it appears (never LIST); writes are
atomic (a reader sees nothing or the whole value); `claim` writes only if the key is absent, which
is how a duplicate invocation recognises that another one got there first. Every value is stored
sealed with its digest (`protocol.seal`) and checked when read: a corrupt value is a `CorruptBlob`
naming the key (`get` asks again a few times first: a bad read may be the network's, not the
storage's). `delete_prefix` (the controller's end-of-run clean-up, never a function's) lists.

A folder's keys stay inside it: no component of a key's path may be a symbolic link (one planted in the
folder would lead a write or read elsewhere). A Redis password may come from the environment
(`protocol.REDIS_PASSWORD_ENV`, `protocol.REDIS_PASSWORD_FILE_ENV`) instead of the URL, which a command
line shows to every user of the machine (`ps`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import urlparse

from ...ir.protocol import (
    REDIS_PASSWORD_ENV,
    REDIS_PASSWORD_FILE_ENV,
    S3_ENDPOINT_ENV,
    SEAL_TAG,
    CorruptBlob,
    seal,
    unseal,
)
from .polling import Backoff
from .transient import (
    RIDE_OUT_S,
    FaultDrawer,
    StorageFaults,
    aws_client,
    inject_s3_faults,
    is_transient,
    redis_fault_connection,
    redis_retry_options,
    ride_out,
)

_T = TypeVar("_T")


class KeyTimeout(TimeoutError):
    """A key did not appear within the wait."""


class StorageRefused(ValueError):
    """Storage cannot be used as named (a symbolic link inside a storage folder, a password the server
    refuses): bad input, one line; no retry mends it."""


class Channel(ABC):
    """Exact-key blob storage: `try_get`, `put`, `claim`, `delete` and `delete_prefix`."""

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
        """Write `data` at `key` if nothing is there; True if this call wrote it, or the key holds `data`
        already (a retried create whose first try wrote): a caller's `data` must be its own (an
        invocation's id in it), or mean the same whoever wrote it."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove `key` (absent is fine)."""

    @abstractmethod
    def delete_prefix(self, prefix: str) -> int:
        """Remove every key under `prefix` (a folder-like prefix ending in '/'); how many there were."""

    #: a corrupt read is asked again this many times before `get` gives up
    corrupt_retries = 2

    def get(
        self,
        key: str,
        timeout: float = 600.0,
        cancelled: threading.Event | None = None,
        abort: Callable[[], None] | None = None,
    ) -> bytes:
        """The value at `key`, waiting for it to be written (bounded polling with back-off); a set
        `cancelled` event ends the wait early (with KeyTimeout). `abort`, called about once a second
        while waiting, raises to give up (the run was aborted elsewhere)."""
        clock = Backoff(self.poll_s, self.max_poll_s, timeout, cancelled)
        corrupt = 0
        while True:
            try:
                data = self.try_get(key)
            except CorruptBlob:
                corrupt += 1
                if corrupt > self.corrupt_retries:
                    raise
                data = None
            if data is not None:
                return data
            if clock.expired() or (cancelled is not None and cancelled.is_set()):
                raise KeyTimeout(f"{self.describe(key)} did not appear within {timeout:g} s")
            if abort is not None and clock.once_a_second():
                abort()
            clock.pause()

    def exists(self, key: str) -> bool:
        """Whether anything is at `key` (a corrupt value too: it is there, and reading it will say so)."""
        try:
            return self.try_get(key) is not None
        except CorruptBlob:
            return True

    def describe(self, key: str) -> str:
        return key


class RidingOut(Channel):
    """A channel whose requests ride out transient errors (`transient.ride_out`, above the SDK's own
    retries) for up to `ride_out_s`; what outlasts it, or is no transient, is raised."""

    #: which errors are ridden out
    retryable: Callable[[BaseException], bool] = staticmethod(is_transient)

    def __init__(self, inner: Channel, ride_out_s: float = RIDE_OUT_S) -> None:
        self.inner, self.ride_out_s = inner, ride_out_s
        self.poll_s, self.max_poll_s = inner.poll_s, inner.max_poll_s

    def _retried(self, what: str, key: str, call: Callable[[], _T]) -> _T:
        return ride_out(call, self.ride_out_s, self.retryable)

    def try_get(self, key: str) -> bytes | None:
        return self._retried("reading", key, lambda: self.inner.try_get(key))

    def put(self, key: str, data: bytes) -> None:
        self._retried("writing", key, lambda: self.inner.put(key, data))

    def claim(self, key: str, data: bytes) -> bool:
        return self._retried("writing", key, lambda: self.inner.claim(key, data))

    def delete(self, key: str) -> None:
        self._retried("deleting", key, lambda: self.inner.delete(key))

    def delete_prefix(self, prefix: str) -> int:
        return self._retried("deleting", prefix, lambda: self.inner.delete_prefix(prefix))

    def describe(self, key: str) -> str:
        return self.inner.describe(key)


class SealedStore(Channel):
    """A storage back end: seals what it writes and checks what it reads; subclasses move raw bytes."""

    @abstractmethod
    def _read(self, key: str) -> bytes | None: ...

    @abstractmethod
    def _write(self, key: str, blob: bytes) -> None: ...

    @abstractmethod
    def _create(self, key: str, blob: bytes) -> bool: ...

    def try_get(self, key: str) -> bytes | None:
        blob = self._read(key)
        return None if blob is None else unseal(self.describe(key), blob)

    def put(self, key: str, data: bytes) -> None:
        self._write(key, seal(data))

    def claim(self, key: str, data: bytes) -> bool:
        blob = seal(data)
        if self._create(key, blob):
            return True
        # A create whose answer was lost and which the client retried (`transient`) finds its own value
        # there: this call wrote it. Claims' values are unique to their callers, or mean the same.
        return self._read(key) == blob


#: the name prefix of a DirectoryChannel's temporary files (a value being written, then renamed into place)
_TEMPORARY = ".put."


def _sealed(path: Path) -> bool:
    """Whether the file at `path` starts as every value a SealedStore writes does (`protocol.seal`)."""
    try:
        with path.open("rb") as file:
            return file.read(len(SEAL_TAG)) == SEAL_TAG
    except OSError:
        return False


class DirectoryChannel(SealedStore):
    def __init__(self, root: Path | str) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._folders: set[Path] = set()  # made already: a put then costs no mkdir

    def _where(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"storage key {key!r} must be relative and stay inside the channel")
        return self.root / key

    def _path(self, key: str) -> Path:
        """The key's file; StorageRefused if a component of it below the root is a symbolic link (one
        planted in the folder would lead the key outside it). The root itself may be one: the user's."""
        path = self._where(key)
        here = self.root
        for part in path.relative_to(self.root).parts:  # an lstat each: cheap beside the value's bytes
            here = here / part
            if here.is_symlink():
                raise self._link(here)
        return path

    def _link(self, path: Path) -> StorageRefused:
        return StorageRefused(
            f"{path}: a symbolic link inside the storage folder {self.root}; storage never follows one "
            "(it would lead keys outside the folder): remove it"
        )

    def _read(self, key: str) -> bytes | None:
        path = self._path(key)
        try:
            # O_NOFOLLOW: a link planted since the check above is refused too, not read through
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            return None
        except OSError:
            if path.is_symlink():
                raise self._link(path) from None
            raise
        with os.fdopen(fd, "rb") as file:
            return file.read()

    def _staged(self, key: str, data: bytes) -> tuple[Path, str]:
        path = self._path(key)
        if path.parent not in self._folders:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._folders.add(path.parent)
        fd, temp = tempfile.mkstemp(prefix=_TEMPORARY, dir=path.parent)
        with self._removed_on_error(temp), os.fdopen(fd, "wb") as handle:
            handle.write(data)
        return path, temp

    @staticmethod
    @contextlib.contextmanager
    def _removed_on_error(temp: str) -> Iterator[None]:
        """A write cut short (a full disk, a folder made read-only) leaves no temporary file behind."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(temp)
            raise

    def _write(self, key: str, blob: bytes) -> None:
        path, temp = self._staged(key, blob)
        with self._removed_on_error(temp):
            os.replace(temp, path)

    def _create(self, key: str, blob: bytes) -> bool:
        path, temp = self._staged(key, blob)
        try:
            os.link(temp, path)  # fails if the key exists: create-if-absent, with the content in place
            return True
        except FileExistsError:
            return False
        finally:
            os.unlink(temp)

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def delete_prefix(self, prefix: str) -> int:
        """Only what this class wrote: sealed values, and its temporary files of writes cut short; then
        the folders left empty. A file of anyone else's (the user's, in a folder they named as storage)
        stays, and so do the folders holding one; a symbolic link is neither followed nor removed."""
        try:
            folder = self._path(prefix.rstrip("/"))
        except StorageRefused:  # below a link: nothing of this folder's
            return 0
        if not folder.is_dir():
            return 0
        count = 0
        for here, dirs, files in os.walk(folder, topdown=False):
            for name in files:
                path = Path(here, name)
                if not path.is_symlink() and (name.startswith(_TEMPORARY) or _sealed(path)):
                    path.unlink(missing_ok=True)
                    count += 1
            for name in dirs:
                with contextlib.suppress(OSError):  # not empty (the user's file), or a link
                    Path(here, name).rmdir()
        with contextlib.suppress(OSError):
            folder.rmdir()
        self._folders = {f for f in self._folders if not f.is_relative_to(folder)}
        return count

    def describe(self, key: str) -> str:
        return str(self._where(key))


class S3Channel(SealedStore):
    poll_s = 0.005
    max_poll_s = 0.02  # a GET costs 0.4 µUSD: polling every 20 ms for a minute costs 1.2 mUSD

    def __init__(self, bucket: str, prefix: str = "", endpoint_url: str | None = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.client = aws_client("s3", endpoint_url=endpoint_url or os.environ.get(S3_ENDPOINT_ENV))
        faults = StorageFaults.from_env()
        self.faults: FaultDrawer | None = inject_s3_faults(self.client, faults) if faults else None

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _read(self, key: str) -> bytes | None:
        """The object, or None when S3 answers 404 (NoSuchKey). A 403 (AccessDenied) is not "missing": S3
        answers a missing key with 403 only to a caller without s3:ListBucket on the bucket (GetObject's
        documented permissions), and the role the build generates holds it on the run's buckets (with no
        s3:prefix condition, whose use in that check AWS does not document). So a 403 is a real refusal
        (another prefix, a peer bucket the stack does not grant, credentials that are not the role's):
        StorageRefused, one line naming the key; polling would only wait out the key timeout."""
        from botocore.exceptions import ClientError

        try:
            # A body cut short raises here (IncompleteReadError): transient, and the callers ride it out
            # (`transient.ride_out`); the SDK retries a request, not the reading of its answer's body.
            return cast(bytes, self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read())
        except self.client.exceptions.NoSuchKey:
            return None
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("AccessDenied", "403"):
                raise
            raise StorageRefused(
                f"{self.describe(key)}: access denied (403): these credentials may not read it; a key not written "
                "yet reads as 404 to a role holding s3:ListBucket on the bucket, as the generated role does"
            ) from None

    def _write(self, key: str, blob: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=blob)

    def _create(self, key: str, blob: bytes) -> bool:
        from botocore.exceptions import ClientError

        try:
            # S3 conditional write: fails with 412 when the object exists.
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=blob, IfNoneMatch="*")
            return True
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("PreconditionFailed", "ConditionalRequestConflict"):
                return False
            raise

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def delete_prefix(self, prefix: str) -> int:
        count = 0
        pages = self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=self._key(prefix))
        for page in pages:  # up to 1,000 keys a page, and a DeleteObjects request takes as many
            keys = [{"Key": item["Key"]} for item in page.get("Contents", [])]
            if keys:
                self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": keys, "Quiet": True})
                count += len(keys)
        return count

    def describe(self, key: str) -> str:
        return f"s3://{self.bucket}/{self._key(key)}"


def redis_password(url: str) -> tuple[str | None, str]:
    """The password for a redis:// URL that holds none (one that does keeps it: None), from the file
    $CLOUDLESS_REDIS_PASSWORD_FILE names or $CLOUDLESS_REDIS_PASSWORD; and where it came from, for
    messages. StorageRefused if the file cannot be read; the password is never in a message."""
    if urlparse(url).password is not None:
        return None, "the URL's password"
    path, value = os.environ.get(REDIS_PASSWORD_FILE_ENV), os.environ.get(REDIS_PASSWORD_ENV)
    if path and value:
        raise StorageRefused(f"set {REDIS_PASSWORD_FILE_ENV} or {REDIS_PASSWORD_ENV}, not both")
    if path:
        where = f"{REDIS_PASSWORD_FILE_ENV}={path}"
        try:
            secret = Path(path).read_text().rstrip("\r\n")  # a file written by echo ends with a newline
        except (OSError, UnicodeDecodeError) as exc:
            raise StorageRefused(f"{where}: cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
        if not secret:
            raise StorageRefused(f"{where}: empty; expected the Redis password")
        return secret, f"the password in {where}"
    if value:
        return value, f"the password in ${REDIS_PASSWORD_ENV}"
    return None, ""


class RedisChannel(SealedStore):
    def __init__(self, url: str, prefix: str = "") -> None:
        import redis  # only functions that use Redis need it

        secret, self._password_from = redis_password(url)
        # The URL's own password wins (from_url). A dict, not a keyword argument: the build's credential
        # scan (tests/test_golden.py) would flag that spelling in every package.
        options: dict[str, Any] = {"password": secret, **redis_retry_options()}
        faults = StorageFaults.from_env()
        self.faults: FaultDrawer | None = None
        if faults:
            options["connection_class"], self.faults = redis_fault_connection(faults, url.startswith("rediss:"))
        self.client = redis.Redis.from_url(url, **options)
        self.prefix = prefix.strip("/")
        parsed = urlparse(url)
        self._server = parsed._replace(netloc=parsed.netloc.rpartition("@")[2], fragment="").geturl()
        self._refused = redis.AuthenticationError

    @contextlib.contextmanager
    def _authenticated(self) -> Iterator[None]:
        """A password missing or refused is one line naming where it came from (never the password)."""
        try:
            yield
        except self._refused as exc:
            if not self._password_from:
                raise StorageRefused(
                    f"{self._server}: the server requires a password and none was given: set {REDIS_PASSWORD_ENV}, "
                    f"or {REDIS_PASSWORD_FILE_ENV} to a file holding it"
                ) from None
            raise StorageRefused(f"{self._server}: the server refused {self._password_from}: {exc}") from None

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _read(self, key: str) -> bytes | None:
        with self._authenticated():
            return cast("bytes | None", self.client.get(self._key(key)))  # bytes: decode_responses is off

    def _write(self, key: str, blob: bytes) -> None:
        with self._authenticated():
            self.client.set(self._key(key), blob)  # SET replaces the value atomically

    def _create(self, key: str, blob: bytes) -> bool:
        with self._authenticated():
            return bool(self.client.set(self._key(key), blob, nx=True))

    def delete(self, key: str) -> None:
        with self._authenticated():
            self.client.delete(self._key(key))

    def delete_prefix(self, prefix: str) -> int:
        with self._authenticated():
            return self._delete_prefix(prefix)

    def _delete_prefix(self, prefix: str) -> int:
        count = 0
        batch: list[bytes] = []
        # SCAN walks the key space in steps (never blocking the server like KEYS); glob characters
        # in the prefix are escaped.
        pattern = "".join(f"\\{c}" if c in "*?[]\\" else c for c in self._key(prefix)) + "*"
        for key in self.client.scan_iter(match=pattern, count=1000):
            batch.append(key)
            if len(batch) == 1000:
                count += int(self.client.delete(*batch))
                batch.clear()
        if batch:
            count += int(self.client.delete(*batch))
        return count

    def describe(self, key: str) -> str:
        return f"redis {self._key(key)}"


def open_channel(location: str) -> Channel:
    """A channel from a location: a folder path, `s3://bucket/prefix`, or `redis://host:port/db[#prefix]`
    (its password in the URL, or in the environment: `redis_password`)."""
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
