"""How the controller calls a function: an `Invoker` starts an `Invocation` (one replica of one function
over a range of iterations) and returns a `Handle` to poll for its result.

Local processes (each invocation runs the package's own handler.py in a fresh Python process, the way
a cold function would), synchronous calls through the OpenFaaS gateway (each held open by a thread; the
reply is the result), and Lambda's asynchronous invoke, which reports completion through the marker
each worker writes to storage (`protocol.done_key`).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from ...ir import protocol
from ...ir.protocol import (
    EMULATE_ENV,
    PEERS_ENV,
    STORAGE_ENV,
    InvocationResult,
)
from ...ir.workflow import Function, Workflow
from ..storage.channels import Channel
from ..storage.emulation import Resources
from ..storage.transient import RIDE_OUT_S, aws_client


@dataclass
class Invocation:
    """One call of one replica of one function over a range of iterations."""

    function: Function
    replica: int
    event: protocol.Invocation
    attempt: int
    launched: float = 0.0
    log: Path | None = None

    @property
    def label(self) -> str:
        return f"{self.function.name} replica {self.replica} from iteration {self.event.start}"


class Handle(ABC):
    """An invocation under way."""

    @abstractmethod
    def poll(self) -> InvocationResult | None:
        """Its result once it ended; None while running. Raises InvocationFailed."""

    def kill(self) -> bool:
        """Stop it now (fault injection); False where the invoker cannot."""
        return False


class InvocationFailed(RuntimeError):
    pass


class FailedToStart(Handle):
    """An invocation that could not even be started: its first poll reports why."""

    def __init__(self, error: InvocationFailed) -> None:
        self.error = error

    def poll(self) -> InvocationResult | None:
        raise self.error


class Invoker(ABC):
    name = "invoker"
    can_kill = False

    @abstractmethod
    def start(self, invocation: Invocation) -> Handle: ...

    def take_down(self, region: str) -> None:  # noqa: B027 - a default that does nothing, not abstract
        """Fault injection (`--fail-region`): the region's functions stop answering. Here nothing more than
        killing its invocations, which the controller does."""


class RegionInvokers(Invoker):
    """Several regions deployed: each region's invocations through its own invoker (its gateway, its
    account's functions). `take_down`: a rehearsal's way to stop a region's functions answering."""

    def __init__(self, invokers: dict[str, Invoker], take_down: Callable[[str], None] | None = None) -> None:
        self.invokers, self._take_down = invokers, take_down
        first = next(iter(invokers.values()))
        self.name, self.can_kill = first.name, all(i.can_kill for i in invokers.values())

    def start(self, invocation: Invocation) -> Handle:
        region = Path(invocation.function.package).parts[1]  # regions/<region>/functions/<function>
        return self.invokers[region].start(invocation)

    def take_down(self, region: str) -> None:
        if self._take_down is not None:
            self._take_down(region)


# --- local processes -----------------------------------------------------------------------------


class _ProcessHandle(Handle):
    def __init__(self, process: subprocess.Popen[bytes], invocation: Invocation, output: Path, deadline: float):
        self.process, self.invocation, self.output, self.deadline = process, invocation, output, deadline
        self.killed = False

    def poll(self) -> InvocationResult | None:
        code = self.process.poll()
        if code is None:
            if time.monotonic() > self.deadline:  # the platform's timeout
                self.process.kill()
                self.process.wait()
                raise InvocationFailed(f"{self.invocation.label}: ran past the function timeout; killed")
            return None
        if code != 0:
            why = "killed (injected fault)" if self.killed else f"exit status {code}{_last_line(self.invocation.log)}"
            raise InvocationFailed(f"{self.invocation.label}: {why}; its log: {self.invocation.log}")
        lines = [line for line in self.output.read_text().splitlines() if line.strip()]
        try:
            return InvocationResult.from_json(json.loads(lines[-1]))
        except (IndexError, ValueError, KeyError, TypeError) as exc:
            why = f"{self.invocation.label}: no result in {self.output}; its log: {self.invocation.log}"
            raise InvocationFailed(why) from exc

    def kill(self) -> bool:
        if self.process.poll() is None:
            self.killed = True
            self.process.kill()
            self.process.wait()
            return True
        return False


def _die_with_parent() -> None:
    """In a function's process, before it runs: Linux kills it when the controller dies (even by
    SIGKILL), so that no function process outlives its run. Elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _last_line(log: Path | None) -> str:
    """': <the error>' from the end of a failed process's log (its exception's one line), or ''."""
    try:
        lines = [line.strip() for line in (log.read_text(errors="replace") if log else "").splitlines()]
    except OSError:
        return ""
    last = next((line for line in reversed(lines) if line), "")
    return f": {last[:300]}" if last else ""


class LocalProcessInvoker(Invoker):
    """Each invocation is `python <package>/handler.py EVENT` in a new process: the deployed code,
    cold. Its stderr goes to a log file; `threads` caps its torch threads (the machine is shared).
    `storage`: one location, or per region its own (several regions: a function gets its region's as
    STORAGE_ENV and the others' as PEERS_ENV)."""

    name = "local processes"
    can_kill = True

    def __init__(
        self,
        build: Path,
        storage: str | Mapping[str, str],
        logs: Path,
        *,
        resources: Callable[[Function], Resources | None] = lambda f: None,
        threads: int = 1,
    ) -> None:
        self.build, self.storage, self.logs = build, storage, logs
        self.resources, self.threads = resources, threads
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, invocation: Invocation) -> Handle:
        function = invocation.function
        region = Path(function.package).parts[1]  # regions/<region>/functions/<function>
        storage = self.storage if isinstance(self.storage, str) else self.storage[region]
        env = {
            **os.environ,
            STORAGE_ENV: storage,
            "OMP_NUM_THREADS": str(self.threads),
            "MKL_NUM_THREADS": str(self.threads),
            # The package is the user's build: no __pycache__ in it (a recompile would find a foreign file).
            "PYTHONDONTWRITEBYTECODE": "1",
        }
        env.pop(EMULATE_ENV, None)
        env.pop(PEERS_ENV, None)
        if not isinstance(self.storage, str):
            env[PEERS_ENV] = json.dumps({name: where for name, where in sorted(self.storage.items()) if name != region})
        resources = self.resources(function)
        if resources is not None:
            env[EMULATE_ENV] = json.dumps(resources.to_json())
        start, attempt = invocation.event.start, invocation.attempt
        stem = f"{region}-{function.name}-r{invocation.replica}-from{start}-a{attempt}"
        invocation.log = self.logs / f"{stem}.log"
        output = self.logs / f"{stem}.json"  # a file, not a pipe: a large result must not block the child
        with invocation.log.open("wb") as log, output.open("wb") as out:
            process = subprocess.Popen(
                [sys.executable, str(self.build / function.package / "handler.py"), _wire(invocation)],
                stdout=out,
                stderr=log,
                env=env,
                cwd=self.build / function.package,
                preexec_fn=_die_with_parent,
            )
        return _ProcessHandle(process, invocation, output, time.monotonic() + function.timeout_s)


# --- asynchronous remote invokers ----------------------------------------------------------------


class _MarkerHandle(Handle):
    """Done when the worker's completion marker appears in storage; failed past the timeout."""

    def __init__(self, channel: Channel, key: str, invocation: Invocation, deadline: float) -> None:
        self.channel, self.key, self.invocation, self.deadline = channel, key, invocation, deadline

    def poll(self) -> InvocationResult | None:
        data = self.channel.try_get(self.key)
        if data is not None:
            return InvocationResult.decode(data)
        if time.monotonic() > self.deadline:
            raise InvocationFailed(f"{self.invocation.label}: no completion marker {self.key} within its timeout")
        return None


def _wire(invocation: Invocation) -> str:
    """The invocation's payload as the functions receive it."""
    return json.dumps(invocation.event.to_json())


def _marker(channel: Channel, namespace: str, invocation: Invocation) -> _MarkerHandle:
    """Follow an asynchronous invocation through its completion marker (timeout + 60 s to appear)."""
    key = protocol.done_key(namespace, invocation.function.name, invocation.replica, invocation.event.start)
    return _MarkerHandle(channel, key, invocation, time.monotonic() + invocation.function.timeout_s + 60)


#: how long past a function's timeout (its stack's exec_timeout) the synchronous call may stay open: the
#: function's read/write timeouts exceed exec_timeout by 10 s (codegen.platforms.TIMEOUT_MARGIN_S)
SYNC_MARGIN_S = 15.0
#: back-off between tries of a request an instance refused as busy (429): first, growth, ceiling
BUSY_FIRST_WAIT_S, BUSY_BACKOFF, BUSY_MAX_WAIT_S = 0.05, 1.5, 2.0
#: a call that reached no function (refused, 502/503 before the worker claimed its range) is sent again
#: after these pauses (doubling), for up to transient.RIDE_OUT_S
RESEND_FIRST_WAIT_S, RESEND_MAX_WAIT_S = 0.2, 5.0


class _ThreadHandle(Handle):
    """An invocation held open by a thread of its own (a synchronous call): done when the thread is."""

    def __init__(
        self, invocation: Invocation, call: Callable[[], InvocationResult], kill: Callable[[], bool] | None = None
    ) -> None:
        self.invocation = invocation
        self.result: InvocationResult | None = None
        self.error: InvocationFailed | None = None
        self._call, self._kill = call, kill
        self.thread = threading.Thread(target=self._run, name=invocation.label, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result = self._call()
        except InvocationFailed as exc:
            self.error = exc
        except Exception as exc:  # noqa: BLE001 - anything else is a failed invocation too (retried)
            self.error = InvocationFailed(f"{self.invocation.label}: {type(exc).__name__}: {exc}")

    def poll(self) -> InvocationResult | None:
        if self.thread.is_alive():
            return None
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result

    def kill(self) -> bool:
        return self._kill() if self._kill is not None and self.thread.is_alive() else False


#: where `faas-cli` finds a gateway by default (and so the OpenFaaS invoker)
DEFAULT_GATEWAY = "http://127.0.0.1:8080"


def gateway_urls(workflow: Workflow, given: list[str]) -> dict[str, str]:
    """Each region's OpenFaaS gateway: `--gateway URL` (one region; default http://127.0.0.1:8080),
    `--gateway REGION=URL` (several, each named). ValueError for a bad or missing value."""
    regions = [r.name for r in workflow.regions]
    urls: dict[str, str] = {regions[0]: DEFAULT_GATEWAY} if len(regions) == 1 else {}
    for value in given:
        region, equals, url = value.partition("=")
        if not equals or "/" in region or ":" in region:
            if len(regions) > 1:
                raise ValueError(f"--gateway {value}: several regions ({', '.join(regions)}): give REGION=URL")
            region, url = regions[0], value
        if region not in regions:
            raise ValueError(f"--gateway {value}: no region {region!r} in the workflow ({', '.join(regions)})")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"--gateway {value}: expected an http(s) URL")
        urls[region] = url
    missing = [name for name in regions if name not in urls]
    if missing:
        raise ValueError(f"--gateway: no gateway for {', '.join(missing)}; give --gateway REGION=URL for each region")
    return urls


def openfaas_token(token_file: Path | None) -> str:
    """The token the OpenFaaS functions require (the value of their secret cloudless-token): the file's
    content, else $CLOUDLESS_TOKEN. ValueError says where it was looked for, never what it holds."""
    if token_file is not None:
        where = f"--token-file {token_file}"
        try:
            token = token_file.read_text().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise ValueError(f"{where}: cannot be read: {getattr(exc, 'strerror', None) or exc}") from None
    else:
        where, token = f"${protocol.TOKEN_ENV}", os.environ.get(protocol.TOKEN_ENV, "").strip()
        if not token:
            raise ValueError(
                f"--invoker openfaas: the functions run only requests carrying their token (the OpenFaaS secret "
                f"{protocol.TOKEN_SECRET}): give --token-file FILE or set {protocol.TOKEN_ENV}"
            )
    if not token:
        raise ValueError(f"{where}: empty; expected the value of the OpenFaaS secret {protocol.TOKEN_SECRET}")
    if not (token.isascii() and token.isprintable()) or any(c.isspace() for c in token):
        # It travels in an HTTP header: printable ASCII only, and one word.
        raise ValueError(f"{where}: expected one word of printable ASCII (e.g. openssl rand -hex 32)")
    return token


class OpenFaaSInvoker(Invoker):
    """Synchronous calls through the gateway: POST /function/<name>, each held open by a thread of its own
    until the function answers with its result (the body: an InvocationResult as JSON).

    Why not /async-function: OpenFaaS CE's queue-worker delivers asynchronous calls one at a time
    (max_inflight 1), so a pipeline's first worker would wait on partners queued behind it. A synchronous
    call runs at once, for as long as the gateway's upstream timeout lets it (set it to at least the
    stack's exec_timeout, docs/deploying.md).

    One invocation per instance: the stack sets the watchdog's `max_inflight: "1"`, so an instance busy with
    another call answers 429 and the provider may route to a busy instance (it picks one at random); the
    gateway does not retry a 429 on the synchronous route, this invoker does (with back-off, until the
    function's timeout), so each of a function's replicas ends up with exactly one of its invocations.

    Every call carries the functions' token (the value of their secret cloudless-token) in the
    X-Cloudless-Token header: without it a function refuses the request (401). The token is never printed.
    Should the call end without an answer (the gateway refused the connection or restarted, the instance
    died: 502, 503, a cut connection), the worker's completion marker in storage is the answer if it is
    there; else, if the worker never claimed the attempt's range (`protocol.claim_key`), the call never
    reached a function and is sent again, with back-off, for up to `transient.RIDE_OUT_S` (a gateway
    restarting, an instance Kubernetes is starting again); a claimed range that died needs a new attempt,
    so the invocation fails and the controller retries it.

    `kill`: a rehearsal's way to kill the instance running an invocation (`--inject-faults`: OOMKilled, and
    started again as Kubernetes would); none kills nothing (a real gateway cannot be asked to)."""

    name = "OpenFaaS"

    def __init__(
        self,
        gateway: str,
        channel: Channel,
        namespace: str,
        names: dict[str, str] | None = None,
        *,
        token: str | None = None,
        kill: Callable[[Invocation], bool] | None = None,
    ) -> None:
        self.gateway, self.channel, self.namespace = gateway.rstrip("/"), channel, namespace
        self.names = names or {}
        self._token = token
        self._kill = kill
        self.can_kill = kill is not None
        self.busy = 0  # 429s met (instances busy with another call), for the run's record
        self.resent = 0  # calls sent again because they never reached a function

    def __repr__(self) -> str:
        return f"OpenFaaSInvoker({self.gateway!r}, token={'***' if self._token else None})"

    def start(self, invocation: Invocation) -> Handle:
        kill = None if self._kill is None else partial(self._kill, invocation)
        return _ThreadHandle(invocation, lambda: self._call(invocation), kill)

    def _call(self, invocation: Invocation) -> InvocationResult:
        name = self.names.get(invocation.function.name, invocation.function.name)
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers[protocol.TOKEN_HEADER] = self._token
        body = _wire(invocation).encode()
        timeout = invocation.function.timeout_s + SYNC_MARGIN_S
        deadline = time.monotonic() + invocation.function.timeout_s
        wait = BUSY_FIRST_WAIT_S
        unanswered: float | None = None  # when the first call that reached no function failed
        resend = RESEND_FIRST_WAIT_S
        while True:
            request = urllib.request.Request(
                f"{self.gateway}/function/{name}", data=body, headers=headers, method="POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=timeout) as response:
                    reply = response.read()
                break
            except urllib.error.HTTPError as exc:
                text = _reply_text(exc)
                if exc.code == 429 and time.monotonic() + wait < deadline:
                    self.busy += 1  # an instance busy with another call: try again (maybe another instance)
                    time.sleep(wait * (0.5 + random.random()))
                    wait = min(wait * BUSY_BACKOFF, BUSY_MAX_WAIT_S)
                    continue
                if exc.code not in (502, 503, 504):
                    raise InvocationFailed(f"{invocation.label}: {name} answered {exc.code}: {text}") from None
                failure = f"{invocation.label}: {name} answered {exc.code}: {text}"
            except (urllib.error.URLError, OSError) as exc:  # refused, reset, timed out
                failure = f"{invocation.label}: {self.gateway}: {exc}"
            # No answer: the gateway gave up waiting, restarted or was not there, or the instance died.
            marker = self._marker(invocation)
            if marker is not None:
                return marker  # the function finished
            now = time.monotonic()
            unanswered = now if unanswered is None else unanswered
            if self._claimed(invocation) or now - unanswered + resend > RIDE_OUT_S:
                raise InvocationFailed(failure)
            self.resent += 1  # it reached no function: the same attempt again, a little later
            time.sleep(resend * (0.5 + random.random()))
            resend = min(resend * 2, RESEND_MAX_WAIT_S)
        try:
            return InvocationResult.from_json(json.loads(reply))
        except (ValueError, KeyError, TypeError) as exc:
            why = f"{invocation.label}: {name} answered 200 without a result: {reply[:200]!r}"
            raise InvocationFailed(why) from exc

    def _claimed(self, invocation: Invocation) -> bool:
        """Whether a worker began the invocation's range in its attempt (then a call of the same attempt
        would only wait for it: a new attempt must run the range). Unknown is claimed."""
        key = protocol.claim_key(
            self.namespace, invocation.function.name, invocation.replica, invocation.event.start, invocation.attempt
        )
        try:
            return self.channel.exists(key)
        except Exception:  # noqa: BLE001 - storage does not say: the controller's retry decides
            return True

    def _marker(self, invocation: Invocation) -> InvocationResult | None:
        try:
            data = self.channel.try_get(
                protocol.done_key(self.namespace, invocation.function.name, invocation.replica, invocation.event.start)
            )
        except Exception:  # noqa: BLE001 - no answer either way: the invocation failed
            return None
        return InvocationResult.decode(data) if data is not None else None


def _reply_text(error: urllib.error.HTTPError) -> str:
    """An error reply's message (the handler's {"error": ...}, else its first 300 characters)."""
    try:
        text = error.read().decode(errors="replace")
    except OSError:
        return error.reason or ""
    try:
        return str(json.loads(text)["error"])
    except (ValueError, KeyError, TypeError):
        return text.strip()[:300] or str(error.reason)


class LambdaInvoker(Invoker):
    """Lambda's asynchronous invoke (InvocationType Event: 202, queued) through boto3."""

    name = "AWS Lambda"

    def __init__(self, channel: Channel, namespace: str, names: dict[str, str] | None = None, client: Any = None):
        self.client = client or aws_client("lambda")
        self.channel, self.namespace, self.names = channel, namespace, names or {}

    def start(self, invocation: Invocation) -> Handle:
        name = self.names.get(invocation.function.name, invocation.function.name)
        try:
            reply = self.client.invoke(FunctionName=name, InvocationType="Event", Payload=_wire(invocation))
        except Exception as exc:
            raise InvocationFailed(f"{invocation.label}: Lambda {name}: {exc}") from exc
        if reply.get("StatusCode") != 202:
            raise InvocationFailed(f"{invocation.label}: Lambda answered {reply.get('StatusCode')}, expected 202")
        return _marker(self.channel, self.namespace, invocation)
