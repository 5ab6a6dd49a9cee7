"""The stage worker: what one function runs for a range of training iterations.

A function package holds its stage's generated module (`stage.py`), weights (`weights.safetensors`),
the loss module on the last stage (`loss.py`) and `function.json` (its name, region and the whole
workflow). An invocation `{"start": a, "stop": b, "replica": k}` (or `{"iteration": i, ...}`, one
iteration) runs iterations a..b-1 as replica k: for each, its micro-batches in schedule order,
activations forward and gradients backward through storage, the stage's scatter-reduce, the sum of
tied parameters' gradients with the other stages holding them, and the optimizer step; with several
regions, the inter-region sync: under `sync` every iteration's cross-region reduce of gradients
(before the step), under model averaging and ASGD-GA at the end of each round (`round_ends`);
every `checkpoint_every`, a checkpoint.
That is the order of the workflow's `steps` for one function, which the worker follows by itself
(the steps describe it; `span_step` maps the spans it records to them). Every key it reads or
writes, and the invocation's fields, are spelled in `cloudless.ir.protocol`.

State between invocations: the parameters, buffers and optimizer state before iteration i are at
`protocol.state_key` (replica 0 writes them at each checkpoint and when the invocation returns);
a warm process keeps them in memory. Every tensor written is a function of the iteration, stage,
replica and micro-batch, and the computation is deterministic, so a duplicate or retried invocation
writes the same tensors and changes nothing (only reports, with their times, differ).

Several regions: a function reads and writes its own region's storage; another region's keys are in
that region's storage (`protocol.PEERS_ENV`), reached through a WAN channel per peer
(`emulation.wan_channel`: counted, and throttled by the pair's link under emulation).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import torch
from safetensors.torch import load_file

from cloudless.ir import protocol
from cloudless.ir.protocol import (
    DEFAULT_KEY_TIMEOUT_S,
    EMULATE_ENV,
    LEFT_MARK,
    PEERS_ENV,
    ROUND_WEIGHT,
    STORAGE_ENV,
    AbortRecord,
    CorruptBlob,
    GlobalPart,
    Invocation,
    InvocationResult,
    PushRecord,
)
from cloudless.ir.schedule import compute_order, local_micro_batches, one_f_one_b_windows, sample_indices
from cloudless.ir.workflow import SYNC_STEP_KIND, Function, StepKind, Workflow, round_meets

from .data import SplitReader, data_name
from .emulation import CpuShare, EmulatedChannel, Resources, wan_channel, wan_link
from .storage import Channel, KeyTimeout, open_channel
from .sync import scatter_reduce
from .tensors import pack, unpack

_T = TypeVar("_T")
#: the span of synchronous cross-region SGD's reduce (not "sync": that is the scatter-reduce's)
CROSS_REGION_SPAN = "cross-region-reduce"


def _one_line(text: str, limit: int = 300) -> str:
    first = text.strip().splitlines()[0] if text.strip() else ""
    return first if len(first) <= limit else first[: limit - 3] + "..."


def load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Diverged(RuntimeError):
    """A loss or a parameter is not finite: the run stops (`AbortRecord`)."""

    def __init__(self, record: AbortRecord) -> None:
        super().__init__(record.message)
        self.record = record


class ModelFailed(RuntimeError):
    """The model's own code (forward, loss, backward, optimizer step) raised. It computes the same
    thing on a retry, so the function stops the region's run at once (`AbortRecord`, reason
    failed) rather than let the controller retry it and its neighbours wait for its output."""

    def __init__(self, record: AbortRecord) -> None:
        super().__init__(record.message)
        self.record = record


def _where(exc: BaseException) -> str:
    """The innermost frame of an exception as `file:line` (the file's name only: no path of the
    machine it ran on)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return f" (at {Path(tb.tb_frame.f_code.co_filename).name}:{tb.tb_lineno})" if tb is not None else ""


class Aborted(RuntimeError):
    """Another function aborted the region's run; this one gives up waiting."""

    def __init__(self, record: AbortRecord) -> None:
        super().__init__(record.message)
        self.record = record


class RegionLeft(RuntimeError):
    """The other regions went on without this one: a region that waited for its contribution to a
    meet longer than the region timeout claimed it (`protocol.LEFT_MARK`). The region stops."""

    def __init__(self, record: AbortRecord) -> None:
        super().__init__(record.message)
        self.record = record


class _OwnChannel(Channel):
    """A function's view of storage. It notes the keys of iterations this function writes: it owns
    them and deletes them once nobody can need them (`protocol.sweep_before`); and a wait for a key
    looks at the region's abort record now and then, so that a function waiting for a neighbour
    that stopped gives up at once instead of after the key timeout."""

    def __init__(self, inner: Channel) -> None:
        self.inner = inner
        self.poll_s, self.max_poll_s = inner.poll_s, inner.max_poll_s
        self.namespace = ""
        self.written: dict[int, set[str]] = {}
        self._lock = threading.Lock()

    def _note(self, key: str) -> None:
        iteration = protocol.iteration_of(self.namespace, key)
        if iteration is not None:
            with self._lock:
                self.written.setdefault(iteration, set()).add(key)

    def try_get(self, key: str) -> bytes | None:
        return self.inner.try_get(key)

    def put(self, key: str, data: bytes) -> None:
        self.inner.put(key, data)
        self._note(key)

    def claim(self, key: str, data: bytes) -> bool:
        claimed = self.inner.claim(key, data)
        if claimed:
            self._note(key)
        return claimed

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
        """Raise Aborted if the region's run was aborted."""
        data = self.inner.try_get(protocol.abort_key(self.namespace))
        if data is not None:
            raise Aborted(AbortRecord.decode(data))

    def owned_before(self, iteration: int) -> list[str]:
        """The keys this function wrote for iterations before `iteration`, forgotten here."""
        with self._lock:
            done = sorted(i for i in self.written if i < iteration)
            return sorted(key for i in done for key in self.written.pop(i))


def _receive(value: Any) -> Any:
    """A value read from storage as the leaf autograd starts from on this side."""
    if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
        return value.requires_grad_(True)
    return value


class StageWorker:
    def __init__(
        self,
        package: Path,
        channel: Channel,
        *,
        pipelined_sync: bool = True,
        resources: Resources | None = None,
        peers: dict[str, Channel] | None = None,
    ) -> None:
        self.package = Path(package)
        # Every request goes through the function's (possibly emulated) link, which also counts them.
        self.link = EmulatedChannel(channel, resources)
        self.channel = _OwnChannel(self.link)
        self.cpu = CpuShare(resources.vcpus if resources else None)
        self.pipelined_sync = pipelined_sync
        spec = json.loads((self.package / "function.json").read_text())
        workflow = Workflow.from_json(spec["workflow"])
        self.workflow = workflow
        region = workflow.region(spec["region"])
        self.region = region.name
        functions = region.functions  # in stage order
        self.function: Function = region.function(spec["function"])
        self.stage = self.function.stage
        self.stages = region.stages
        self.replicas = self.function.replicas
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        run = workflow.run
        self.seed = run.seed
        self.global_batch, self.micro_batch = run.global_batch, run.micro_batch
        self.micro_batches = run.micro_batches
        self.schedule = run.schedule
        self.checkpoint_every = run.checkpoint_every
        self.window = one_f_one_b_windows([f.replicas for f in functions])[self.stage]
        self.sync = workflow.sync
        self.data_name = data_name(region)
        # Several regions: this stage meets its counterparts at the ends of the rounds (`_meets`).
        self.inter_region: str | None = self.sync.inter_region if len(workflow.regions) > 1 else None
        self.planned: tuple[int | None, int | None] = (region.iterations, self.sync.rounds)
        # the region's iterations in this run (the invocation's, else the plan's): what the
        # learning-rate schedule stretches over
        self.iterations: int = region.iterations or run.iterations
        self.meets: dict[int, int] = {}  # iterations done -> the round that ends there
        # Every region and its weight, in region order: its share of a round's samples (model
        # averaging, ASGD-GA) or of an iteration's (sync); equal shares where the plan gives none
        self.peers = [(r.name, float(r.weight or 1.0 / len(workflow.regions))) for r in workflow.regions]
        self.weight = dict(self.peers)[self.region]  # this invocation's (the coordinator may re-plan it)
        # how long a meet waits for another region before going on without it; None (an invocation that
        # does not say, e.g. a deployed region's state machine): until the key timeout, then fail
        self.region_timeout: float | None = None
        self.planned_replicas = [f.replicas for f in functions]
        self.departed: set[str] = set()  # regions this worker has seen leave (they contribute no more)
        self.server: str | None = self.sync.server
        # Other regions' storage, across the WAN (unnamed: the peer's keys are in this storage)
        emulate_wan = bool(resources and resources.wan)
        others = {r.name for r in workflow.regions} | ({self.server} if self.server else set())
        self.wan: dict[str, EmulatedChannel] = {
            name: wan_channel((peers or {}).get(name, channel), wan_link(workflow.wan, self.region, name), emulate_wan)
            for name in sorted(others - {self.region})
        }
        self.base_version = 0  # ASGD-GA: the global version this region's model started its round from
        self.optimizer_spec = workflow.optimizer
        self.holders = {
            name: [f.stage for f in functions if name in f.shared_parameters]
            for name in self.function.shared_parameters
        }
        stage_module = load_module(self.package / "stage.py", f"cloudless_stage_{self.stage}")
        self.inputs, self.outputs = list(stage_module.INPUTS), list(stage_module.OUTPUTS)
        self.module: torch.nn.Module = stage_module.Stage()
        self.loss: torch.nn.Module | None = None
        if self.last:
            self.loss = load_module(self.package / f"{workflow.data.loss}.py", "cloudless_loss").Stage()
        self.optimizer = getattr(torch.optim, self.optimizer_spec.class_name)(
            list(self.module.parameters()), **self.optimizer_spec.options
        )
        self._reader: SplitReader | None = None
        self._batch: tuple[int, list[int]] = (-1, [])  # (iteration, its samples in order)
        self._pool: ThreadPoolExecutor | None = None  # control requests off the critical path
        self._reports: list[Future[None]] = []
        self._link_threads: tuple[ThreadPoolExecutor, ThreadPoolExecutor] | None = None
        self._ready: tuple[str, int, int] | None = None  # (namespace, replica, iteration) memory is before
        self.namespace = protocol.namespace("", self.region)  # keys of one run: "<run>/<region>"
        self.replica = 0

    # -- keys --------------------------------------------------------------------------------------
    def state_key(self, iteration: int) -> str:
        return protocol.state_key(self.namespace, self.stage, iteration)

    # -- state -------------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        values: dict[str, Any] = {f"{protocol.MODULE_PREFIX}{k}": v for k, v in self.module.state_dict().items()}
        names = {id(p): n for n, p in self.module.named_parameters()}
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                values[f"{protocol.OPTIMIZER_PREFIX}{names[id(param)]}/{key}"] = value
        if self.inter_region == "asgd-ga":
            values[protocol.BASE_VERSION] = torch.tensor(self.base_version)
        return values

    def save_state(self, iteration: int, start: int = 0) -> None:
        """Checkpoint at `iteration` during an invocation that started at `start`."""
        self.channel.put(self.state_key(iteration), pack(self._state()))
        record = self._record()
        between = [i for i in record.get("between", []) if isinstance(i, int) and i != iteration]
        if iteration % self.checkpoint_every:
            between.append(iteration)
        # A range-end checkpoint before this invocation's start (an earlier invocation's end, which
        # nothing resumes from now) or beyond the sweep's horizon is deleted: else a run of many short
        # (time-limited) invocations would keep one per invocation
        horizon = max(start, protocol.sweep_before(iteration, self.checkpoint_every))
        old = [i for i in between if i < horizon]
        if old:
            self._reports.append(self._background().submit(self._delete, [self.state_key(i) for i in old]))
        record = {"latest": iteration, "between": sorted(i for i in between if i >= horizon)}
        self.channel.put(protocol.latest_state_key(self.namespace, self.stage), json.dumps(record).encode())

    def _record(self) -> dict[str, Any]:
        """The stage's checkpoint record (`protocol.latest_state_key`); empty when none is readable."""
        try:
            record = json.loads(self.channel.try_get(protocol.latest_state_key(self.namespace, self.stage)) or b"{}")
        except ValueError:
            return {}
        return record if isinstance(record, dict) else {}

    def load_state(self, iteration: int, timeout: float) -> None:
        if iteration == 0:
            self.module.load_state_dict(load_file(self.package / "weights.safetensors"), strict=True)
            self.optimizer.state.clear()
            self.base_version = 0
            return
        values = unpack(self.channel.get(self.state_key(iteration), timeout))
        self.module.load_state_dict(protocol.module_values(values), strict=True)
        params = dict(self.module.named_parameters())
        self.optimizer.state.clear()
        self.base_version = int(values[protocol.BASE_VERSION]) if protocol.BASE_VERSION in values else 0
        for key, value in values.items():
            if key.startswith(protocol.OPTIMIZER_PREFIX):
                name, field = key.removeprefix(protocol.OPTIMIZER_PREFIX).rsplit("/", 1)
                self.optimizer.state[params[name]][field] = value

    def _meets(self, iterations: int | None, rounds: int | None, since: int, first_round: int) -> dict[int, int]:
        """Model averaging and ASGD-GA: after how many iterations each round ends -> its index, from
        the region's iterations in this run and its rounds (the invocation's, else the plan's), since
        the coordinator's last re-plan of it (`round_meets`)."""
        if self.inter_region not in ("model-average", "asgd-ga"):
            return {}
        total, count = iterations or self.planned[0], rounds or self.planned[1]
        if total is None or count is None:
            raise ValueError(f"{self.function.name}: several regions, but no iterations or rounds are planned")
        if since or first_round:
            if not (since < total and first_round < count and count - first_round <= total - since):
                raise ValueError(
                    f"since {since}, first_round {first_round}: rounds {first_round}..{count - 1} do not fit "
                    f"in iterations {since}..{total - 1}"
                )
            return round_meets(total, count, since=since, first_round=first_round)
        return round_meets(total, min(count, total))

    #: how many checkpoints past the newest one recorded a retried invocation also looks for (the record
    #: is written after its checkpoint: a crash between the two leaves it one behind)
    RECORD_LAG = 2

    def _resume_point(self, start: int, stop: int, attempt: int | None) -> int:
        """The latest checkpoint of this stage in start+1..stop-1: where a retried invocation resumes.
        A first attempt starts at `start` (nothing of its range ran yet) without asking storage; a retry
        reads the stage's record of its newest checkpoint (`protocol.latest_state_key`) and checks that
        one, and the next few multiples of checkpoint_every after it, exist: a few reads, however long
        the range (it once scanned every multiple of the range from the top down)."""
        if attempt == 0:
            return start
        recorded = self._record().get("latest")
        if not isinstance(recorded, int):  # no record: this stage has no checkpoint in this run
            return start
        every = self.checkpoint_every
        below = min(recorded, stop - 1)  # the newest may lie past this range (a later range's): look below
        below -= below % every
        candidates = {recorded - recorded % every + k * every for k in range(1, self.RECORD_LAG + 1)}
        candidates |= {recorded} | {below - k * every for k in range(self.RECORD_LAG + 1)}
        for iteration in sorted(candidates, reverse=True):
            if start < iteration < stop and self.channel.exists(self.state_key(iteration)):
                return iteration
        return start

    def _load_checkpoint(self, resume: int, timeout: float, start: int) -> int:
        """Load the checkpoint at `resume`; if it is corrupt, the one before it that is whole (an
        invocation replays from there, reading the same tensors its neighbours sent then, which
        they keep: `protocol.sweep_before`). Returns where it resumes; CorruptBlob if none is whole."""
        try:
            self.load_state(resume, timeout)
            return resume
        except CorruptBlob as exc:
            corrupt = exc
        every = self.checkpoint_every
        earlier_ones = set(range((resume - 1) // every * every, max(resume - 2 * every, 0) - 1, -every))
        if start < resume:
            earlier_ones.add(start)
        for earlier in sorted(earlier_ones, reverse=True):
            try:
                if earlier > 0 and not self.channel.exists(self.state_key(earlier)):
                    continue
                self.load_state(earlier, timeout)
            except CorruptBlob:
                continue
            print(f"cloudless: {corrupt}; resuming from the checkpoint of iteration {earlier}", file=sys.stderr)
            return earlier
        raise corrupt

    def _sweep(self, checkpoint: int, start: int) -> None:
        """Having checkpointed at `checkpoint`: delete what this function wrote for iterations
        before `protocol.sweep_before`, and (replica 0) the stage's checkpoints nobody resumes from
        any more: the one two intervals back, and the one this invocation started from."""
        before = protocol.sweep_before(checkpoint, self.checkpoint_every)
        keys = self.channel.owned_before(before)
        if self.replica == 0:
            if before > 0:
                keys.append(self.state_key(before))
            every = self.checkpoint_every
            if start % every and start < checkpoint - every <= start + every:  # once, the first time
                keys.append(self.state_key(start))
        if keys:
            self._reports.append(self._background().submit(self._delete, keys))

    def _delete(self, keys: list[str]) -> None:
        """Best effort: a key left behind costs storage (the run's clean-up gets it), not training."""
        for key in keys:
            try:
                self.channel.delete(key)
            except Exception as exc:  # noqa: BLE001 - any back end's error
                print(f"cloudless: could not delete {self.channel.describe(key)}: {exc}", file=sys.stderr)

    def _check_finite(self, iteration: int, losses: list[float]) -> None:
        """Raise Diverged if a loss of this iteration, or a parameter after its step, is not finite."""
        bad = next((x for x in losses if not math.isfinite(x)), None)
        what = f"the loss is {bad}" if bad is not None else ""
        if not what and not all(bool(torch.isfinite(p).all()) for p in self.module.parameters()):
            what = "a parameter is not finite after the optimizer step"
        if what:
            message = (
                f"iteration {iteration}: {what} on stage {self.stage} ({self.function.name}, replica "
                f"{self.replica}): training diverged; lower the learning rate or check the data"
            )
            raise Diverged(AbortRecord("diverged", message, iteration, self.stage, self.function.name))

    # -- the time limit --------------------------------------------------------------------------
    # Every function of the region must end an invocation at the same iteration, or one would wait
    # for a micro-batch another never sends. Stage 0's replica 0 decides, at the start of iteration
    # i, to end after iteration i + 1, and writes that under the invocation's stop key (claimed: a
    # retry finds the first decision). No function can finish iteration i before the decision is
    # written (each needs a micro-batch or a sync piece descending from stage 0 replica 0's work on
    # i), so a read issued once a function finished iteration i sees it; it runs in the background
    # during iteration i + 1 and is looked at before iteration i + 2: no request on the critical path.
    def _background(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="control")
        return self._pool

    # -- one invocation ----------------------------------------------------------------------------
    def run(
        self,
        start: int,
        stop: int,
        replica: int,
        *,
        timeout: float = DEFAULT_KEY_TIMEOUT_S,
        time_limit_s: float | None = None,
        run: str = "",
        attempt: int | None = None,
        iterations: int | None = None,
        rounds: int | None = None,
        since: int | None = None,
        first_round: int | None = None,
        replicas: tuple[int, ...] | None = None,
        weight: float | None = None,
        region_timeout: float | None = None,
    ) -> InvocationResult:
        """Iterations start..stop-1 as `replica`, ending early (at the iteration every function of the
        region agrees on) when `time_limit_s` would be passed. The result says where it stopped.
        The rest is the coordinator's plan of the region (`protocol.Invocation`)."""
        counts = list(replicas) if replicas is not None else self.planned_replicas
        if len(counts) != self.stages:
            raise ValueError(f"replicas: {len(counts)} counts for the region's {self.stages} stages")
        self.replicas = counts[self.stage]
        self.window = one_f_one_b_windows(counts)[self.stage]
        self.weight = weight if weight is not None else dict(self.peers)[self.region]
        self.region_timeout = region_timeout
        if not 0 <= replica < self.replicas:
            raise ValueError(f"replica {replica}: {self.function.name} has replicas 0..{self.replicas - 1}")
        if not 0 <= start < stop:
            raise ValueError(f"iterations {start}..{stop}: expected 0 <= start < stop")
        self.meets = self._meets(iterations, rounds, since or 0, first_round or 0)
        self.iterations = iterations or self.planned[0] or self.workflow.run.iterations
        began, wall = time.monotonic(), time.time()
        self.namespace = protocol.namespace(run, self.region)
        if self.channel.namespace != self.namespace:
            self.channel.written.clear()  # another run's keys: not this invocation's to sweep
            self.departed.clear()
        self.channel.namespace = self.namespace
        self.replica = replica
        done_key = protocol.done_key(self.namespace, self.function.name, replica, start)
        done = self.channel.try_get(done_key)
        if done is not None:  # it already ran: change nothing
            return dataclasses.replace(InvocationResult.decode(done), duplicate=True)
        if attempt is not None and not self.channel.claim(
            protocol.claim_key(self.namespace, self.function.name, replica, start, attempt), str(wall).encode()
        ):
            return InvocationResult("duplicate", self.function.name, replica, start, stage=self.stage)
        spans: list[list[Any]] = []
        resume = self._resume_point(start, stop, attempt)
        if self._ready != (self.namespace, replica, resume):
            with self._span(spans, "load state"):
                resume = self._load_checkpoint(resume, timeout, start)
        losses: list[float] = []
        longest = 0.0
        reached = resume
        counted = self._counts()
        stop_key, decided = protocol.stop_key(self.namespace, start), False
        lookups: dict[int, Future[bytes | None]] = {}  # iteration -> read of the stop key for it
        self._ready = None  # until an iteration completes, memory holds no state to reuse
        status: protocol.InvocationStatus = "done"
        reason = ""
        try:
            for iteration in range(resume, stop):
                if time_limit_s is not None:
                    lookup = lookups.pop(iteration, None)
                    found = lookup.result() if lookup is not None else self.channel.try_get(stop_key)
                    requested = protocol.cut_request(found)  # the coordinator's, for the leader to decide
                    if requested is not None:
                        found = None
                    if self.first and replica == 0 and not decided and iteration + 2 < stop:
                        # The leader decides, 2 iterations ahead: every other function is behind it.
                        wanted = None
                        if requested is not None:
                            wanted = max(requested, iteration + 2)
                        elif time.monotonic() - began + 3 * longest > time_limit_s:
                            wanted = iteration + 2
                        if wanted is not None:
                            self._decide_stop(stop_key, wanted)
                            decided = True
                    if found is not None and int(found) <= iteration:
                        break
                tick = time.monotonic()
                losses.extend(self.iteration(iteration, replica, timeout, spans))
                longest = max(longest, time.monotonic() - tick)
                reached = iteration + 1
                if time_limit_s is not None and iteration + 2 < stop:
                    lookups[iteration + 2] = self._background().submit(self.channel.try_get, stop_key)
                if reached % self.checkpoint_every == 0:
                    if replica == 0:
                        with self._span(spans, "checkpoint"):
                            self.save_state(reached, start)
                    self._sweep(reached, start)
            if replica == 0 and reached % self.checkpoint_every != 0:
                with self._span(spans, "checkpoint"):
                    self.save_state(reached, start)  # where the next invocation starts
        except Diverged as exc:
            # The first function to find out records why; every other one gives up on reading it.
            self.channel.claim(protocol.abort_key(self.namespace), exc.record.encode())
            status, reason = "diverged", str(exc)
        except ModelFailed as exc:
            # Recorded for every waiting neighbour and the controller (no retry), then raised: the
            # invocation fails, as a platform expects of a function that raised.
            self.channel.claim(protocol.abort_key(self.namespace), exc.record.encode())
            raise
        except RegionLeft as exc:
            self.channel.claim(protocol.abort_key(self.namespace), exc.record.encode())  # its partners stop
            status, reason = "left", str(exc)
        except Aborted as exc:
            status, reason = "aborted", str(exc)
        finally:
            for lookup in lookups.values():
                lookup.cancel()
            reports, self._reports = self._reports, []
            for future in reports:
                future.result()
        if status == "done":
            self._ready = (self.namespace, replica, reached)
        result = InvocationResult(
            status,
            self.function.name,
            replica,
            start,
            stage=self.stage,
            resumed=resume,
            stop=reached,
            losses=tuple(losses),
            seconds=round(time.monotonic() - began, 6),
            storage={k: v - counted.get(k, 0) for k, v in self._counts().items()},
            spans=tuple((str(n), float(a), float(b)) for n, a, b in spans),
            reason=reason,
        )
        self.channel.put(done_key, result.encode())
        return result

    def _decide_stop(self, key: str, iteration: int) -> None:
        """The leader's stop decision for the range: written unless one is there already (an earlier
        attempt's, which others may have acted on); it replaces a coordinator's request."""
        value = str(iteration).encode()
        if not self.channel.claim(key, value):
            current = self.channel.try_get(key)
            if current is None or protocol.cut_request(current) is not None:
                self.channel.put(key, value)

    def _counts(self) -> dict[str, int]:
        """Requests and bytes so far: to this region's storage, and (`wan/<region>/<kind>`) to each
        other region's, across the WAN."""
        counts = dict(self.link.counts)
        for name, peer in self.wan.items():
            counts.update({f"{protocol.WAN_COUNT_PREFIX}{name}/{k}": v for k, v in peer.counts.items()})
        return counts

    @staticmethod
    def _span(spans: list[list[Any]], name: str) -> _Span:
        return _Span(spans, name)

    def _model_code(self, iteration: int, what: str, call: Callable[[], _T]) -> _T:
        """Run the model's own code (`what`: forward, loss, backward, optimizer step); what it raises
        becomes ModelFailed, naming the iteration, stage, function, replica and the exception."""
        try:
            with self.cpu.compute():
                return call()
        except (Aborted, Diverged):
            raise
        except Exception as exc:  # noqa: BLE001 - the user's model may raise anything
            message = (
                f"iteration {iteration}: the {what} of stage {self.stage} ({self.function.name}, replica "
                f"{self.replica}) raised {type(exc).__name__}: {_one_line(str(exc))}{_where(exc)}"
            )
            raise ModelFailed(AbortRecord("failed", message, iteration, self.stage, self.function.name)) from exc

    def iteration(self, iteration: int, replica: int, timeout: float, spans: list[list[Any]]) -> list[float]:
        """Forward and backward of this replica's micro-batches, sync, step; the last stage's losses.

        Transfers overlap compute, as the planner's model has them: a downlink thread fetches the
        micro-batches' activations and gradients in the order compute needs them, and an uplink
        thread sends results in the order they are computed."""
        local = local_micro_batches(self.micro_batches, self.replicas, replica)
        order = compute_order(self.schedule, local, self.window)
        uplink, downlink = self._links()
        cancelled = threading.Event()
        arriving: dict[tuple[str, int], Future[bytes]] = {}
        for kind, m in order:
            if kind == "forward" and not self.first:
                key = protocol.activation_key(self.namespace, iteration, self.stage - 1, m)
            elif kind == "backward" and not self.last:
                key = protocol.gradient_key(self.namespace, iteration, self.stage + 1, m)
            else:
                continue
            arriving[(kind, m)] = downlink.submit(self.channel.get, key, timeout, cancelled)
        sending: list[Future[None]] = []
        received: dict[int, dict[str, Any]] = {}
        produced: dict[int, tuple[Any, ...]] = {}
        losses: dict[int, torch.Tensor] = {}
        try:
            for kind, m in order:
                with self._span(spans, f"{kind} {m}"):
                    incoming = arriving.pop((kind, m), None)
                    data = incoming.result() if incoming is not None else None
                    if kind == "forward":
                        received[m], produced[m] = self._forward(iteration, m, data, losses, uplink, sending)
                    else:
                        self._backward(iteration, m, data, received.pop(m), produced.pop(m), losses, uplink, sending)
            for future in sending:
                future.result()
        finally:
            cancelled.set()  # on an error, stop the fetches still waiting
        values = [float(losses[m]) for m in sorted(losses)]
        if not all(math.isfinite(x) for x in values):
            self._check_finite(iteration, values)  # stop before sending anything computed from it
        if self.last:
            # Progress for the controller: this replica's losses and when its micro-batches were
            # done, sent in the background (a crash may lose the last few; the controller copes).
            while len(self._reports) > 2:
                self._reports.pop(0).result()
            record = protocol.MetricsReport(tuple(values), time.time()).encode()
            key = protocol.metrics_key(self.namespace, iteration, replica)
            self._reports.append(self._background().submit(self.channel.put, key, record))
        with self._span(spans, "sync"):
            self._synchronise(iteration, replica, timeout)
        if self.inter_region == "sync":
            with self._span(spans, CROSS_REGION_SPAN):
                self._cross_reduce(iteration, replica, timeout)
        with self._span(spans, "step"):
            rate = self.optimizer_spec.learning_rate(iteration, self.iterations)
            if rate is not None:
                for group in self.optimizer.param_groups:
                    group["lr"] = rate
            self._model_code(iteration, "optimizer step", self.optimizer.step)
            self.optimizer.zero_grad(set_to_none=True)
            self._check_finite(iteration, [])
        if iteration + 1 in self.meets:
            assert self.inter_region is not None
            with self._span(spans, self.inter_region):
                self._meet(self.meets[iteration + 1], replica, timeout)
        return values

    # -- between regions ---------------------------------------------------------------------------
    # A key of the run (not of a region) is under the namespace of the region that writes it, in that
    # region's storage; ASGD-GA's global versions are in the server region's. Another region's
    # storage is reached through `self.wan` (one storage for all: the same storage, still counted).
    def _peer_namespace(self, region: str) -> str:
        return protocol.namespace(protocol.run_of(self.namespace), region)

    def _storage_of(self, region: str) -> Channel:
        """Where `region`'s keys are: this function's own storage, or the peer's across the WAN."""
        return self.channel if region == self.region else self.wan[region]

    def _peer_get(self, region: str, key: str, timeout: float) -> bytes:
        """A key of another region's, waited for (giving up when this region's run is aborted)."""
        return self._storage_of(region).get(key, timeout, abort=self.channel.check_abort)

    def _round_key(self, region: str, round_index: int, part: protocol.RoundPart) -> str:
        assert self.inter_region is not None
        return protocol.round_key(self._peer_namespace(region), self.inter_region, self.stage, round_index, part)

    def _model(self) -> dict[str, torch.Tensor]:
        """What regions share: parameters and floating-point buffers (optimizer state stays local)."""
        return {k: v for k, v in self.module.state_dict().items() if v.is_floating_point()}

    def _adopt(self, values: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in self.module.state_dict().items():
                if name in values:
                    tensor.copy_(values[name])

    def _cross_reduce(self, iteration: int, replica: int, timeout: float) -> None:
        """Synchronous cross-region SGD: the stage's gradients (summed over its replicas and tied
        partners) meet those of its counterparts in every other region. Replica 0 writes its region's
        in its own storage, reads every other region's, and takes their mean weighted by each region's
        share of the iteration's samples (`Region.weight`), in region order, so that every region computes the same
        bits and takes the same optimizer step; it leaves the result for its replicas. Floating-point
        buffers are averaged alike."""
        params = [p for _, p in self.module.named_parameters()]
        buffers = [b for _, b in self.module.named_buffers() if b.is_floating_point()]
        result_key = protocol.cross_key(self.namespace, iteration, self.stage, "result")
        if replica != 0:
            total = unpack(self.channel.get(result_key, timeout))["flat"]
        else:
            flat = torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in params]
                + [b.reshape(-1) for b in buffers]
            )
            weight = torch.tensor(self.weight, dtype=torch.float64)
            own = protocol.cross_key(self.namespace, iteration, self.stage, "sums")
            self._contribute(own, pack({"flat": flat, ROUND_WEIGHT: weight}), iteration)
            parts: list[tuple[float, dict[str, torch.Tensor]]] = []
            for region, _ in self.peers:
                if region == self.region:
                    parts.append((self.weight, {"flat": flat}))
                    continue
                key = protocol.cross_key(self._peer_namespace(region), iteration, self.stage, "sums")
                data = self._contribution(region, key, timeout)
                if data is not None:
                    theirs = unpack(data)
                    parts.append((float(theirs.pop(ROUND_WEIGHT)), theirs))
            total = weighted_mean(parts)["flat"]
            if self.replicas > 1:
                self.channel.put(result_key, pack({"flat": total}))
        offset = 0
        for p in params:
            p.grad = total[offset : offset + p.numel()].view_as(p).clone()
            offset += p.numel()
        with torch.no_grad():
            for b in buffers:
                b.copy_(total[offset : offset + b.numel()].view_as(b))
                offset += b.numel()

    def _meet(self, round_index: int, replica: int, timeout: float) -> None:
        """This stage's round-end sync with the other regions. Replica 0 talks across regions and
        leaves the result in its own region's storage; the other replicas read it there."""
        result_key = self._round_key(self.region, round_index, "result")
        if replica != 0:
            result = unpack(self.channel.get(result_key, timeout))
            self.base_version = int(result.pop(protocol.ROUND_VERSION, torch.tensor(0)))
            self._adopt(result)
            return
        if self.inter_region == "model-average":
            merged = self._model_average(round_index, timeout)
        else:
            merged = self._asgd_push(round_index, timeout)
        self._adopt(merged)
        if self.replicas > 1:
            extra = {protocol.ROUND_VERSION: torch.tensor(self.base_version)} if self.inter_region == "asgd-ga" else {}
            self.channel.put(result_key, pack({**merged, **extra}))

    def _model_average(self, round_index: int, timeout: float) -> dict[str, torch.Tensor]:
        """Every region writes its model for the round (with its weight, its share of the round's
        samples) in its own storage, reads the others' from theirs and takes the weighted mean, in
        region order (so every region gets the same bits). A region missing from the meet longer than
        the region timeout is left out (`_contribution`); the mean is then over those present. What
        was averaged is recorded beside the model (`members`)."""
        mine = self._model()
        weight = torch.tensor(self.weight, dtype=torch.float64)
        self._contribute(
            self._round_key(self.region, round_index, "model"), pack({**mine, ROUND_WEIGHT: weight}), round_index
        )
        parts: list[tuple[float, dict[str, torch.Tensor]]] = []
        members: dict[str, float] = {}
        for region, _ in self.peers:
            if region == self.region:
                parts.append((self.weight, mine))
                members[region] = self.weight
                continue
            data = self._contribution(region, self._round_key(region, round_index, "model"), timeout)
            if data is not None:
                theirs = unpack(data)
                members[region] = float(theirs.pop(ROUND_WEIGHT))
                parts.append((members[region], theirs))
        self.channel.put(self._round_key(self.region, round_index, "members"), json.dumps(members).encode())
        total = weighted_mean(parts)
        return {name: value.to(mine[name].dtype) for name, value in total.items()}

    def _contribute(self, key: str, data: bytes, step: int) -> None:
        """Write this region's contribution to a meet, create-if-absent: a region that stopped waiting
        for it may have claimed the key first (`protocol.LEFT_MARK`), and then this region has left
        the run (RegionLeft). A retry finds its own earlier write (the same bytes) and goes on."""
        if self.channel.claim(key, data) or self.channel.try_get(key) != LEFT_MARK:
            return
        message = (
            f"region {self.region} left the run at meet {step} (stage {self.stage}): the other regions "
            "went on without it (it missed a meet by the region timeout)"
        )
        raise RegionLeft(AbortRecord("left", message, step, self.stage, self.function.name))

    def _contribution(self, region: str, key: str, timeout: float) -> bytes | None:
        """Another region's contribution to a meet, or None if that region left the run. Waits up to the
        region timeout, then claims the key with LEFT_MARK (create-if-absent: if the region's own write
        wins, it counts; either way every region that reads the key agrees), and records the departure
        (`left_key`), after which a missing contribution of that region is marked at once."""
        if region in self.departed:
            return None
        storage = self._storage_of(region)
        left = protocol.left_key(self._peer_namespace(region))
        began = time.monotonic()
        checked = began - 1.0
        wait = storage.poll_s
        while True:
            data = storage.try_get(key)
            if data is not None:
                if data == LEFT_MARK:
                    self.departed.add(region)
                    return None
                return data
            now = time.monotonic()
            late = self.region_timeout is not None and now >= began + self.region_timeout
            if late or (now - checked >= 1.0 and storage.exists(left)):
                if storage.claim(key, LEFT_MARK):
                    why = f"{region} missed meet of {key.rsplit('/', 2)[-2]} by {now - began:.0f} s"
                    storage.claim(left, json.dumps({"by": self.region, "why": why}).encode())
                    self.departed.add(region)
                    return None
                continue  # its contribution (or another region's mark) landed meanwhile: read it
            if now >= began + timeout:
                raise KeyTimeout(f"{storage.describe(key)} did not appear within {timeout:g} s")
            if now - checked >= 1.0:
                checked = now
                self.channel.check_abort()
            time.sleep(wait)
            wait = min(wait * 2, storage.max_poll_s)

    def _global_key(self, version: int, part: GlobalPart) -> str:
        assert self.server is not None
        return protocol.global_key(self._peer_namespace(self.server), self.stage, version, part)

    def _global(self, version: int, timeout: float) -> dict[str, torch.Tensor]:
        if version == 0:  # every region starts from the package's weights
            initial = load_file(self.package / "weights.safetensors")
            return {k: v for k, v in initial.items() if k in self._model()}
        assert self.server is not None
        return unpack(self._peer_get(self.server, self._global_key(version, "model"), timeout))

    def push_update(
        self, previous: dict[str, torch.Tensor], base: dict[str, torch.Tensor], staleness: int
    ) -> tuple[dict[str, torch.Tensor], float, bool]:
        """ASGD-GA: the version a push of `staleness` makes from the newest one (`previous`) and the
        version its round started from (`base`); the factor its update is applied with; whether it
        was rebased.

        A region's update (its model now minus `base`) counts with its weight w (its share of a
        round's samples; 1/R without one): when the regions push from the same base, the global
        model moves as model averaging moves it, where adding every region's full update moved it R
        times as far (which diverged). Every push lands on the newest version, and the region starts
        its next round from the version it made. A push whose base lags more than `staleness_bound`
        versions is rebased: applied onto the newest version all the same, at its weight (not dropped,
        not damped: damping by (1 + bound) / (1 + staleness), or mixing the newest version toward
        the region's model, each cost accuracy on the geo sample, where a region pushing fewer, longer
        rounds is stale by construction), and reported as such (`PushRecord.rebased`)."""
        mine = self._model()
        weight = self.weight
        bound = self.sync.staleness_bound
        rebased = bound is not None and staleness > bound
        merged = {name: previous[name] + weight * (mine[name] - base[name]) for name in mine}
        return {name: value.to(mine[name].dtype) for name, value in merged.items()}, weight, rebased

    def _asgd_push(self, round_index: int, timeout: float) -> dict[str, torch.Tensor]:
        """ASGD-GA: apply this round's update (`push_update`) to the newest global version, as the
        next version, without waiting for any other region; record the push beside it
        (`PushRecord`). Versions are claimed with create-if-absent in the server region's storage; a
        retried push finds its own claim and rewrites the same bytes, so an update is never applied
        twice."""
        assert self.server is not None
        server = self._storage_of(self.server)
        me = protocol.global_owner(self.region, round_index)
        base = self._global(self.base_version, timeout)
        version = self.base_version + 1
        while True:
            owner = server.try_get(self._global_key(version, "owner"))
            if owner is None and server.claim(self._global_key(version, "owner"), me):
                owner = me
            elif owner is None:
                owner = self._peer_get(self.server, self._global_key(version, "owner"), timeout)
            if owner == me:
                staleness = version - 1 - self.base_version
                previous = self._global(version - 1, timeout)
                merged, scale, rebased = self.push_update(previous, base, staleness)
                record = PushRecord(
                    self.region, round_index, self.stage, self.base_version, version, staleness, scale, rebased
                )
                server.put(self._global_key(version, "push"), record.encode())
                server.put(self._global_key(version, "model"), pack(merged))
                self.base_version = version
                return merged
            version += 1

    def _indices(self, iteration: int, m: int) -> list[int]:
        if self._reader is None:
            self._reader = SplitReader(self.channel, self.data_name)
        if self._batch[0] != iteration:  # the whole iteration's samples at once, then its slices
            self._batch = (
                iteration,
                sample_indices(iteration, 0, self.global_batch, self.global_batch, self._reader.samples, self.seed),
            )
        return self._batch[1][m * self.micro_batch : (m + 1) * self.micro_batch]

    def _links(self) -> tuple[ThreadPoolExecutor, ThreadPoolExecutor]:
        """The function's uplink and downlink: one thread each, so each keeps its order."""
        if self._link_threads is None:
            self._link_threads = (
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="uplink"),
                ThreadPoolExecutor(max_workers=1, thread_name_prefix="downlink"),
            )
        return self._link_threads

    def _forward(
        self,
        iteration: int,
        m: int,
        data: bytes | None,
        losses: dict[int, torch.Tensor],
        uplink: ThreadPoolExecutor,
        sending: list[Future[None]],
    ) -> tuple[dict[str, Any], tuple[Any, ...]]:
        if self.first:
            indices = self._indices(iteration, m)
            assert self._reader is not None
            taken = dict(zip(self.inputs, self._reader.gather(indices, "input"), strict=True))
        else:
            assert data is not None
            values = unpack(data)
            taken = {name: _receive(values[name]) for name in self.inputs}
        # Ops that draw random numbers (dropout) draw the same ones on a retry. (The CPU generator
        # alone: torch.manual_seed also queues seeding of every accelerator, at a millisecond a call.)
        torch.default_generator.manual_seed(
            (((self.seed * 1_000_003 + iteration) * 1_000_003 + self.stage) * 1_000_003 + m) % 2**63
        )
        outputs = tuple(self._model_code(iteration, "forward", lambda: self.module(*[taken[n] for n in self.inputs])))
        if self.last:
            loss = self.loss
            assert loss is not None
            indices = self._indices(iteration, m)
            assert self._reader is not None
            targets = self._reader.gather(indices, "target")
            (losses[m],) = self._model_code(iteration, "loss", lambda: loss(*outputs, *targets))
        else:
            key = protocol.activation_key(self.namespace, iteration, self.stage, m)
            sending.append(uplink.submit(self.channel.put, key, pack(dict(zip(self.outputs, outputs, strict=True)))))
        return taken, outputs

    def _backward(
        self,
        iteration: int,
        m: int,
        data: bytes | None,
        taken: dict[str, Any],
        outputs: tuple[Any, ...],
        losses: dict[int, torch.Tensor],
        uplink: ThreadPoolExecutor,
        sending: list[Future[None]],
    ) -> None:
        if self.last:
            # The global batch's loss is the mean of its micro-batches' (equal-sized) mean losses.
            loss = losses[m]
            self._model_code(iteration, "backward", lambda: (loss / self.micro_batches).backward())
            losses[m] = losses[m].detach()
        else:
            assert data is not None
            grads = unpack(data)
            pairs = [
                (value, grads[name])
                for name, value in zip(self.outputs, outputs, strict=True)
                if name in grads and isinstance(value, torch.Tensor) and value.requires_grad
            ]
            if pairs:
                self._model_code(
                    iteration, "backward", lambda: torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
                )
        if not self.first:
            sent = {
                name: value.grad
                for name, value in taken.items()
                if isinstance(value, torch.Tensor) and value.grad is not None
            }
            key = protocol.gradient_key(self.namespace, iteration, self.stage, m)
            sending.append(uplink.submit(self.channel.put, key, pack(sent)))

    def _synchronise(self, iteration: int, replica: int, timeout: float) -> None:
        """Sum gradients over the stage's replicas (and average float buffers), then tied parameters'
        gradients over the stages that hold them."""
        params = list(self.module.named_parameters())
        buffers = [(n, b) for n, b in self.module.named_buffers() if b.is_floating_point()]
        if self.replicas > 1:
            flat = torch.cat(
                [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for _, p in params]
                + [b.reshape(-1) / self.replicas for _, b in buffers]
            )
            total = scatter_reduce(
                self.channel,
                protocol.sync_key(self.namespace, iteration, self.stage),
                flat,
                replica,
                self.replicas,
                piece_bytes=self.sync.piece_bytes,
                max_pieces=self.sync.max_pieces,
                pipelined=self.pipelined_sync,
                timeout=timeout,
                abort=self.channel.check_abort,
            )
            offset = 0
            for _, p in params:
                p.grad = total[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()
            with torch.no_grad():
                for _, b in buffers:
                    b.copy_(total[offset : offset + b.numel()].view_as(b))
                    offset += b.numel()
        if self.holders:
            by_name = dict(params)
            mine: dict[str, torch.Tensor] = {
                n: (by_name[n].grad if by_name[n].grad is not None else torch.zeros_like(by_name[n]))  # type: ignore[misc]
                for n in self.holders
            }
            if replica == 0:
                self.channel.put(protocol.shared_gradient_key(self.namespace, iteration, self.stage), pack(mine))
            partners: dict[int, dict[str, Any]] = {}
            for name, stages in self.holders.items():
                total_grad: torch.Tensor | None = None
                for s in sorted(stages):
                    if s == self.stage:
                        part = mine[name]
                    else:
                        if s not in partners:
                            key = protocol.shared_gradient_key(self.namespace, iteration, s)
                            partners[s] = unpack(self.channel.get(key, timeout))
                        part = partners[s][name]
                    total_grad = part.clone() if total_grad is None else total_grad + part
                by_name[name].grad = total_grad


def weighted_mean(parts: list[tuple[float, dict[str, torch.Tensor]]]) -> dict[str, torch.Tensor]:
    """Sum of weight x values over `parts` in their order, divided by the weights' sum unless that is
    1 (a region left, or the regions' plans changed at different meets)."""
    total: dict[str, torch.Tensor] = {}
    for weight, values in parts:
        for name, value in values.items():
            total[name] = total[name] + weight * value if name in total else weight * value
    weights = math.fsum(weight for weight, _ in parts)
    if abs(weights - 1.0) > 1e-9:
        total = {name: value / weights for name, value in total.items()}
    return total


def span_step(name: str, replicas: int) -> StepKind | None:
    """The workflow step (`Step.kind`) whose work a span of a worker's result times, for a function
    of `replicas` replicas; None for work outside an iteration's steps (loading state). The `sync`
    span is the scatter-reduce, then the exchange of tied parameters' gradients, which is the
    optimizer step's wait for its partner stages (all of it, with one replica)."""
    kind = name.split()[0]
    if kind in ("forward", "backward"):
        return "compute"
    if kind == "sync":
        return "scatter-reduce" if replicas > 1 else None
    if kind == "step":
        return "optimizer-step"
    if name == CROSS_REGION_SPAN:
        return "cross-region-reduce"
    if name in SYNC_STEP_KIND:  # the inter-region strategy's own name
        return SYNC_STEP_KIND[name]
    if name == "checkpoint":
        return "checkpoint"
    return None


class _Span:
    """Times a piece of work for the timeline: [name, wall-clock start, end] in seconds."""

    def __init__(self, spans: list[list[Any]], name: str) -> None:
        self.spans, self.name = spans, name

    def __enter__(self) -> None:
        self.began = time.time()

    def __exit__(self, *exc: object) -> None:
        self.spans.append([self.name, round(self.began, 6), round(time.time(), 6)])


# Idle workers per (package, storage): a warm process reuses one; invocations running at once in one
# process (several replicas sent to one instance) each get their own, never one shared worker.
_IDLE: dict[tuple[str, str, str], list[StageWorker]] = {}
_IDLE_LOCK = threading.Lock()


def open_peers(peers_json: str) -> dict[str, Channel]:
    """The other regions' storage from `protocol.PEERS_ENV`'s value ({} when unset)."""
    if not peers_json:
        return {}
    try:
        peers = json.loads(peers_json)
    except ValueError as exc:
        raise ValueError(f"{PEERS_ENV}: not JSON: {exc}") from None
    if not isinstance(peers, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in peers.items()):
        raise ValueError(f'{PEERS_ENV}: expected a JSON object {{"region": "storage location"}}')
    return {region: open_channel(location) for region, location in peers.items()}


def handle_request(package: Path, event: Any, storage: str | None = None) -> dict[str, Any]:
    """Run the invocation `event` (`protocol.Invocation`'s wire form) on the function in `package`;
    a warm process reuses its worker. A bad event or no storage is a ValueError (a bad request)."""
    invocation = Invocation.from_json(event)
    location = storage or os.environ.get(STORAGE_ENV)
    if not location:
        raise ValueError(f"no storage: set {STORAGE_ENV} (a folder, s3://bucket/prefix or redis://host:port/db)")
    peers_json = os.environ.get(PEERS_ENV) or ""
    cache_key = (str(package), location, peers_json)
    with _IDLE_LOCK:
        idle = _IDLE.setdefault(cache_key, [])
        # Prefer the one warm for this replica (its state in memory is that replica's).
        worker = next((w for w in idle if w._ready and w._ready[1] == invocation.replica), idle[-1] if idle else None)
        if worker is not None:
            idle.remove(worker)
    if worker is None:
        emulate = os.environ.get(EMULATE_ENV)
        resources = Resources.from_json(json.loads(emulate)) if emulate else None
        worker = StageWorker(package, open_channel(location), resources=resources, peers=open_peers(peers_json))
    try:
        return worker.run(
            invocation.start,
            invocation.stop,
            invocation.replica,
            timeout=invocation.timeout or DEFAULT_KEY_TIMEOUT_S,
            time_limit_s=invocation.time_limit_s,
            run=invocation.run,
            attempt=invocation.attempt,
            iterations=invocation.iterations,
            rounds=invocation.rounds,
            since=invocation.since,
            first_round=invocation.first_round,
            replicas=invocation.replicas,
            weight=invocation.weight,
            region_timeout=invocation.region_timeout,
        ).to_json()
    finally:
        with _IDLE_LOCK:
            idle.append(worker)
