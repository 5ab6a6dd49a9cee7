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

The invokers (local processes, OpenFaaS, Lambda) are in invokers.py; progress is the last stage's
reports (`protocol.metrics_key`); the coordination of several regions' plans is in elastic.py.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from ...ir import protocol
from ...ir.protocol import (
    AbortRecord,
    CorruptBlob,
    InvocationResult,
    MetricsReport,
)
from ...ir.schedule import local_micro_batches
from ...ir.workflow import STEP_KINDS, Function, Region, Workflow
from ..storage.channels import Channel
from .coordinator import Coordinator
from .elastic import check_regions
from .invokers import FailedToStart, Handle, Invocation, InvocationFailed, Invoker
from .run_state import Progress, RegionGone, RegionPlan, RegionRun, RunDiverged, RunError, RunSettings

#: step kinds the stage workers run inside their invocations
# Every step runs inside the functions (the sync steps too): the controller invokes ranges of iterations.
FUNCTION_STEPS = frozenset(STEP_KINDS)


class Controller(Coordinator):
    """Invokes every function of every region over the ranges the coordinator plans, follows them,
    retries failures and injects faults."""

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
            raise RunError(
                "--inject-faults needs an invoker that can kill invocations (local, or --invoker openfaas "
                f"--rehearse); {invoker.name} cannot"
            )
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
        self.changed = threading.Condition(self.lock)
        self.run_rounds = self.rounds()
        self.plans = {
            region.name: RegionPlan(
                self.region_iterations(region), tuple(f.replicas for f in region.functions), rounds=self.run_rounds
            )
            for region in workflow.regions
        }
        self.ranges: dict[str, tuple[int, int]] = {}  # the range under way per region
        self.positions = {region.name: 0 for region in workflow.regions}  # where each stands between ranges
        self.idle: set[str] = set()  # at their end, waiting
        self.exited: set[str] = set()  # their threads ended
        self.ends: dict[str, int] = {}  # where each region's run ended
        self.events: list[dict[str, Any]] = []  # what the coordinator did, in order (metrics.json)

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
                for k in range(self.run_rounds or 0):
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
                    self._forget_interrupted(region)
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
                with self.changed:
                    self.exited.add(region.name)
                    self.changed.notify_all()  # a region waiting at its end: the run may be over

        threads = [threading.Thread(target=run_region, args=(r,)) for r in self.workflow.regions]
        for thread in threads:
            thread.start()
        try:
            for thread in threads:
                while thread.is_alive():
                    thread.join(0.2)  # in steps: Ctrl-C reaches this thread between them
        except KeyboardInterrupt:
            self.cancelled.set()  # each region kills its invocations and stops
            with self.changed:
                self.changed.notify_all()  # a region waiting at its end too
                # Not thread.join(): one that Ctrl-C interrupted may return at once from then on
                # (CPython marks the thread stopped), and a region would stop its work unwatched.
                while len(self.exited) < len(threads):
                    self.changed.wait(0.2)
            raise
        if errors:
            raise errors[0]
        if all(plan.left for plan in self.plans.values()):
            raise RunError("every region left the run: " + "; ".join(p.left for p in self.plans.values()))
        return records

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
            rounds=plan.rounds if plan is not None else self.rounds(),
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
            handle = FailedToStart(exc)
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
                        raise RunError(recorded.message, resumable=False) from exc
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
                if result.status == "failed":  # storage refused a write: a retry meets the same full storage
                    raise RunError(f"{invocation.label}: {result.reason}")
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
                    self.invoker.take_down(region.name)
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

    def _forget_interrupted(self, region: Region) -> None:
        """Resuming: what stopped the run must not stop the resumed one, and the interrupted run's markers
        (completions, claims of any attempt, stop decisions, the newest attempt) would make its invocations
        look done, duplicated or abandoned. None of its invocations runs any more."""
        namespace, channel = self.namespace(region.name), self.storage(region.name)
        channel.delete(protocol.abort_key(namespace))
        channel.delete(protocol.attempt_key(namespace))  # the resumed run's attempts count from 0 again
        for prefix in protocol.marker_prefixes(namespace):
            channel.delete_prefix(prefix)

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
        With `wait` (every invocation is done, and a function returns only once its reports are
        written), a report that is not there never will be: one a killed invocation never sent, or one
        its function swept while the controller was not looking (paused), is rebuilt at once from the
        losses the invocations returned."""
        namespace = self.namespace(region)
        while iteration < stop:
            reports = []
            for replica in range(self.plans[region].replicas[-1]):
                key = protocol.metrics_key(namespace, iteration, replica)
                data = self.storage(region).try_get(key)
                if data is None and wait:
                    data = self._report_from_results(last, replica, iteration, record, self.plans[region].replicas[-1])
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
