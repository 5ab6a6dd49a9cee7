"""The controller's view of storage: transient errors ridden out, one line when they outlast it."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from ...ir.protocol import CorruptBlob
from ..storage.channels import RidingOut
from ..storage.transient import is_transient_or_refused_credentials

_T = TypeVar("_T")


class StorageError(RuntimeError):
    """A storage request failed: one line naming it and the error."""


class RetryingChannel(RidingOut):
    """The controller's view of storage: transient errors (a dropped connection, a throttled request, a
    5xx) ridden out for up to `ride_out_s`; what outlasts it, or is no transient, ends the run with a
    StorageError, one line, instead of a back end's traceback. The user's credentials refused for seconds
    (an access key just rotated, still propagating) are ridden out too; a revoked one outlasts it."""

    retryable = staticmethod(is_transient_or_refused_credentials)

    def _retried(self, what: str, key: str, call: Callable[[], _T]) -> _T:
        try:
            return super()._retried(what, key, call)
        except (CorruptBlob, ValueError):
            raise  # answers (a corrupt value, a refusal), not failures to answer
        except Exception as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise StorageError(f"storage failed ({what} {self.describe(key)}): {type(exc).__name__}: {first}") from exc
