"""Transient faults of a cloud's services: how every client of Cloudless retries them, and how a rehearsal
injects them.

A cloud answers some requests with an error that the same request, sent again a little later, does not
meet: S3's 503 SlowDown and 500s, a reset connection, Step Functions' and Lambda's throttling, a Redis
server restarting. Every client is built here with its SDK's own retry policy, sized to ride out a burst
of such errors of about 30 s (botocore's `standard` mode; redis-py's `Retry`): what outlasts it is a fault,
not a transient, and ends the run with one line.

Above the SDK, a function's and the controller's storage requests ride out what the SDK gave up on
(`ride_out`, within a time budget): the SDK's retries of one client share a quota (botocore's token
bucket: ~35 retries of 500s), which a burst of 30 s across a function's threads spends.

A retry must not change the outcome. S3 and Redis writes are idempotent, except the conditional create
behind `Channel.claim`: when its first try wrote and the answer was lost, the retry finds the key taken.
`SealedStore.claim` reads the key back then, and a claim's value is unique to its caller.

`CLOUDLESS_STORAGE_FAULTS` (set by `cloudless-run --inject-storage-faults`) makes a share of a process's
storage requests fail as a cloud's do, below the SDK's retries so that they are what meets them: S3 answers
503 SlowDown or 500, a connection is reset before the request is sent, or after it was served (the answer
lost: a write happened), or a GET's body is cut short; a Redis connection drops before a command or after it
ran.
"""

from __future__ import annotations

import io
import json
import os
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ...ir.protocol import STORAGE_FAULTS_ENV

_T = TypeVar("_T")

#: tries of one request to a cloud's API (the first and the retries), botocore's `standard` mode: its
#: pauses are jittered and double up to 20 s (from 1 s when throttled, 50 ms otherwise), so 16 tries wait
#: about a minute when throttled and ~30 s on 500s before the request fails
AWS_ATTEMPTS = 16
#: the same for Redis: pauses doubling from 20 ms up to 2 s, ~12 s in all (a server restarting); a
#: dropped connection is mended at once, so the first pause is short
REDIS_RETRIES = 12
REDIS_BACKOFF_S = (0.01, 2.0)

#: an iteration's keys (`protocol.iteration_prefix`), where a burst of faults begins
_ITERATION = re.compile(r"/it(\d+)/")

S3_FAULTS = ("slow-down", "internal-error", "reset-before", "answer-lost", "body-cut")
REDIS_FAULTS = ("drop-before", "answer-lost")


def aws_config(**options: Any) -> Any:
    """The botocore Config of every AWS client (storage, Step Functions, Lambda, CloudFormation):
    `standard` retries with AWS_ATTEMPTS tries; `options` add to it (timeouts)."""
    from botocore.config import Config

    return Config(retries={"mode": "standard", "max_attempts": AWS_ATTEMPTS}, **options)


def aws_client(service: str, **options: Any) -> Any:
    """A boto3 client of `service` with `aws_config()`; `options` are boto3.client's (region_name, ...)."""
    import boto3

    config = options.pop("config", None)
    merged = aws_config() if config is None else aws_config().merge(config)
    return boto3.client(service, config=merged, **options)


def redis_retry_options() -> dict[str, Any]:
    """redis.Redis's keyword arguments for retrying a dropped connection or a server that restarts; not a
    password refused (redis-py's AuthenticationError is a ConnectionError: no retry mends it)."""
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import AuthenticationError, BusyLoadingError, ConnectionError, TimeoutError
    from redis.retry import Retry

    class Transient(Retry):
        def call_with_retry(
            self,
            do: Callable[[], _T],
            fail: Callable[[Exception], Any] | Callable[[Exception, int], Any],
            is_retryable: Callable[[Exception], bool] | None = None,
            with_failure_count: bool = False,
        ) -> _T:
            def retryable(error: Exception) -> bool:
                return not isinstance(error, AuthenticationError) and (is_retryable is None or is_retryable(error))

            return super().call_with_retry(do, fail, retryable, with_failure_count)

    base, cap = REDIS_BACKOFF_S
    errors = (ConnectionError, TimeoutError, BusyLoadingError)  # BusyLoading: a restarted server loading
    return {"retry": Transient(ExponentialBackoff(cap=cap, base=base), REDIS_RETRIES, errors)}


#: how long the controller rides out a storage request's transient errors before the run ends
RIDE_OUT_S = 60.0

_THROTTLED = {
    "SlowDown",
    "Throttling",
    "ThrottlingException",
    "TooManyRequestsException",
    "RequestLimitExceeded",
    "RequestTimeout",
    "RequestTimeoutException",
    "PriorRequestNotComplete",
    "InternalError",
    "ServiceUnavailable",
}


def is_transient(exc: BaseException) -> bool:
    """Whether the same request, sent again a little later, may succeed: a 5xx or throttling answer, a
    connection refused, reset or timed out, an answer's body cut short (botocore's, redis-py's, the OS's)."""
    try:
        from botocore.exceptions import ClientError, HTTPClientError, IncompleteReadError, ResponseStreamingError
        from botocore.exceptions import ConnectionError as BotocoreConnectionError
    except ImportError:  # pragma: no cover - every image installs botocore
        botocore_errors: tuple[type[BaseException], ...] = ()
        client_error: type[BaseException] | None = None
    else:
        botocore_errors = (BotocoreConnectionError, HTTPClientError, IncompleteReadError, ResponseStreamingError)
        client_error = ClientError
    try:
        from redis.exceptions import BusyLoadingError
        from redis.exceptions import ConnectionError as RedisConnectionError
        from redis.exceptions import TimeoutError as RedisTimeout

        redis_errors: tuple[type[BaseException], ...] = (RedisConnectionError, RedisTimeout, BusyLoadingError)
    except ImportError:  # pragma: no cover
        redis_errors = ()
    if isinstance(exc, (*botocore_errors, *redis_errors, ConnectionError)):
        return True
    if client_error is not None and isinstance(exc, client_error):
        response = getattr(exc, "response", {}) or {}
        status = int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
        return status >= 500 or status == 429 or response.get("Error", {}).get("Code") in _THROTTLED
    return False


#: a credential refused as a rotated access key propagates (seconds), not a permission missing (AccessDenied)
_CREDENTIALS_REFUSED = {
    "UnrecognizedClientException",
    "InvalidAccessKeyId",  # S3's
    "InvalidSignatureException",
    "InvalidClientTokenId",
    "SignatureDoesNotMatch",
}


def is_transient_or_refused_credentials(exc: BaseException) -> bool:
    """`is_transient`, or AWS refusing the credentials themselves, which a driver rides out too: a key just
    rotated is refused for seconds while it propagates; a revoked one outlasts the ride-out."""
    response = getattr(exc, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    return is_transient(exc) or code in _CREDENTIALS_REFUSED


def ride_out(call: Callable[[], _T], budget_s: float, retryable: Callable[[BaseException], bool] = is_transient) -> _T:
    """`call()`, called again after a `retryable` error, with jittered pauses doubling from 0.1 s up to
    5 s, until `budget_s` is spent: then the last error is raised."""
    began, attempt = time.monotonic(), 0
    while True:
        try:
            return call()
        except Exception as exc:
            if not retryable(exc):
                raise
            pause = random.random() * min(0.1 * 2**attempt, 5.0)
            if time.monotonic() - began + pause > budget_s:
                raise
            time.sleep(pause)
            attempt += 1


@dataclass(frozen=True)
class StorageFaults:
    """Faults injected into a process's storage requests: `share` of them fail, each with a kind drawn
    from the back end's (`S3_FAULTS`, `REDIS_FAULTS`), until `until` (a Unix time; 0: for ever).

    A burst (`from_iteration` >= 0) begins in each process at its first request on a key of that iteration
    or a later one (training under way, as every process of a run reaches it within moments) and lasts
    `seconds` (0: to the end)."""

    share: float
    seed: int = 0
    until: float = 0.0
    kinds: tuple[str, ...] = ()  # a subset of the back end's kinds; empty: all of them
    from_iteration: int = -1
    seconds: float = 0.0

    def encode(self) -> str:
        fields = {"share": self.share, "seed": self.seed, "until": self.until, "kinds": list(self.kinds)}
        if self.from_iteration >= 0:
            fields.update(from_iteration=self.from_iteration, seconds=self.seconds)
        return json.dumps(fields)

    @classmethod
    def from_env(cls) -> StorageFaults | None:
        text = os.environ.get(STORAGE_FAULTS_ENV)
        if not text:
            return None
        try:
            fields = json.loads(text)
            faults = cls(
                float(fields["share"]),
                int(fields.get("seed", 0)),
                float(fields.get("until", 0)),
                tuple(str(k) for k in fields.get("kinds", ())),
                int(fields.get("from_iteration", -1)),
                float(fields.get("seconds", 0)),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f'${STORAGE_FAULTS_ENV}={text!r}: expected {{"share": 0..1, "seed": N}}: {exc}') from None
        unknown = set(faults.kinds) - set(S3_FAULTS) - set(REDIS_FAULTS)
        if not 0 <= faults.share <= 1 or unknown or faults.seconds < 0:
            raise ValueError(
                f"${STORAGE_FAULTS_ENV}={text!r}: share in [0, 1], kinds among {S3_FAULTS + REDIS_FAULTS}, seconds >= 0"
            )
        return faults

    def drawer(self, kinds: tuple[str, ...], per_process: bool = True) -> FaultDrawer:
        wanted = tuple(k for k in kinds if not self.kinds or k in self.kinds)
        return FaultDrawer(self, wanted, per_process)


class FaultDrawer:
    """One client's draws: which of its requests fail, and how (thread-safe); counts what it injected.
    Storage faults draw here, and so do the rehearsals' throttled requests (`Throttled`, the Lambda service)."""

    def __init__(self, faults: StorageFaults, kinds: tuple[str, ...], per_process: bool = True) -> None:
        self.faults, self.kinds = faults, kinds
        # Each process draws its own faults: the seed and the process, so that replicas differ; a drawer
        # that is the only one of its kind (a rehearsal's Lambda service) draws from the seed alone, the
        # same sequence in every run.
        self._random = random.Random(f"{faults.seed}/{os.getpid()}" if per_process else f"{faults.seed}")
        self._lock = threading.Lock()
        self.injected: dict[str, int] = {}
        self._burst_began: float | None = None

    def draw(self, where: str = "") -> str | None:
        """The kind of fault this request, on `where` (its key or URL), meets, or None."""
        if not self.kinds or (self.faults.until and time.time() > self.faults.until):
            return None
        if self.faults.from_iteration >= 0:
            if self._burst_began is None:
                if not any(int(n) >= self.faults.from_iteration for n in _ITERATION.findall(where)):
                    return None
                self._burst_began = time.monotonic()
            if self.faults.seconds and time.monotonic() - self._burst_began > self.faults.seconds:
                return None
        with self._lock:
            if self._random.random() >= self.faults.share:
                return None
            kind = self._random.choice(self.kinds)
            self.injected[kind] = self.injected.get(kind, 0) + 1
            return kind


# -- S3: a botocore `before-send` handler answers in S3's place, below the SDK's retries -------------------

_S3_ERRORS = {
    "slow-down": (503, "SlowDown", "Please reduce your request rate."),
    "internal-error": (500, "InternalError", "We encountered an internal error. Please try again."),
}


def inject_s3_faults(client: Any, faults: StorageFaults) -> FaultDrawer:
    """Make `client`'s requests meet `faults`: the request is answered here (an S3 error), or sent and its
    answer dropped or cut short, as the network and S3 do."""
    from botocore.awsrequest import AWSResponse
    from botocore.exceptions import ConnectionClosedError
    from botocore.httpsession import URLLib3Session

    drawer = faults.drawer(S3_FAULTS)
    session = URLLib3Session()  # the real request, for the faults that happen after S3 served it

    def before_send(request: Any, **_: Any) -> Any:
        kind = drawer.draw(request.url)
        if kind is None:
            return None
        if kind in _S3_ERRORS:
            status, code, message = _S3_ERRORS[kind]
            body = (
                f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
                "<RequestId>injected</RequestId></Error>"
            ).encode()
            return AWSResponse(request.url, status, {"Content-Type": "application/xml"}, _Raw(body))
        if kind == "reset-before":
            raise ConnectionClosedError(endpoint_url=request.url)
        served = session.send(request)
        if kind == "answer-lost" or request.method != "GET" or served.status_code != 200:
            raise ConnectionClosedError(endpoint_url=request.url)
        content = served.content  # body-cut: the headers promise every byte, half of them arrive
        return AWSResponse(request.url, served.status_code, dict(served.headers), _Raw(content[: len(content) // 2]))

    client.meta.events.register_first("before-send.s3", before_send)
    return drawer


class Throttled:
    """Fault injection for an AWS client of the JSON protocols (Step Functions, Lambda): `share` of its
    requests are answered as AWS throttles them (400 ThrottlingException), below botocore's retries."""

    def __init__(self, share: float, seed: int = 0) -> None:
        self.drawer = StorageFaults(share, seed).drawer(("throttled",))

    @property
    def count(self) -> int:
        return self.drawer.injected.get("throttled", 0)

    def attach(self, client: Any) -> Any:
        """`client`, its requests from now on meeting the throttling; returned for chaining."""
        from botocore.awsrequest import AWSResponse

        def before_send(request: Any, **_: Any) -> Any:
            if self.drawer.draw() is None:
                return None
            body = json.dumps({"__type": "ThrottlingException", "message": "Rate exceeded"}).encode()
            return AWSResponse(request.url, 400, {"Content-Type": "application/x-amz-json-1.0"}, _Raw(body))

        client.meta.events.register_first("before-send", before_send)
        return client


class _Raw(io.BytesIO):
    """A response body as botocore reads one (urllib3's `stream` besides `read`)."""

    def stream(self, amount: int = 1024, decode_content: bool = False) -> Any:
        while chunk := self.read(amount):
            yield chunk


_HANDSHAKE = {"HELLO", "AUTH", "SELECT", "CLIENT", "PING"}


def redis_fault_connection(faults: StorageFaults, secure: bool = False) -> tuple[type, FaultDrawer]:
    """A redis-py Connection class (TLS if `secure`) whose commands meet `faults`: the connection drops
    before a command is sent, or after it ran (its answer lost), as a restarting server or a network drop does."""
    from redis.connection import Connection, SSLConnection
    from redis.exceptions import ConnectionError

    drawer = faults.drawer(REDIS_FAULTS)

    class FaultyConnection(SSLConnection if secure else Connection):  # type: ignore[misc]
        _lost = False

        def send_command(self, *args: Any, **kwargs: Any) -> None:
            # The connection's own handshake (HELLO, AUTH, SELECT, CLIENT SETINFO) is left alone: a fault
            # there would fail every retry's connect too, many faults for one of the caller's commands.
            command = str(args[0]).upper()
            kind = drawer.draw(str(args[1]) if len(args) > 1 else "") if command not in _HANDSHAKE else None
            if kind == "drop-before":
                self.disconnect()
                raise ConnectionError("injected: connection dropped before the command")
            super().send_command(*args, **kwargs)
            self._lost = kind == "answer-lost"

        def read_response(self, *args: Any, **kwargs: Any) -> Any:
            answer = super().read_response(*args, **kwargs)
            if self._lost:
                self._lost = False
                self.disconnect()
                raise ConnectionError("injected: connection dropped after the command ran")
            return answer

    return FaultyConnection, drawer
