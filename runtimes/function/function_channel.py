"""A function's view of its region's storage: the keys it owns, waits that notice an abort, and transient
errors ridden out."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

from ...ir import protocol
from ...ir.protocol import AbortRecord
from ..storage.channels import Channel, RidingOut
from .failures import Abandoned, Aborted, StorageWriteFailed, one_line

_T = TypeVar("_T")


class FunctionChannel(Channel):
    """A function's view of storage. It notes the keys of iterations this function writes: it owns
    them and deletes them once nobody can need them (`protocol.sweep_before`); and a wait for a key
    looks at the region's abort record now and then, so that a function waiting for a neighbour
    that stopped gives up at once instead of after the key timeout. A request that meets a transient error
    (`transient.is_transient`) is tried again for up to the key timeout (`inner.ride_out_s`: no function
    waits longer for anything), above the SDK's own retries."""

    def __init__(self, inner: Channel) -> None:
        self.raw = inner  # one try per request: for what is best effort once storage failed
        self.inner = RidingOut(inner, protocol.DEFAULT_KEY_TIMEOUT_S)
        self.poll_s, self.max_poll_s = inner.poll_s, inner.max_poll_s
        self.namespace = ""
        self.attempt: int | None = None  # the invocation's (None: not under a driver of attempts)
        self.written: dict[int, set[str]] = {}
        self.write_failure: StorageWriteFailed | None = None  # the first write storage refused
        self._lock = threading.Lock()

    def _note(self, key: str) -> None:
        iteration = protocol.iteration_of(self.namespace, key)
        if iteration is not None:
            with self._lock:
                self.written.setdefault(iteration, set()).add(key)

    def try_get(self, key: str) -> bytes | None:
        return self.inner.try_get(key)

    def put(self, key: str, data: bytes) -> None:
        self._written(key, lambda: self.inner.put(key, data))
        self._note(key)

    def claim(self, key: str, data: bytes) -> bool:
        claimed = self._written(key, lambda: self.inner.claim(key, data))
        if claimed:
            self._note(key)
        return claimed

    def _written(self, key: str, write: Callable[[], _T]) -> _T:
        """`write()`; if storage refuses it, StorageWriteFailed naming the key and the error, and every
        later wait of this function ends with it (`check_abort`): what it failed to write, its
        neighbours wait for, and so would it, for what they can no longer compute."""
        if self.write_failure is not None:
            raise self.write_failure
        try:
            return write()
        except Exception as exc:
            failure = StorageWriteFailed(
                f"storage refused a write ({self.describe(key)}): {type(exc).__name__}: {one_line(str(exc))}"
            )
            with self._lock:
                self.write_failure = self.write_failure or failure
            raise failure from exc

    def delete(self, key: str) -> None:
        self.inner.delete(key)

    def delete_prefix(self, prefix: str) -> int:
        return self.inner.delete_prefix(prefix)

    def describe(self, key: str) -> str:
        return self.inner.describe(key)

    def get(
        self,
        key: str,
        timeout: float = 600.0,
        cancelled: threading.Event | None = None,
        abort: Callable[[], None] | None = None,
    ) -> bytes:
        return super().get(key, timeout, cancelled, abort or self.check_abort)

    def check_abort(self) -> None:
        """Raise Aborted if the region's run was aborted or a newer attempt of the range runs (this one was
        abandoned), StorageWriteFailed if a write of this function failed."""
        if self.write_failure is not None:
            raise self.write_failure
        data = self.inner.try_get(protocol.abort_key(self.namespace))
        if data is not None:
            raise Aborted(AbortRecord.decode(data))
        if self.attempt is not None and (newest := self.inner.try_get(protocol.attempt_key(self.namespace))):
            if int(newest) > self.attempt:
                message = f"attempt {self.attempt} was abandoned: attempt {int(newest)} of the range runs"
                raise Abandoned(AbortRecord("abandoned", message, 0, 0, ""))

    def owned_before(self, iteration: int) -> list[str]:
        """The keys this function wrote for iterations before `iteration`, forgotten here."""
        with self._lock:
            done = sorted(i for i in self.written if i < iteration)
            return sorted(key for i in done for key in self.written.pop(i))
