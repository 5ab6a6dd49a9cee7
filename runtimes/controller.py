"""The control plane: walks workflow.yaml, invokes every function replica through an invoker, waits on
their completion, retries failed invocations, and follows progress through storage.

One region's iteration loop is the workflow's steps: each stage's `compute`, its `scatter-reduce`
among replicas, the `optimizer-step` (after tied-parameter partners), with several regions the
periodic inter-region sync, and the periodic `checkpoint`. The steps describe what the stage workers
run themselves, in that order, for a range of iterations per invocation, meeting
through storage; the controller invokes every replica of every function at once with the same
range. A worker ends early at its time limit, at an iteration all of them agree on, and the
controller invokes the rest of the range again from there. A failed or killed invocation is
retried (a new attempt) and resumes from its stage's last checkpoint; it recomputes the same bytes,
so the run ends with the same parameters as one without failures.

Invokers: local processes (each invocation runs the package's own handler.py in a fresh Python
process, the way a cold function would), synchronous calls through the OpenFaaS gateway (each held
open by a thread; the reply is the result), and Lambda's asynchronous invoke, which reports completion
through the marker each worker writes to storage (`protocol.done_key`); progress is the last stage's
reports (`protocol.metrics_key`).
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from cloudless.ir import protocol
from cloudless.ir.protocol import (
    EMULATE_ENV,
    PEERS_ENV,
    STORAGE_ENV,
    AbortRecord,
    CorruptBlob,
    InvocationResult,
    MetricsReport,
)
from cloudless.ir.schedule import local_micro_batches
from cloudless.ir.workflow import STEP_KINDS, Function, Region, Workflow, round_meets

from .elastic import CapacityChange, RegionFailure, check_regions, fit_replicas, share_iterations, slowdown
from .emulation import Resources
from .storage import Channel, KeyTimeout

#: step kinds the stage workers run inside their invocations
# Every step runs inside the functions (the sync steps too): the controller invokes ranges of iterations.
FUNCTION_STEPS = frozenset(STEP_KINDS)
#: a re-plan asks a region's range to stop at a meet at least this many iterations past its reported
#: progress (its leading function stops it there or, when already past, 2 iterations on)
CUT_LEAD = 3


class RunError(RuntimeError):
    """The run cannot go on (an invocation failed more often than allowed, or bad settings)."""


class RunDiverged(RunError):
    """A loss or a parameter stopped being finite; the message names the iteration and the stage."""


class RegionGone(RunError):
    """Several regions: this region leaves the run (its invocations failed beyond their retries, the
    others went on without it, it stopped answering, or its capacity no longer holds its pipeline);
    the others go on. `tell`: the coordinator writes its departure (`protocol.left_key`) so that no
    meet waits for it."""

    def __init__(self, message: str, tell: bool) -> None:
        super().__init__(message)
        self.tell = tell


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


class _Failed(Handle):
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


class _ThreadHandle(Handle):
    """An invocation held open by a thread of its own (a synchronous call): done when the thread is."""

    def __init__(self, invocation: Invocation, call: Callable[[], InvocationResult]) -> None:
        self.invocation = invocation
        self.result: InvocationResult | None = None
        self.error: InvocationFailed | None = None
        self._call = call
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


class OpenFaaSInvoker(Invoker):
    """Synchronous calls through the gateway: POST /function/<name>, each held open by a thread of its own
    until the function answers with its result (the body: an InvocationResult as JSON).

    Why not /async-function: OpenFaaS CE's queue-worker delivers asynchronous calls one at a time
    (max_inflight 1), so a pipeline's first worker would wait on partners queued behind it. A synchronous
    call runs at once, for as long as the gateway's upstream timeout lets it (set it to at least the
    stack's exec_timeout, README "Deploying").

    One invocation per instance: the stack sets the watchdog's `max_inflight: "1"`, so an instance busy with
    another call answers 429 and the provider may route to a busy instance (it picks one at random); the
    gateway does not retry a 429 on the synchronous route, this invoker does (with back-off, until the
    function's timeout), so each of a function's replicas ends up with exactly one of its invocations.

    Every call carries the functions' token (the value of their secret cloudless-token) in the
    X-Cloudless-Token header: without it a function refuses the request (401). The token is never printed.
    Should the connection end without an answer (a gateway timeout), the worker's completion marker in
    storage is the answer if it is there."""

    name = "OpenFaaS"

    def __init__(
        self,
        gateway: str,
        channel: Channel,
        namespace: str,
        names: dict[str, str] | None = None,
        *,
        token: str | None = None,
    ) -> None:
        self.gateway, self.channel, self.namespace = gateway.rstrip("/"), channel, namespace
        self.names = names or {}
        self._token = token
        self.busy = 0  # 429s met (instances busy with another call), for the run's record

    def __repr__(self) -> str:
        return f"OpenFaaSInvoker({self.gateway!r}, token={'***' if self._token else None})"

    def start(self, invocation: Invocation) -> Handle:
        return _ThreadHandle(invocation, lambda: self._call(invocation))

    def _call(self, invocation: Invocation) -> InvocationResult:
        name = self.names.get(invocation.function.name, invocation.function.name)
        headers = {"Content-Type": "application/json"}
        if self._token:
            headers[protocol.TOKEN_HEADER] = self._token
        body = _wire(invocation).encode()
        timeout = invocation.function.timeout_s + SYNC_MARGIN_S
        deadline = time.monotonic() + invocation.function.timeout_s
        wait = BUSY_FIRST_WAIT_S
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
                if exc.code in (502, 503, 504):  # the gateway gave up waiting: the function may have finished
                    marker = self._marker(invocation)
                    if marker is not None:
                        return marker
                raise InvocationFailed(f"{invocation.label}: {name} answered {exc.code}: {text}") from None
            except (urllib.error.URLError, OSError) as exc:  # refused, reset, timed out
                marker = self._marker(invocation)
                if marker is not None:
                    return marker
                raise InvocationFailed(f"{invocation.label}: {self.gateway}: {exc}") from exc
        try:
            return InvocationResult.from_json(json.loads(reply))
        except (ValueError, KeyError, TypeError) as exc:
            why = f"{invocation.label}: {name} answered 200 without a result: {reply[:200]!r}"
            raise InvocationFailed(why) from exc

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
        import boto3  # only this invoker needs it

        self.client = client or boto3.client("lambda")
        self.channel, self.namespace, self.names = channel, namespace, names or {}

    def start(self, invocation: Invocation) -> Handle:
        name = self.names.get(invocation.function.name, invocation.function.name)
        try:
            reply = self.client.invoke(FunctionName=name, InvocationType="Event", Payload=_wire(invocation))
        except Exception as exc:  # noqa: BLE001 - botocore's errors (throttling, network) are retried
            raise InvocationFailed(f"{invocation.label}: Lambda {name}: {exc}") from exc
        if reply.get("StatusCode") != 202:
            raise InvocationFailed(f"{invocation.label}: Lambda answered {reply.get('StatusCode')}, expected 202")
        return _marker(self.channel, self.namespace, invocation)


# --- the controller's storage ---------------------------------------------------------------------

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
            except Exception as exc:  # noqa: BLE001 - any back end's error
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


# --- the controller ------------------------------------------------------------------------------


@dataclass
class Progress:
    """One finished iteration as the last stage reported it."""

    iteration: int
    loss: float
    time: float
    region: str = ""


@dataclass
class RunSettings:
    iterations: int
    run_id: str
    time_limit_s: float | None = None  # a worker's time limit per invocation (default: its timeout)
    key_timeout_s: float = protocol.DEFAULT_KEY_TIMEOUT_S
    retries: int = 3
    fault_rate: float = 0.0
    fault_seed: int = 0
    poll_s: float = 0.05
    resume: bool = False  # continue run_id from its stages' newest common checkpoint
    alive_check_s: float = 2.0  # how often the controller checks that storage still holds the run
    # several regions: how long a meet waits for a region before going on without it
    region_timeout_s: float = protocol.DEFAULT_REGION_TIMEOUT_S
    capacity_changes: tuple[CapacityChange, ...] = ()
    region_failures: tuple[RegionFailure, ...] = ()  # injected: a region stops answering


@dataclass
class RegionPlan:
    """The coordinator's plan of one region: it trains until iteration `end`; since iteration `since`
    its iterations hold rounds `first_round`.. (`workflow.round_meets`); its replicas per stage and
    weight (share of the samples; None: the workflow's). `next`: a re-plan taking effect where its
    range under way stops (at the coordinator's stop request, or earlier at a time limit). `left`: why
    it left ("" while it trains)."""

    end: int
    replicas: tuple[int, ...]
    weight: float | None = None
    since: int = 0
    first_round: int = 0
    next: RegionPlan | None = None
    left: str = ""
    met: tuple[int, ...] = ()  # the meets of its earlier plans (up to `since`)


@dataclass
class RegionRun:
    """What happened: progress per iteration, every invocation's result, the faults injected."""

    progress: list[Progress] = field(default_factory=list)
    results: list[InvocationResult] = field(default_factory=list)
    invocations: list[dict[str, Any]] = field(default_factory=list)
    faults: int = 0
    retries: int = 0
    lost_reports: int = 0


class Controller:
    def __init__(
        self,
        workflow: Workflow,
        channel: Channel,
        invoker: Invoker,
        settings: RunSettings,
        on_progress: Callable[[Progress], None] = lambda p: None,
        channels: Mapping[str, Channel] | None = None,
    ) -> None:
        """`channel`: the storage of every region that `channels` (region name -> its own storage,
        several regions) does not name. A region's markers, progress and abort record are in its own."""
        self.workflow, self.channel, self.invoker, self.settings = workflow, channel, invoker, settings
        self.channels: dict[str, Channel] = dict(channels or {})
        self.on_progress = on_progress
        if settings.fault_rate and not invoker.can_kill:
            raise RunError(f"--inject-faults needs an invoker that can kill invocations; {invoker.name} cannot")
        unknown = sorted({s.kind for s in workflow.steps} - FUNCTION_STEPS)
        if unknown:
            raise RunError(f"workflow.yaml: step kinds {unknown} are not run by this controller yet")
        # One fault generator per region (regions run in threads), so each region's faults replay
        # however the threads interleave; the first region's are those of a one-region run.
        self.records: dict[str, RegionRun] = {}  # what `run` did so far (also when it raised)
        self.cancelled = threading.Event()
        self.random = {
            region.name: random.Random(settings.fault_seed + index) for index, region in enumerate(workflow.regions)
        }
        try:
            check_regions([r.name for r in workflow.regions], settings.capacity_changes, settings.region_failures)
        except ValueError as exc:
            raise RunError(str(exc)) from None
        # The coordinator: every region's plan, re-planned as capacity changes and regions leave.
        self.lock = threading.RLock()
        self.plans = {
            region.name: RegionPlan(self.region_iterations(region), tuple(f.replicas for f in region.functions))
            for region in workflow.regions
        }
        self.ranges: dict[str, tuple[int, int]] = {}  # the range under way per region
        self.ends: dict[str, int] = {}  # where each region's run ended
        self.events: list[dict[str, Any]] = []  # what the coordinator did, in order (metrics.json)

    def namespace(self, region: str) -> str:
        return protocol.namespace(self.settings.run_id, region)

    def storage(self, region: str) -> Channel:
        """The storage of `region` (its keys, markers, progress and abort record)."""
        return self.channels.get(region, self.channel)

    def _scale(self) -> float:
        """settings.iterations / the workflow's: how --iterations scales a plan of several regions."""
        return self.settings.iterations / self.workflow.run.iterations

    def region_iterations(self, region: Region) -> int:
        """Iterations a region runs. One region: the settings'. Several: the plan's, `region.iterations`
        (plan = run); when settings.iterations differs from the workflow's run.iterations, every
        region's planned iterations scaled by their ratio (rounded, at least 1)."""
        if len(self.workflow.regions) == 1:
            return self.settings.iterations
        planned = region.iterations if region.iterations is not None else self.workflow.run.iterations
        if self.settings.iterations == self.workflow.run.iterations:
            return planned
        return max(1, round(planned * self._scale()))

    def rounds(self) -> int | None:
        """Several regions: the inter-region rounds of this run (the same in every region): the plan's
        sync.rounds, scaled like the iterations and at most the fewest iterations of a region; under
        `sync` every iteration is a round. None for one region."""
        if len(self.workflow.regions) == 1 or self.workflow.sync.inter_region is None:
            return None
        fewest = min(self.region_iterations(r) for r in self.workflow.regions)
        if self.workflow.sync.inter_region == "sync":
            return fewest
        planned = self.workflow.sync.rounds or fewest
        if self.settings.iterations != self.workflow.run.iterations:
            planned = max(1, round(planned * self._scale()))
        return min(planned, fewest)

    def round_ends(self, name: str) -> tuple[int, ...]:
        """After how many iterations each of the region's rounds ended in this run (several regions),
        under each plan the coordinator gave it."""
        return (*self.plans[name].met, *sorted(self.meets(name)))

    def asgd_pushes(self) -> list[protocol.PushRecord]:
        """ASGD-GA: every push of the run, per stage in version order, as the server's storage holds
        them (read before the clean-up). Empty for the other strategies."""
        server = self.workflow.sync.server
        if self.workflow.sync.inter_region != "asgd-ga" or server is None or len(self.workflow.regions) == 1:
            return []
        channel, namespace = self.storage(server), self.namespace(server)
        pushes = []
        for stage in range(self.workflow.regions[0].stages):
            version = 1
            while (data := channel.try_get(protocol.global_key(namespace, stage, version, "push"))) is not None:
                pushes.append(protocol.PushRecord.decode(data))
                version += 1
        return pushes

    def round_members(self) -> list[dict[str, Any]]:
        """Model averaging: what every region's every stage averaged at each of its rounds (read
        before the clean-up): [{region, stage, round, members: {region: weight}}]."""
        if self.workflow.sync.inter_region != "model-average" or len(self.workflow.regions) == 1:
            return []
        rows = []
        for region in self.workflow.regions:
            channel, namespace = self.storage(region.name), self.namespace(region.name)
            for stage in range(region.stages):
                for k in range(self.rounds() or 0):
                    key = protocol.round_key(namespace, "model-average", stage, k, "members")
                    data = channel.try_get(key)
                    if data is not None:
                        rows.append({"region": region.name, "stage": stage, "round": k, "members": json.loads(data)})
        return rows

    def run(self) -> dict[str, RegionRun]:
        """Every region's range at once (each its own invocations); what happened, per region."""
        records = self.records = {region.name: RegionRun() for region in self.workflow.regions}
        errors: list[BaseException] = []

        def run_region(region: Region) -> None:
            at = 0
            try:
                at = self.start_of(region)
                if at:
                    # What stopped the run must not stop the resumed one; the interrupted range's
                    # markers would make its invocations look done or duplicated.
                    self.storage(region.name).delete(protocol.abort_key(self.namespace(region.name)))
                    self._forget_range(
                        region,
                        at,
                        {(f.name, r): self.settings.retries for f in region.functions for r in range(f.replicas)},
                    )
                alive = protocol.alive_key(self.namespace(region.name))
                self.storage(region.name).put(alive, self.settings.run_id.encode())
                while (stop := self._next_stop(region.name, at)) is not None:
                    at = self._invoke_range(region, at, stop, records[region.name])
                    with self.lock:
                        self.ranges.pop(region.name, None)
                        self._range_ended(region, at)
            except RegionGone as exc:
                self._leave(region.name, str(exc), tell=exc.tell)
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(exc)
            finally:
                progress = records[region.name].progress  # a region that left mid-range: as far as it got
                self.ends[region.name] = max(at, progress[-1].iteration + 1 if progress else 0)

        threads = [threading.Thread(target=run_region, args=(r,)) for r in self.workflow.regions]
        for thread in threads:
            thread.start()
        try:
            for thread in threads:
                while thread.is_alive():
                    thread.join(0.2)  # in steps: Ctrl-C reaches this thread between them
        except KeyboardInterrupt:
            self.cancelled.set()  # each region kills its invocations and stops
            for thread in threads:
                thread.join()
            raise
        if errors:
            raise errors[0]
        if all(plan.left for plan in self.plans.values()):
            raise RunError("every region left the run: " + "; ".join(p.left for p in self.plans.values()))
        return records

    # -- the coordinator ---------------------------------------------------------------------------
    def _next_stop(self, name: str, at: int) -> int | None:
        """Where the region's next range stops (its end, or its next capacity change), None when it is
        done or has left; notes the range as under way."""
        with self.lock:
            plan = self.plans[name]
            if plan.left or at >= plan.end:
                return None
            stop = min(
                [plan.end]
                + [c.iteration for c in self.settings.capacity_changes if c.region == name and at < c.iteration]
            )
            self.ranges[name] = (at, stop)
            return stop

    def meets(self, name: str) -> dict[int, int]:
        """The region's meet points under its plan now: iterations done -> the round ending there
        (every iteration under `sync`; none for one region)."""
        plan, rounds = self.plans[name], self.rounds()
        if rounds is None:
            return {}
        if self.workflow.sync.inter_region == "sync":
            return {i + 1: i for i in range(plan.end)}
        return round_meets(plan.end, rounds, since=plan.since, first_round=plan.first_round)

    def _rounds_done(self, name: str, at: int) -> int:
        """How many of its rounds the region has met after `at` iterations (its plan now)."""
        plan, rounds = self.plans[name], self.rounds() or 0
        if self.workflow.sync.inter_region == "sync":
            return min(at, rounds)
        return plan.first_round + sum(1 for end in self.meets(name) if plan.since < end <= at)

    def _range_ended(self, region: Region, at: int) -> None:
        """The region's range stopped at `at`: adopt a re-plan waiting for it, then apply the capacity
        changes due there (re-planning every region)."""
        name = region.name
        plan = self.plans[name]
        if plan.next is not None:
            self._adopt(name, plan.next, at)
        for change in self.settings.capacity_changes:
            if change.region != name or change.iteration != at or at >= self.plans[name].end:
                continue
            plan = self.plans[name]
            planned = tuple(f.replicas for f in region.functions)
            fitted = fit_replicas(planned, change.functions)
            self._note("capacity", name, at, functions=change.functions, replicas=list(fitted or ()))
            if fitted is None:
                raise RegionGone(
                    f"{name}: capacity {change.functions} function(s) from iteration {at} cannot hold its "
                    f"{len(planned)} stage(s)",
                    tell=True,
                )
            factor = slowdown(self.workflow.run.micro_batches, plan.replicas, fitted)
            plan.replicas = fitted
            self._replan(name, at, factor)

    def _adopt(self, name: str, new: RegionPlan, at: int) -> None:
        """Region `name`'s range stopped at `at`: its plan from there is `new` (its end at least one
        iteration per round left; no iterations where no round is left, as nothing would apply them)."""
        rounds = self.rounds()
        done = self._rounds_done(name, at)
        plan = self.plans[name]
        plan.replicas, plan.weight, plan.next = new.replicas, new.weight, None
        if rounds is None or self.workflow.sync.inter_region == "sync":
            return
        left = rounds - done
        if left:
            plan.met += tuple(end for end in sorted(self.meets(name)) if end <= at)
            plan.end, plan.since, plan.first_round = max(new.end, at + left), at, done
        else:
            plan.end = at

    def _seconds_per_iteration(self, name: str) -> float:
        """The region's pace: the median of its last iterations' times (meets included only as the
        median lets them), else the median over all regions, else 1."""
        times = [p.time for p in self.records.get(name, RegionRun()).progress[-21:]]
        steps = [b - a for a, b in zip(times[:-1], times[1:], strict=True) if b >= a]
        if steps:
            return max(statistics.median(steps), 1e-6)
        others = [self._seconds_per_iteration(n) for n in self.plans if n != name and self.records.get(n)]
        return (
            statistics.median(others)
            if others and any(self.records[n].progress for n in self.plans if n != name)
            else 1.0
        )

    def _cut(self, name: str) -> int | None:
        """Ask the region's range under way to stop at a meet a few iterations past its reported progress
        (`protocol.CUT_REQUEST`; its leading function decides where, at that meet or later); the
        iteration asked for, the time limit's decision if one came first, or None where no meet is left
        before the range's end (or no range is under way)."""
        if name not in self.ranges:
            return None
        start, stop = self.ranges[name]
        progress = self.records[name].progress
        reached = progress[-1].iteration + 1 if progress else start
        candidates = [m for m in sorted(self.meets(name)) if reached + CUT_LEAD <= m < stop]
        if not candidates:
            return None
        key = protocol.stop_key(self.namespace(name), start)
        channel = self.storage(name)
        if channel.claim(key, protocol.CUT_REQUEST + str(candidates[0]).encode()):
            return candidates[0]
        decided = channel.try_get(key)
        if decided is None:
            return None
        requested = protocol.cut_request(decided)  # an earlier re-plan's request: this one takes its place
        return requested if requested is not None else (int(decided) if int(decided) < stop else None)

    def _replan(self, trigger: str | None, at: int, factor: float = 1.0) -> None:
        """Re-solve the inter-region level from the current state: the run's iterations not yet planned
        for good go to the regions still training, in proportion to their pace (the trigger's scaled by
        `factor`, its new replicas), each at least one per round left. A region whose range cannot be
        cut keeps its plan. Under `sync` every region runs every iteration: nothing moves."""
        if self.rounds() is None or self.workflow.sync.inter_region == "sync":
            return
        rounds = self.rounds() or 0
        total = sum(self.region_iterations(r) for r in self.workflow.regions)
        committed, points, seconds, least = 0, {}, {}, {}
        for name, plan in self.plans.items():
            if plan.left:  # what it did up to its last round applied
                applied = self._applied_rounds(name)
                committed += self.round_ends(name)[applied - 1] if applied else 0
                continue
            point = at if name == trigger else self._cut(name)
            left = rounds - self._rounds_done(name, point) if point is not None else 0
            if point is None or left == 0:
                committed += plan.end
                continue
            points[name], least[name] = point, left
            seconds[name] = self._seconds_per_iteration(name) * (factor if name == trigger else 1.0)
        if not points:
            return
        shares = share_iterations(total - committed - sum(points.values()), seconds, least)
        planned = sum(shares.values())
        for name, point in points.items():
            plan = self.plans[name]
            new = RegionPlan(point + shares[name], plan.replicas, shares[name] / planned if planned else None)
            if name == trigger:
                self._adopt(name, new, point)
            else:
                plan.next = new
        self._note(
            "replan",
            trigger or "",
            at,
            iterations={name: point + shares[name] for name, point in points.items()},
            seconds_per_iteration={name: round(value, 6) for name, value in seconds.items()},
        )

    def _applied_rounds(self, name: str) -> int:
        """How many of a departed region's rounds the others applied (its functions write no more): its
        round models that are not departure marks (model averaging), its pushes (ASGD-GA); the fewest
        over its stages."""
        region = self.workflow.region(name)
        counts = []
        for stage in range(region.stages):
            if self.workflow.sync.inter_region == "asgd-ga":
                server = self.workflow.sync.server or name
                channel, namespace = self.storage(server), self.namespace(server)
                pushed, version = 0, 1
                while (owner := channel.try_get(protocol.global_key(namespace, stage, version, "owner"))) is not None:
                    pushed += owner.decode().startswith(f"{name}/round")
                    version += 1
                counts.append(pushed)
                continue
            channel, k = self.storage(name), 0
            while True:
                key = protocol.round_key(self.namespace(name), "model-average", stage, k, "model")
                data = channel.try_get(key)
                if data is None or data == protocol.LEFT_MARK:
                    break
                k += 1
            counts.append(k)
        return min(counts, default=0)

    def _leave(self, name: str, why: str, tell: bool) -> None:
        """Region `name` leaves the run: record it, tell the others (unless it went silent: they find
        out by the region timeout), and re-plan the rest."""
        with self.lock:
            plan = self.plans[name]
            if plan.left:
                return
            plan.left = why
            self.ranges.pop(name, None)
            print(f"cloudless-run: {why}; the other regions go on without it", file=sys.stderr, flush=True)
            if tell:
                record = json.dumps({"by": "coordinator", "why": why}).encode()
                try:
                    self.storage(name).claim(protocol.left_key(self.namespace(name)), record)
                except Exception as exc:  # noqa: BLE001 - its storage unreachable: the others time out
                    print(f"cloudless-run: could not record that {name} left: {exc}", file=sys.stderr)
            progress = self.records[name].progress if name in self.records else []
            self._note("left", name, progress[-1].iteration + 1 if progress else 0, why=why)
            if any(not p.left for p in self.plans.values()):
                self._replan(None, 0)

    def _watch_departures(self) -> None:
        """A region another one stopped waiting for (its `left_key` is there) leaves the run."""
        for name, plan in list(self.plans.items()):
            if not plan.left and self.storage(name).exists(protocol.left_key(self.namespace(name))):
                data = self.storage(name).try_get(protocol.left_key(self.namespace(name))) or b"{}"
                why = str(json.loads(data).get("why", "it missed a meet"))
                self._leave(name, f"{name} left the run: {why}", tell=False)

    def _note(self, event: str, region: str, iteration: int, **details: Any) -> None:
        self.events.append({"event": event, "region": region, "iteration": iteration, "time": time.time(), **details})

    def start_of(self, region: Region) -> int:
        """Where the region's run starts: 0, or resuming, the newest iteration at which every stage
        holds a whole checkpoint (a multiple of checkpoint_every, or the planned end)."""
        if not self.settings.resume:
            return 0
        namespace = self.namespace(region.name)
        stop, every = self.region_iterations(region), self.workflow.run.checkpoint_every
        for at in sorted({stop, *range(every, stop, every)}, reverse=True):
            try:
                if all(
                    self.storage(region.name).try_get(protocol.state_key(namespace, f.stage, at)) is not None
                    for f in region.functions
                ):
                    return at
            except CorruptBlob:
                continue
        return 0

    def _event(self, function: Function, replica: int, start: int, stop: int, attempt: int) -> protocol.Invocation:
        limit = self.settings.time_limit_s or max(1.0, function.timeout_s - 30.0)
        region = next((r for r, f in self.workflow.functions() if f.package == function.package), None)
        several = region is not None and len(self.workflow.regions) > 1
        plan = self.plans[region.name] if region is not None else None
        planned = tuple(f.replicas for f in region.functions) if region is not None else ()
        return protocol.Invocation(
            start=start,
            stop=stop,
            replica=replica,
            run=self.settings.run_id,
            attempt=attempt,
            time_limit_s=float(limit),
            timeout=float(self.settings.key_timeout_s),
            # the region's iterations in this run (its meet points with several regions, what a
            # learning-rate schedule stretches over), and what the coordinator re-planned
            iterations=plan.end if plan is not None else None,
            rounds=self.rounds(),
            since=plan.since if plan is not None and plan.since else None,
            first_round=plan.first_round if plan is not None and plan.first_round else None,
            replicas=plan.replicas if plan is not None and plan.replicas != planned else None,
            weight=plan.weight if plan is not None else None,
            region_timeout=float(self.settings.region_timeout_s) if several else None,
        )

    def _launch(self, function: Function, replica: int, start: int, stop: int, attempt: int) -> tuple:
        invocation = Invocation(function, replica, self._event(function, replica, start, stop, attempt), attempt)
        invocation.launched = time.time()
        try:
            handle: Handle = self.invoker.start(invocation)
        except InvocationFailed as exc:
            handle = _Failed(exc)
        return invocation, handle

    def _invoke_range(self, region: Region, start: int, stop: int, record: RegionRun) -> int:
        """Invoke every replica of every function for start..stop-1; returns where they stopped."""
        replicas = self.plans[region.name].replicas
        pending = {
            (f.name, r): self._launch(f, r, start, stop, 0)
            for f, count in zip(region.functions, replicas, strict=True)
            for r in range(count)
        }
        kills = self._plan_faults(self.random[region.name], list(pending), start, stop)
        attempts = dict.fromkeys(pending, 0)  # the last attempt of each, for the clean-up
        try:
            return self._follow_range(region, start, stop, record, pending, kills, attempts)
        except BaseException:
            for _, handle in pending.values():
                handle.kill()  # none outlives a controller that gives up (where the invoker can)
            raise

    def _follow_range(
        self,
        region: Region,
        start: int,
        stop: int,
        record: RegionRun,
        pending: dict[tuple[str, int], tuple[Invocation, Handle]],
        kills: dict[tuple[str, int], tuple],
        attempts: dict[tuple[str, int], int],
    ) -> int:
        """Wait for the range's invocations: retry the failed ones, inject the faults, follow the
        progress; where they stopped."""
        range_began = last_look = time.time()
        last = region.functions[-1]  # in stage order
        stopped: list[int] = []
        next_iteration = start
        while pending:
            if self.cancelled.is_set():
                raise RunError("interrupted")
            for key, (invocation, handle) in list(pending.items()):
                try:
                    result = handle.poll()
                except InvocationFailed as exc:
                    record.invocations.append(self._summary(invocation, "failed", str(exc)))
                    recorded = self._abort_record(region.name)
                    if recorded is not None:  # its model code raised (no retry can mend that), or another aborted
                        raise RunError(recorded.message) from exc
                    if invocation.attempt >= self.settings.retries:
                        tried = f"attempt {invocation.attempt + 1} of {self.settings.retries + 1}"
                        function = invocation.function
                        record_ = AbortRecord("failed", f"{exc} ({tried})", start, function.stage, function.name)
                        # Functions the invoker cannot kill (remote) find this and stop waiting.
                        abort = protocol.abort_key(self.namespace(region.name))
                        self.storage(region.name).claim(abort, record_.encode())
                        if len(self.workflow.regions) > 1:  # the region leaves; the others go on
                            raise RegionGone(f"{region.name} failed: {record_.message}", tell=True) from exc
                        raise RunError(record_.message) from exc
                    record.retries += 1
                    attempts[key] = invocation.attempt + 1
                    pending[key] = self._launch(
                        invocation.function, invocation.replica, start, stop, invocation.attempt + 1
                    )
                    continue
                if result is None:
                    continue
                del pending[key]
                record.results.append(result)
                record.invocations.append(self._summary(invocation, result.status, result.reason))
                recorded = self._abort_record(region.name) if result.status in ("left", "aborted") else None
                if result.status == "left" or (recorded is not None and recorded.reason == "left"):
                    raise RegionGone(recorded.message if recorded is not None else result.reason, tell=False)
                if result.status in ("diverged", "aborted"):  # the others find the abort record
                    raise RunDiverged(self._abort_message(region.name, result))
                stopped.append(result.stop)
            next_iteration = self._follow(region.name, last, next_iteration, stop, record)
            now = time.time()
            if now - last_look > self.settings.alive_check_s:
                self._check_alive(region, next_iteration)
                if len(self.workflow.regions) > 1:
                    with self.lock:
                        self._watch_departures()
                    if self.plans[region.name].left:
                        raise RegionGone(self.plans[region.name].left, tell=False)
                last_look = now
            for failure in self.settings.region_failures:
                if failure.region == region.name and start <= failure.iteration <= next_iteration:
                    for _, handle in pending.values():
                        handle.kill()
                    # It says nothing: the other regions find out by the region timeout.
                    raise RegionGone(f"{region.name} stopped answering at iteration {failure.iteration}", tell=False)
            for key, when in list(kills.items()):
                victim = pending[key][1] if key in pending else None
                if victim is not None and self._due(when, next_iteration, now, record, range_began):
                    if victim.kill():
                        record.faults += 1
                    del kills[key]
            if pending:
                time.sleep(self.settings.poll_s)
        if len(set(stopped)) != 1:
            raise RunError(f"the functions stopped at different iterations {sorted(set(stopped))}; expected one")
        # Progress of the last iterations may land just before the results: read it all.
        self._follow(region.name, last, next_iteration, stopped[0], record, wait=True)
        self._forget_range(region, start, attempts)
        return stopped[0]

    def _check_alive(self, region: Region, iteration: int) -> None:
        """Raise RunError if storage lost the region's keys (its alive key is gone): whatever a
        function waits for may be gone too, so the run stops now instead of after the key timeout.
        The abort record tells functions the controller cannot kill."""
        namespace = self.namespace(region.name)
        channel = self.storage(region.name)
        if channel.exists(protocol.alive_key(namespace)):
            return
        gone = channel.describe(protocol.alive_key(namespace))
        message = (
            f"storage lost the run's keys near iteration {iteration} ({gone} is gone: flushed, evicted "
            "or expired?); what is left cannot be trusted, start the run again"
        )
        channel.claim(protocol.abort_key(namespace), AbortRecord("failed", message, iteration, 0, "").encode())
        raise RunError(message)

    def _abort_record(self, region: str) -> AbortRecord | None:
        """The region's abort record, if a function wrote one (the function that found out why)."""
        data = self.storage(region).try_get(protocol.abort_key(self.namespace(region)))
        return AbortRecord.decode(data) if data is not None else None

    def _abort_message(self, region: str, result: InvocationResult) -> str:
        """Why the region's run stopped: the abort record, else the result's reason."""
        recorded = self._abort_record(region)
        return recorded.message if recorded is not None else result.reason

    def _forget_range(self, region: Region, start: int, attempts: dict[tuple[str, int], int]) -> None:
        """A finished range's markers (completion, claims, the stop decision) are needed no more:
        delete them, so that storage does not grow with the number of invocations."""
        namespace = self.namespace(region.name)
        keys = [protocol.stop_key(namespace, start)]
        for (function, replica), last_attempt in sorted(attempts.items()):
            keys.append(protocol.done_key(namespace, function, replica, start))
            keys += [protocol.claim_key(namespace, function, replica, start, a) for a in range(last_attempt + 1)]
        try:
            for key in keys:
                self.storage(region.name).delete(key)
        except Exception as exc:  # noqa: BLE001 - best effort: the run's clean-up deletes them too
            print(f"cloudless-run: could not delete the markers of the range from {start}: {exc}", file=sys.stderr)

    def clean_up(self) -> int:
        """Delete every key of the run (each region's namespace); the staged data stays. How many."""
        names = {r.name for r in self.workflow.regions}
        if len(names) > 1 and self.workflow.sync.server:  # ASGD-GA's server may train nothing
            names.add(self.workflow.sync.server)
        return sum(self.storage(name).delete_prefix(self.namespace(name) + "/") for name in sorted(names))

    def _follow(
        self, region: str, last: Function, iteration: int, stop: int, record: RegionRun, wait: bool = False
    ) -> int:
        """Read the last stage's per-iteration reports from `iteration` on; returns the next unread.
        With `wait` (every invocation is done), a report a killed invocation never sent is rebuilt
        from the losses its retry returned."""
        namespace = self.namespace(region)
        while iteration < stop:
            reports = []
            for replica in range(self.plans[region].replicas[-1]):
                key = protocol.metrics_key(namespace, iteration, replica)
                data = self.storage(region).try_get(key)
                if data is None and wait:
                    try:
                        data = self.storage(region).get(key, timeout=2.0)
                    except KeyTimeout:
                        data = self._report_from_results(
                            last, replica, iteration, record, self.plans[region].replicas[-1]
                        )
                if data is None:
                    return iteration
                reports.append(MetricsReport.decode(data))
            losses = [x for r in reports for x in r.losses if x is not None]
            loss = sum(losses) / len(losses) if losses else math.nan
            progress = Progress(iteration, loss, max(r.time for r in reports), region)
            record.progress.append(progress)
            self.on_progress(progress)
            iteration += 1
        return iteration

    def _report_from_results(
        self, last: Function, replica: int, iteration: int, record: RegionRun, replicas: int
    ) -> bytes:
        per_iteration = len(local_micro_batches(self.workflow.run.micro_batches, replicas, replica))
        when = record.progress[-1].time if record.progress else time.time()
        for result in reversed(record.results):
            if result.function == last.name and result.replica == replica:
                if result.resumed <= iteration < result.stop:
                    at = (iteration - result.resumed) * per_iteration
                    return MetricsReport(result.losses[at : at + per_iteration], when).encode()
        # Its invocation was killed after the report's iteration and its retry resumed from a later
        # checkpoint: training is whole, only this progress report is gone.
        record.lost_reports += 1
        return MetricsReport((), when).encode()

    def _plan_faults(
        self, rng: random.Random, keys: list[tuple[str, int]], start: int, stop: int
    ) -> dict[tuple[str, int], tuple]:
        """Which invocations of this range to kill, and when: at a random iteration of the range,
        a random fraction of an iteration into it (seeded, so a run's faults can be replayed)."""
        kills = {}
        for key in keys:
            if self.settings.fault_rate and rng.random() < self.settings.fault_rate:
                kills[key] = (rng.randrange(start, stop), rng.random())
        return kills

    @staticmethod
    def _due(when: tuple[int, float], next_iteration: int, now: float, record: RegionRun, range_began: float) -> bool:
        """Due once the run is `fraction` of an iteration into iteration `iteration` (the first
        iteration of a range also covers the cold start)."""
        iteration, fraction = when
        if next_iteration < iteration:
            return False
        times = [p.time for p in record.progress]
        step = statistics.median([b - a for a, b in zip(times[:-1], times[1:], strict=True)]) if len(times) > 2 else 1.0
        began = times[-1] if times and times[-1] > range_began else range_began
        return now >= began + fraction * step

    @staticmethod
    def _summary(invocation: Invocation, status: str, error: str) -> dict[str, Any]:
        return {
            "function": invocation.function.name,
            "replica": invocation.replica,
            "start": invocation.event.start,
            "attempt": invocation.attempt,
            "launched": invocation.launched,
            "ended": time.time(),
            "status": status,
            "error": error,
        }
