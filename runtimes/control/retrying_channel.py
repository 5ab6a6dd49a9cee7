"""The controller's view of storage: requests retried with back-off, one line when they all fail."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from ...ir.protocol import CorruptBlob
from ..storage.channels import Channel, KeyTimeout

_T = TypeVar("_T")


class StorageError(RuntimeError):
    """A storage request failed every retry: one line naming it and the error."""


class RetryingChannel(Channel):
    """The controller's view of storage: a request that fails (a dropped connection, a throttled
    request) is tried again with back-off, and after the last try the run ends with a
    StorageError, one line, instead of a back end's traceback. (Functions are retried whole.)"""

    def __init__(self, inner: Channel, tries: int = 4, first_wait_s: float = 0.5) -> None:
        self.inner, self.tries, self.first_wait_s = inner, tries, first_wait_s
        self.poll_s, self.max_poll_s = inner.poll_s, inner.max_poll_s

    def _retried(self, what: str, key: str, call: Callable[[], _T]) -> _T:
        wait = self.first_wait_s
        for attempt in range(self.tries):
            try:
                return call()
            except (CorruptBlob, KeyTimeout, ValueError):
                raise  # answers, not failures to answer
            except Exception as exc:
                if attempt + 1 == self.tries:
                    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                    raise StorageError(
                        f"storage failed ({what} {self.describe(key)}, {self.tries} tries): "
                        f"{type(exc).__name__}: {first}"
                    ) from exc
                time.sleep(wait)
                wait *= 2
        raise AssertionError("unreachable")

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
