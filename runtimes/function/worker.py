"""The stage worker: what one function runs for a range of training iterations.

A function package holds its stage's generated module (`stage.py`), weights (`weights.safetensors`),
the loss module on the last stage (`loss.py`) and `function.json` (its name, region and the whole
workflow). An invocation `{"start": a, "stop": b, "replica": k}` (or `{"iteration": i, ...}`, one
iteration) runs iterations a..b-1 as replica k.

`StageWorker` composes one part per responsibility, each a plain class that owns its own state and is
handed what it shares explicitly (stage_context.py):

- `context: StageContext`, the function's facts from its package (workflow, region, function, stage,
  module, optimizer, frozen parameters, storage channel and link, CPU share), built once here;
  `invocation: InvocationState`, the invocation's settings (namespace, replica, replicas, window,
  iterations, key timeout), set by `run`; `background: Background`, the control threads.
- `steps: PipelineSteps` (pipeline_steps.py): the micro-batches' forwards and backwards; owns the
  stage module's input and output names, the loss module, the data reader and the iteration's
  samples, the uplink and downlink threads.
- `replica_sync: ReplicaSync` (replica_sync.py): the scatter-reduce among the stage's replicas, the sum
  of tied parameters' gradients, the clip to the global norm; owns the tied parameters' holders.
- `region_sync: RegionSync` (region_sync.py): the sync between regions; owns the strategy, the
  regions' weights, the rounds' meets, the region timeout, the departed regions, ASGD-GA's server and
  base version, the WAN channels.
- `checkpoints: Checkpoints` (checkpoints.py): save, load, where a retry resumes, the sweep.
The worker itself keeps only `_ready`: which state its memory holds, for a warm invocation.

An iteration (`iteration`), in the order of the workflow's `steps` for one function: the
micro-batches in schedule order, activations forward and gradients backward through storage
(`steps.compute`); the losses' progress report (last stage); the stage's scatter-reduce and the sum of
tied parameters' gradients with the other stages holding them (`replica_sync.synchronise`); with
several regions under `sync`, the cross-region reduce of gradients (`region_sync.cross_reduce`); the
clip to `max_grad_norm`; the optimizer step; under model averaging and ASGD-GA, at the end of each
round, the meet with the other regions (`region_sync.meet`). Every `checkpoint_every` iterations,
`run` checkpoints (`checkpoints.save_state`) and sweeps. The worker follows the steps by itself (the
steps describe it; `span_step` maps the spans it records to them). Every key it reads or writes, and
the invocation's fields, are spelled in `cloudless.ir.protocol`.

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
import uuid
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
from ...ir.schedule import one_f_one_b_windows
from ...ir.workflow import SYNC_STEP_KIND, OptimizerSpec, StepKind, Workflow
from ..storage.channels import Channel, KeyTimeout, RidingOut, open_channel
from ..storage.emulation import CpuShare, EmulatedChannel, Resources
from .batches import user_module
from .buffer_updates import BufferUpdates
from .checkpoints import Checkpoints
from .data import data_name
from .failures import Abandoned, Aborted, Diverged, ModelFailed, RegionLeft, StorageWriteFailed
from .function_channel import FunctionChannel
from .pipeline_steps import PipelineSteps
from .region_sync import RegionSync
from .replica_sync import ReplicaSync
from .stage_context import Background, InvocationState, Span, StageContext, trained_parameters

#: the span of synchronous cross-region SGD's reduce (not "sync": that is the scatter-reduce's)
CROSS_REGION_SPAN = "cross-region-reduce"


def load_stage_module(package: Path, name: str, model_file: str) -> ModuleType:
    """A package's stage module; when its code calls the model file's own functions (`user_attribute`), the
    model file is imported first, from the package's user/ folder."""
    path = package / "stage.py"
    if protocol.user_attribute.__name__ + "(" in path.read_text():
        user_module(package, model_file)
    return load_module(path, name)


def load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: how much longer than the other invocation's time limit a duplicate waits for its result
DUPLICATE_GRACE_S = 60.0


def make_optimizer(
    spec: OptimizerSpec, trained: dict[str, torch.nn.Parameter]
) -> tuple[torch.optim.Optimizer | None, tuple[int, ...]]:
    """The workflow's optimizer over the parameters this stage trains, in make_optimizer's parameter
    groups (those holding any of them), and each torch group's index among the workflow's groups.
    None for a stage of frozen parameters only (a frozen backbone's): it has nothing to step."""
    cls = spec.optimizer_class()  # a module outside torch.optim: the model file imported first (StageWorker)
    if not spec.groups:
        return (cls(list(trained.values()), **spec.options), (0,)) if trained else (None, ())
    groups, indices = [], []
    for index, group in enumerate(spec.groups):
        params = [trained[name] for name in group.parameters if name in trained]
        if params:
            groups.append({"params": params, **group.options})
            indices.append(index)
    return (cls(groups, **spec.options), tuple(indices)) if groups else (None, ())


class StageWorker:
    """One function's worker: its invocations (`run`) and their iterations (`iteration`), each part of
    the work done by the part that owns it (this module's docstring)."""

    def __init__(
        self,
        package: Path,
        channel: Channel,
        *,
        pipelined_sync: bool = True,
        resources: Resources | None = None,
        peers: dict[str, Channel] | None = None,
    ) -> None:
        package = Path(package)
        # Every request goes through the function's (possibly emulated) link, which also counts them.
        link = EmulatedChannel(channel, resources)
        spec = json.loads((package / "function.json").read_text())
        workflow = Workflow.from_json(spec["workflow"])
        region = workflow.region(spec["region"])
        functions = region.functions  # in stage order
        function = region.function(spec["function"])
        stage = function.stage
        first, last = stage == 0, stage == region.stages - 1
        frozen = frozenset(function.frozen_parameters)
        stage_module = load_stage_module(package, f"cloudless_stage_{stage}", workflow.data.model_file)
        module = stage_module.Stage()
        loss = None
        if last:
            loss = load_module(package / f"{workflow.data.loss}.py", "cloudless_loss").Stage()
        if workflow.optimizer.module is not None:  # the optimizer's module may be the model file or beside it
            user_module(package, workflow.data.model_file)
        optimizer, optimizer_groups = make_optimizer(workflow.optimizer, dict(trained_parameters(module, frozen)))
        self.context = StageContext(
            package=package,
            workflow=workflow,
            region=region.name,
            function=function,
            stage=stage,
            stages=region.stages,
            first=first,
            last=last,
            planned_iterations=region.iterations,
            planned_replicas=tuple(f.replicas for f in functions),
            module=module,
            optimizer=optimizer,
            optimizer_groups=optimizer_groups,
            frozen=frozen,
            link=link,
            channel=FunctionChannel(link),
            cpu=CpuShare(resources.vcpus if resources else None),
        )
        # until the first invocation says otherwise: the plan's
        self.invocation = InvocationState(
            namespace=protocol.namespace("", region.name),
            replica=0,
            replicas=function.replicas,
            window=one_f_one_b_windows([f.replicas for f in functions])[stage],
            iterations=region.iterations or workflow.run.iterations,
            key_timeout=DEFAULT_KEY_TIMEOUT_S,
        )
        self.background = Background()  # control requests off the critical path
        buffers = BufferUpdates(module, getattr(stage_module, "BUFFER_RULES", {}))
        self.steps = PipelineSteps(
            self.context,
            self.invocation,
            inputs=list(stage_module.INPUTS),
            outputs=list(stage_module.OUTPUTS),
            loss=loss,
            data_name=data_name(region),
            buffers=buffers,
        )
        holders = {
            name: [f.stage for f in functions if name in f.shared_parameters] for name in function.shared_parameters
        }
        self.replica_sync = ReplicaSync(
            self.context, self.invocation, holders=holders, pipelined=pipelined_sync, buffers=buffers
        )
        self.region_sync = RegionSync(
            self.context,
            self.invocation,
            storage=channel,
            peer_storage=peers or {},
            emulate_wan=bool(resources and resources.wan),
        )
        self.checkpoints = Checkpoints(self.context, self.invocation, self.background, self.region_sync)
        self._ready: tuple[str, int, int] | None = None  # (namespace, replica, iteration) memory is before

    def close(self) -> None:
        """Stop what the worker's threads have queued: a dropped worker's transfers end with it."""
        self.steps.close()
        self.background.close()

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
        context, invocation, channel = self.context, self.invocation, self.context.channel
        counts = list(replicas) if replicas is not None else list(context.planned_replicas)
        if len(counts) != context.stages:
            raise ValueError(f"replicas: {len(counts)} counts for the region's {context.stages} stages")
        invocation.replicas = counts[context.stage]
        invocation.window = one_f_one_b_windows(counts)[context.stage]
        invocation.key_timeout = timeout
        channel.inner.ride_out_s = timeout  # a transient storage error is ridden out as long as any wait
        if not 0 <= replica < invocation.replicas:
            raise ValueError(f"replica {replica}: {context.function.name} has replicas 0..{invocation.replicas - 1}")
        if self.steps.buffers.sequenced and invocation.replicas > 1:  # the plan never asks it (buffer_rules.py)
            raise ValueError(
                f"{context.function.name}: {invocation.replicas} replicas, but its forward changes buffer "
                f"{self.steps.buffers.sequenced[0]} in an order replicas cannot reproduce; it runs one replica"
            )
        if not 0 <= start < stop:
            raise ValueError(f"iterations {start}..{stop}: expected 0 <= start < stop")
        self.region_sync.begin(
            iterations, rounds, since or 0, first_round or 0, weight=weight, region_timeout=region_timeout
        )
        invocation.iterations = iterations or context.planned_iterations or context.workflow.run.iterations
        invocation.namespace = protocol.namespace(run, context.region)
        if channel.namespace != invocation.namespace:
            channel.written.clear()  # another run's keys: not this invocation's to sweep
            self.region_sync.new_run()
        channel.namespace = invocation.namespace
        channel.write_failure = None  # a new invocation tries storage again
        channel.attempt = attempt
        invocation.replica = replica
        try:
            return self._run_range(start, stop, replica, timeout, time_limit_s, attempt)
        except StorageWriteFailed as exc:
            # Recorded where storage still takes it (its neighbours stop waiting), and returned rather
            # than raised: the controller reads why from the result, which needs no storage.
            record = protocol.AbortRecord("failed", str(exc), start, context.stage, context.function.name)
            with contextlib.suppress(Exception):
                channel.raw.claim(protocol.abort_key(invocation.namespace), record.encode())
            self._ready = None
            return InvocationResult(
                "failed", context.function.name, replica, start, stage=context.stage, reason=str(exc)
            )

    def _run_range(
        self, start: int, stop: int, replica: int, timeout: float, time_limit_s: float | None, attempt: int | None
    ) -> InvocationResult:
        context, channel, namespace = self.context, self.context.channel, self.invocation.namespace
        name = context.function.name
        began, wall = time.monotonic(), time.time()
        done_key = protocol.done_key(namespace, name, replica, start)
        done = channel.try_get(done_key)
        if done is not None:  # it already ran: change nothing
            return dataclasses.replace(InvocationResult.decode(done), duplicate=True)
        if attempt is not None and not channel.claim(
            protocol.claim_key(namespace, name, replica, start, attempt), f"{wall} {uuid.uuid4().hex}".encode()
        ):
            # Another invocation of this attempt runs the range (a platform's retry of a call it thought
            # lost): answer with its result once it ends, so that whoever reads this answer (Step Functions'
            # next range starts at the workers' stop) goes on from where it really stopped.
            wait = timeout if time_limit_s is None else min(timeout, time_limit_s + DUPLICATE_GRACE_S)
            try:
                ran = channel.get(done_key, wait)
            except KeyTimeout:  # it died without a result: nothing of the range is known done
                return InvocationResult("duplicate", name, replica, start, stage=context.stage, stop=start)
            return dataclasses.replace(InvocationResult.decode(ran), duplicate=True)
        spans: list[list[Any]] = []
        checkpoints = self.checkpoints
        every = context.workflow.run.checkpoint_every
        resume = checkpoints.resume_point(start, stop, attempt)
        if self._ready != (namespace, replica, resume):
            with Span(spans, "load state"):
                resume = checkpoints.load_checkpoint(resume, timeout, start)
        losses: list[float] = []
        longest = 0.0
        reached = resume
        counted = self._counts()
        stop_key, decided = protocol.stop_key(namespace, start), False
        lookups: dict[int, Future[bytes | None]] = {}  # iteration -> read of the stop key for it
        self._ready = None  # until an iteration completes, memory holds no state to reuse
        status: protocol.InvocationStatus = "done"
        reason, abandoned = "", False
        try:
            for iteration in range(resume, stop):
                if time_limit_s is not None:
                    lookup = lookups.pop(iteration, None)
                    found = lookup.result() if lookup is not None else channel.try_get(stop_key)
                    requested = protocol.cut_request(found)  # the coordinator's, for the leader to decide
                    if requested is not None:
                        found = None
                    if context.first and replica == 0 and not decided and iteration + 2 < stop:
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
                    lookups[iteration + 2] = self.background.submit(channel.try_get, stop_key)
                if reached % every == 0:
                    if replica == 0:
                        with Span(spans, "checkpoint"):
                            checkpoints.save_state(reached, start)
                    checkpoints.sweep(reached, start)
            if replica == 0 and reached % every != 0:
                with Span(spans, "checkpoint"):
                    checkpoints.save_state(reached, start)  # where the next invocation starts
        except Diverged as exc:
            # The first function to find out records why; every other one gives up on reading it.
            channel.claim(protocol.abort_key(namespace), exc.record.encode())
            status, reason = "diverged", str(exc)
        except ModelFailed as exc:
            # Recorded for every waiting neighbour and the controller (no retry), then raised: the
            # invocation fails, as a platform expects of a function that raised.
            channel.claim(protocol.abort_key(namespace), exc.record.encode())
            raise
        except RegionLeft as exc:
            channel.claim(protocol.abort_key(namespace), exc.record.encode())  # its partners stop
            status, reason = "left", str(exc)
        except Abandoned as exc:
            status, reason, abandoned = "aborted", str(exc), True
        except Aborted as exc:
            status, reason = "aborted", str(exc)
        finally:
            for lookup in lookups.values():
                lookup.cancel()
            self.background.drain()
        if status == "done":
            self._ready = (namespace, replica, reached)
        result = InvocationResult(
            status,
            name,
            replica,
            start,
            stage=context.stage,
            resumed=resume,
            stop=reached,
            losses=tuple(losses),
            seconds=round(time.monotonic() - began, 6),
            storage={k: v - counted.get(k, 0) for k, v in self._counts().items()},
            spans=tuple((str(n), float(a), float(b)) for n, a, b in spans),
            reason=reason,
        )
        if not abandoned:
            channel.put(done_key, result.encode())
        return result

    def _decide_stop(self, key: str, iteration: int) -> None:
        """The leader's stop decision for the range: written unless one is there already (an earlier
        attempt's, which others may have acted on); it replaces a coordinator's request."""
        channel = self.context.channel
        value = str(iteration).encode()
        if not channel.claim(key, value):
            current = channel.try_get(key)
            if current is None or protocol.cut_request(current) is not None:
                channel.put(key, value)

    def _counts(self) -> dict[str, int]:
        """Requests and bytes so far: to this region's storage, and (`wan/<region>/<kind>`) to each
        other region's, across the WAN."""
        counts = dict(self.context.link.counts)
        counts.update(self.region_sync.wan_counts())
        return counts

    # -- one iteration -----------------------------------------------------------------------------
    def iteration(self, iteration: int, replica: int, timeout: float, spans: list[list[Any]]) -> list[float]:
        """Forward and backward of this replica's micro-batches, sync, step; the last stage's losses."""
        context = self.context
        values = self.steps.compute(iteration, replica, timeout, spans)
        if not all(math.isfinite(x) for x in values):
            context.check_finite(iteration, replica, values)  # stop before sending anything computed from it
        if context.last:
            self._report(iteration, replica, values)
        with Span(spans, "sync"):
            self.replica_sync.synchronise(iteration, replica, timeout)
        inter_region = self.region_sync.inter_region
        if inter_region == "sync":
            with Span(spans, CROSS_REGION_SPAN):
                self.region_sync.cross_reduce(iteration, replica, timeout)
        max_norm = context.workflow.run.max_grad_norm
        if max_norm is not None:
            with Span(spans, "clip"):
                self.replica_sync.clip_to_global_norm(iteration, replica, timeout, max_norm)
        with Span(spans, "step"):
            self._step(iteration, replica)
        round_index = self.region_sync.round_ending(iteration + 1)
        if round_index is not None:
            assert inter_region is not None
            with Span(spans, inter_region):
                self.region_sync.meet(round_index, replica, timeout)
        return values

    def _report(self, iteration: int, replica: int, losses: list[float]) -> None:
        """Progress for the controller: this replica's losses and when its micro-batches were done,
        sent in the background (a crash may lose the last few; the controller copes)."""
        self.background.wait_until(2)
        record = protocol.MetricsReport(tuple(losses), time.time()).encode()
        key = protocol.metrics_key(self.invocation.namespace, iteration, replica)
        self.background.send(self.context.channel.put, key, record)

    def _step(self, iteration: int, replica: int) -> None:
        """The optimizer step at the iteration's learning rates (`OptimizerSpec.learning_rate`, over the
        region's iterations in this run); Diverged if a parameter is not finite after it."""
        context = self.context
        optimizer = context.optimizer
        if optimizer is not None:
            for group, index in zip(optimizer.param_groups, context.optimizer_groups, strict=True):
                rate = context.workflow.optimizer.learning_rate(iteration, self.invocation.iterations, index)
                if rate is not None:
                    group["lr"] = rate
            context.model_code(iteration, replica, "optimizer step", optimizer.step)
            optimizer.zero_grad(set_to_none=True)
        context.check_finite(iteration, replica, [])


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
    return {region: RidingOut(open_channel(location)) for region, location in peers.items()}


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
        cap_threads(worker.context.function.cpu_millis)
    try:
        result = worker.run(
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
    except BaseException:
        # A worker whose invocation raised is dropped: what its memory holds of the failed attempt is
        # unknown, and a retry in this warm process starts from storage alone.
        worker.close()
        raise
    with _IDLE_LOCK:
        idle.append(worker)
    return result
