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

import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from ...ir import protocol
from ...ir.protocol import (
    DEFAULT_KEY_TIMEOUT_S,
    EMULATE_ENV,
    PEERS_ENV,
    STORAGE_ENV,
    Invocation,
    InvocationResult,
)
from ...ir.schedule import compute_order, local_micro_batches, one_f_one_b_windows
from ...ir.workflow import SYNC_STEP_KIND, StepKind, Workflow
from ..storage.channels import Channel, KeyTimeout, open_channel
from ..storage.emulation import CpuShare, EmulatedChannel, Resources, wan_channel, wan_link
from .checkpoints import Checkpoints
from .data import data_name
from .failures import Aborted, Diverged, ModelFailed, RegionLeft, StorageWriteFailed
from .function_channel import FunctionChannel
from .pipeline_steps import PipelineSteps
from .region_sync import RegionSync
from .replica_sync import ReplicaSync

#: the span of synchronous cross-region SGD's reduce (not "sync": that is the scatter-reduce's)
CROSS_REGION_SPAN = "cross-region-reduce"


def load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: how much longer than the other invocation's time limit a duplicate waits for its result
DUPLICATE_GRACE_S = 60.0


class StageWorker(Checkpoints, PipelineSteps, ReplicaSync, RegionSync):
    """One function's worker: its invocations (`run`) and their iterations (`iteration`), each part of
    the work done by the part that owns it (worker_base.py)."""

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
        self.channel = FunctionChannel(self.link)
        self.cpu = CpuShare(resources.vcpus if resources else None)
        self.pipelined_sync = pipelined_sync
        spec = json.loads((self.package / "function.json").read_text())
        workflow = Workflow.from_json(spec["workflow"])
        self.workflow = workflow
        region = workflow.region(spec["region"])
        self.region = region.name
        functions = region.functions  # in stage order
        self.function = region.function(spec["function"])
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
        self.inter_region = self.sync.inter_region if len(workflow.regions) > 1 else None
        self.planned = (region.iterations, self.sync.rounds)
        # the region's iterations in this run (the invocation's, else the plan's): what the
        # learning-rate schedule stretches over
        self.iterations = region.iterations or run.iterations
        self.meets = {}  # iterations done -> the round that ends there
        # Every region and its weight, in region order: its share of a round's samples (model
        # averaging, ASGD-GA) or of an iteration's (sync); equal shares where the plan gives none
        self.peers = [(r.name, float(r.weight or 1.0 / len(workflow.regions))) for r in workflow.regions]
        self.weight = dict(self.peers)[self.region]  # this invocation's (the coordinator may re-plan it)
        # how long a meet waits for another region before going on without it; None (an invocation that
        # does not say, e.g. a deployed region's state machine): until the key timeout, then fail
        self.region_timeout = None
        self.key_timeout = DEFAULT_KEY_TIMEOUT_S
        self.planned_replicas = [f.replicas for f in functions]
        self.departed = set()  # regions this worker has seen leave (they contribute no more)
        self.server = self.sync.server
        # Other regions' storage, across the WAN (unnamed: the peer's keys are in this storage)
        emulate_wan = bool(resources and resources.wan)
        others = {r.name for r in workflow.regions} | ({self.server} if self.server else set())
        self.wan = {
            name: wan_channel((peers or {}).get(name, channel), wan_link(workflow.wan, self.region, name), emulate_wan)
            for name in sorted(others - {self.region})
        }
        self.base_version = 0  # ASGD-GA: the global version this region's model started its round from
        self.optimizer_spec = workflow.optimizer
        self.holders = {
            name: [f.stage for f in functions if name in f.shared_parameters]
            for name in self.function.shared_parameters
        }
        self.frozen = frozenset(self.function.frozen_parameters)
        stage_module = load_module(self.package / "stage.py", f"cloudless_stage_{self.stage}")
        self.inputs, self.outputs = list(stage_module.INPUTS), list(stage_module.OUTPUTS)
        self.module = stage_module.Stage()
        self.loss = None
        if self.last:
            self.loss = load_module(self.package / f"{workflow.data.loss}.py", "cloudless_loss").Stage()
        self.optimizer, self.optimizer_groups = self._make_optimizer()
        self._reader = None
        self._batch = (-1, [])  # (iteration, its samples in order)
        self._pool = None  # control requests off the critical path
        self._reports = []
        self._link_threads = None
        self._ready = None  # (namespace, replica, iteration) memory is before
        self.namespace = protocol.namespace("", self.region)  # keys of one run: "<run>/<region>"
        self.replica = 0

    def _make_optimizer(self) -> tuple[torch.optim.Optimizer | None, list[int]]:
        """The workflow's optimizer over the parameters this stage trains, in make_optimizer's parameter
        groups (those holding any of them), and each torch group's index among the workflow's groups.
        None for a stage of frozen parameters only (a frozen backbone's): it has nothing to step."""
        spec = self.optimizer_spec
        cls = getattr(torch.optim, spec.class_name)
        trained = dict(self.trained_parameters())
        if not spec.groups:
            return (cls(list(trained.values()), **spec.options), [0]) if trained else (None, [])
        groups, indices = [], []
        for index, group in enumerate(spec.groups):
            params = [trained[name] for name in group.parameters if name in trained]
            if params:
                groups.append({"params": params, **group.options})
                indices.append(index)
        return (cls(groups, **spec.options), indices) if groups else (None, [])

    # -- the time limit --------------------------------------------------------------------------
    # Every function of the region must end an invocation at the same iteration, or one would wait
    # for a micro-batch another never sends. Stage 0's replica 0 decides, at the start of iteration
    # i, to end after iteration i + 1, and writes that under the invocation's stop key (claimed: a
    # retry finds the first decision). No function can finish iteration i before the decision is
    # written (each needs a micro-batch or a sync piece descending from stage 0 replica 0's work on
    # i), so a read issued once a function finished iteration i sees it; it runs in the background
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
        self.key_timeout = timeout
        if not 0 <= replica < self.replicas:
            raise ValueError(f"replica {replica}: {self.function.name} has replicas 0..{self.replicas - 1}")
        if not 0 <= start < stop:
            raise ValueError(f"iterations {start}..{stop}: expected 0 <= start < stop")
        self.meets = self._meets(iterations, rounds, since or 0, first_round or 0)
        self.iterations = iterations or self.planned[0] or self.workflow.run.iterations
        self.namespace = protocol.namespace(run, self.region)
        if self.channel.namespace != self.namespace:
            self.channel.written.clear()  # another run's keys: not this invocation's to sweep
            self.departed.clear()
        self.channel.namespace = self.namespace
        self.channel.write_failure = None  # a new invocation tries storage again
        self.replica = replica
        try:
            return self._run_range(start, stop, replica, timeout, time_limit_s, attempt)
        except StorageWriteFailed as exc:
            # Recorded where storage still takes it (its neighbours stop waiting), and returned rather
            # than raised: the controller reads why from the result, which needs no storage.
            record = protocol.AbortRecord("failed", str(exc), start, self.stage, self.function.name)
            with contextlib.suppress(Exception):
                self.channel.inner.claim(protocol.abort_key(self.namespace), record.encode())
            self._ready = None
            return InvocationResult("failed", self.function.name, replica, start, stage=self.stage, reason=str(exc))

    def _run_range(
        self, start: int, stop: int, replica: int, timeout: float, time_limit_s: float | None, attempt: int | None
    ) -> InvocationResult:
        began, wall = time.monotonic(), time.time()
        done_key = protocol.done_key(self.namespace, self.function.name, replica, start)
        done = self.channel.try_get(done_key)
        if done is not None:  # it already ran: change nothing
            return dataclasses.replace(InvocationResult.decode(done), duplicate=True)
        if attempt is not None and not self.channel.claim(
            protocol.claim_key(self.namespace, self.function.name, replica, start, attempt), str(wall).encode()
        ):
            # Another invocation of this attempt runs the range (a platform's retry of a call it thought
            # lost): answer with its result once it ends, so that whoever reads this answer (Step Functions'
            # next range starts at the workers' stop) goes on from where it really stopped.
            wait = timeout if time_limit_s is None else min(timeout, time_limit_s + DUPLICATE_GRACE_S)
            try:
                ran = self.channel.get(done_key, wait)
            except KeyTimeout:  # it died without a result: nothing of the range is known done
                return InvocationResult("duplicate", self.function.name, replica, start, stage=self.stage, stop=start)
            return dataclasses.replace(InvocationResult.decode(ran), duplicate=True)
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
        max_norm = self.workflow.run.max_grad_norm
        if max_norm is not None:
            with self._span(spans, "clip"):
                self._clip_to_global_norm(iteration, replica, timeout, max_norm)
        with self._span(spans, "step"):
            optimizer = self.optimizer
            if optimizer is not None:
                for group, index in zip(optimizer.param_groups, self.optimizer_groups, strict=True):
                    rate = self.optimizer_spec.learning_rate(iteration, self.iterations, index)
                    if rate is not None:
                        group["lr"] = rate
                self._model_code(iteration, "optimizer step", optimizer.step)
                optimizer.zero_grad(set_to_none=True)
            self._check_finite(iteration, [])
        if iteration + 1 in self.meets:
            assert self.inter_region is not None
            with self._span(spans, self.inter_region):
                self._meet(self.meets[iteration + 1], replica, timeout)
        return values


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


def cap_threads(cpu_millis: int) -> None:
    """Deployed, torch would start one thread per core of the machine under the function, however small
    the function's CPU share (a 0.58-vCPU Lambda on a host of dozens of cores): as many threads as the
    share's whole vCPUs, at least one. A caller that set OMP_NUM_THREADS (the local invoker's --threads)
    keeps its own."""
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, math.ceil(cpu_millis / 1000)))


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
        cap_threads(worker.function.cpu_millis)
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
