"""The stage worker: what one function runs for a range of training iterations.

A function package holds its stage's generated module (`stage.py`), weights (`weights.safetensors`),
the loss module on the last stage (`loss.py`) and `function.json` (its name, region and the whole
workflow). An invocation `{"start": a, "stop": b, "replica": k}` (or `{"iteration": i, ...}`, one
iteration) runs iterations a..b-1 as replica k: for each, its micro-batches in schedule order,
activations forward and gradients backward through storage, the stage's scatter-reduce, the sum of
tied parameters' gradients with the other stages holding them, and the optimizer step.

State between invocations: the parameters, buffers and optimizer state before iteration i are at
`state/s<stage>/it<i>` (replica 0 writes them at each checkpoint and when the invocation returns);
a warm process keeps them in memory. Every tensor written is a function of the iteration, stage,
replica and micro-batch, and the computation is deterministic, so a duplicate or retried invocation
writes the same tensors and changes nothing (only reports, with their times, differ).
"""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors.torch import load_file

from cloudless.ir.schedule import compute_order, local_micro_batches, one_f_one_b_windows, sample_indices

from .data import SplitReader, data_name
from .emulation import CpuShare, EmulatedChannel, Resources
from .storage import Channel, open_channel
from .sync import scatter_reduce
from .tensors import pack, unpack

STORAGE_ENV = "CLOUDLESS_STORAGE"
# Set only by `cloudless-run --emulate`: the function's link and CPU share, as Resources JSON.
EMULATE_ENV = "CLOUDLESS_EMULATE"


def load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _receive(value: Any) -> Any:
    """A value read from storage as the leaf autograd starts from on this side."""
    if isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex()):
        return value.requires_grad_(True)
    return value


class StageWorker:
    def __init__(
        self, package: Path, channel: Channel, *, pipelined_sync: bool = True, resources: Resources | None = None
    ) -> None:
        self.package = Path(package)
        # Every request goes through the function's (possibly emulated) link, which also counts them.
        self.channel: Channel = EmulatedChannel(channel, resources)
        self.cpu = CpuShare(resources.vcpus if resources else None)
        self.pipelined_sync = pipelined_sync
        spec = json.loads((self.package / "function.json").read_text())
        workflow = spec["workflow"]
        self.region = spec["region"]
        region = next(r for r in workflow["regions"] if r["name"] == self.region)
        functions = sorted(region["functions"], key=lambda f: f["stage"])
        self.function = next(f for f in functions if f["name"] == spec["function"])
        self.stage = self.function["stage"]
        self.stages = len(functions)
        self.replicas = self.function["replicas"]
        self.first, self.last = self.stage == 0, self.stage == self.stages - 1
        run = workflow["run"]
        self.seed = run["seed"]
        self.global_batch, self.micro_batch = run["global_batch"], run["micro_batch"]
        self.micro_batches = run["micro_batches"]
        self.schedule = run["schedule"]
        self.checkpoint_every = run["checkpoint_every"]
        self.window = one_f_one_b_windows([f["replicas"] for f in functions])[self.stage]
        self.sync = workflow["sync"]
        self.data_name = data_name(region)
        # Several regions: this stage meets its counterparts every `round_iterations` iterations.
        self.inter_region: str | None = self.sync.get("inter_region")
        self.round_iterations: int = region.get("round_iterations") or 0
        self.peers = [(r["name"], float(r.get("weight") or 0.0)) for r in workflow["regions"]]
        self.server: str | None = self.sync.get("server")
        self.base_version = 0  # ASGD-GA: the global version this region's model started its round from
        self.optimizer_spec = workflow["optimizer"]
        self.holders = {
            name: [f["stage"] for f in functions if name in f["shared_parameters"]]
            for name in self.function["shared_parameters"]
        }
        stage_module = load_module(self.package / "stage.py", f"cloudless_stage_{self.stage}")
        self.inputs, self.outputs = list(stage_module.INPUTS), list(stage_module.OUTPUTS)
        self.module: torch.nn.Module = stage_module.Stage()
        self.loss: torch.nn.Module | None = None
        if self.last:
            self.loss = load_module(self.package / f"{workflow['data']['loss']}.py", "cloudless_loss").Stage()
        self.optimizer = getattr(torch.optim, self.optimizer_spec["class"])(
            list(self.module.parameters()), **self.optimizer_spec["options"]
        )
        self._reader: SplitReader | None = None
        self._batch: tuple[int, list[int]] = (-1, [])  # (iteration, its samples in order)
        self._pool: ThreadPoolExecutor | None = None  # control requests off the critical path
        self._reports: list[Future[None]] = []
        self._link_threads: tuple[ThreadPoolExecutor, ThreadPoolExecutor] | None = None
        self._ready: tuple[str, int, int] | None = None  # (namespace, replica, iteration) memory is before
        self.namespace = self.region  # keys of one run: "<run>/<region>"
        self.replica = 0

    # -- keys --------------------------------------------------------------------------------------
    def _key(self, iteration: int, *parts: object) -> str:
        return "/".join([self.namespace, f"it{iteration}", *map(str, parts)])

    def state_key(self, iteration: int) -> str:
        return f"{self.namespace}/state/s{self.stage}/it{iteration}"

    def _invocation_key(self, kind: str, replica: int, start: int) -> str:
        return f"{self.namespace}/{kind}/{self.function['name']}/r{replica}/from{start}"

    # -- state -------------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        values: dict[str, Any] = {f"module/{k}": v for k, v in self.module.state_dict().items()}
        names = {id(p): n for n, p in self.module.named_parameters()}
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                values[f"optimizer/{names[id(param)]}/{key}"] = value
        if self.inter_region == "asgd-ga":
            values["meta/base_version"] = torch.tensor(self.base_version)
        return values

    def save_state(self, iteration: int) -> None:
        self.channel.put(self.state_key(iteration), pack(self._state()))

    def load_state(self, iteration: int, timeout: float) -> None:
        if iteration == 0:
            self.module.load_state_dict(load_file(self.package / "weights.safetensors"), strict=True)
            self.optimizer.state.clear()
            self.base_version = 0
            return
        values = unpack(self.channel.get(self.state_key(iteration), timeout))
        self.module.load_state_dict(
            {k.removeprefix("module/"): v for k, v in values.items() if k.startswith("module/")}, strict=True
        )
        params = dict(self.module.named_parameters())
        self.optimizer.state.clear()
        self.base_version = int(values["meta/base_version"]) if "meta/base_version" in values else 0
        for key, value in values.items():
            if key.startswith("optimizer/"):
                name, field = key.removeprefix("optimizer/").rsplit("/", 1)
                self.optimizer.state[params[name]][field] = value

    def _resume_point(self, start: int, stop: int) -> int:
        """The latest checkpoint of this stage in start..stop-1: where a retried invocation resumes."""
        at, every = start, self.checkpoint_every
        for iteration in range(start - start % every + every, stop, every):
            if not self.channel.exists(self.state_key(iteration)):
                break
            at = iteration
        return at

    # -- the time limit --------------------------------------------------------------------------
    # Every function of the region must end an invocation at the same iteration, or one would wait
    # for a micro-batch another never sends. Stage 0's replica 0 decides, at the start of iteration
    # i, to end after iteration i + 1, and writes that under the invocation's stop key (claimed: a
    # retry finds the first decision). No function can finish iteration i before the decision is
    # written (each needs a micro-batch or a sync piece descending from stage 0 replica 0's work on
    # i), so a read issued once a function finished iteration i sees it; it runs in the background
    # during iteration i + 1 and is looked at before iteration i + 2: no request on the critical path.
    def _stop_key(self, start: int) -> str:
        return f"{self.namespace}/stop/from{start}"

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
        timeout: float = 600.0,
        time_limit_s: float | None = None,
        run: str = "",
        attempt: int | None = None,
    ) -> dict[str, Any]:
        """Iterations start..stop-1 as `replica`, ending early (at the iteration every function of the
        region agrees on) when `time_limit_s` would be passed. The result says where it stopped."""
        if not 0 <= replica < self.replicas:
            raise ValueError(f"replica {replica}: {self.function['name']} has replicas 0..{self.replicas - 1}")
        if not 0 <= start < stop:
            raise ValueError(f"iterations {start}..{stop}: expected 0 <= start < stop")
        began, wall = time.monotonic(), time.time()
        self.namespace = f"{run}/{self.region}" if run else self.region
        self.replica = replica
        done_key = self._invocation_key("done", replica, start)
        done = self.channel.try_get(done_key)
        if done is not None:
            return {**json.loads(done), "duplicate": True}  # it already ran: change nothing
        if attempt is not None and not self.channel.claim(
            f"{self._invocation_key('claim', replica, start)}/a{attempt}", str(wall).encode()
        ):
            return {"status": "duplicate", "function": self.function["name"], "replica": replica, "start": start}
        spans: list[list[Any]] = []
        resume = self._resume_point(start, stop)
        if self._ready != (self.namespace, replica, resume):
            with self._span(spans, "load state"):
                self.load_state(resume, timeout)
        losses: list[float] = []
        longest = 0.0
        reached = resume
        counted = dict(getattr(self.channel, "counts", {}))
        stop_key, decided = self._stop_key(start), False
        lookups: dict[int, Future[bytes | None]] = {}  # iteration -> read of the stop key for it
        self._ready = None  # until an iteration completes, memory holds no state to reuse
        try:
            for iteration in range(resume, stop):
                if time_limit_s is not None:
                    elapsed = time.monotonic() - began
                    if self.first and replica == 0 and not decided and iteration + 2 < stop:
                        if elapsed + 3 * longest > time_limit_s:
                            self.channel.claim(stop_key, str(iteration + 2).encode())
                            decided = True
                    lookup = lookups.pop(iteration, None)
                    found = lookup.result() if lookup is not None else self.channel.try_get(stop_key)
                    if found is not None and int(found) <= iteration:
                        break
                tick = time.monotonic()
                losses.extend(self.iteration(iteration, replica, timeout, spans))
                longest = max(longest, time.monotonic() - tick)
                reached = iteration + 1
                if time_limit_s is not None and iteration + 2 < stop:
                    lookups[iteration + 2] = self._background().submit(self.channel.try_get, stop_key)
                if replica == 0 and reached % self.checkpoint_every == 0:
                    with self._span(spans, "checkpoint"):
                        self.save_state(reached)
            if replica == 0 and reached % self.checkpoint_every != 0:
                with self._span(spans, "checkpoint"):
                    self.save_state(reached)  # where the next invocation starts
            for future in self._reports:
                future.result()
        finally:
            for future in lookups.values():
                future.cancel()
            self._reports.clear()
        self._ready = (self.namespace, replica, reached)
        result = {
            "status": "done",
            "function": self.function["name"],
            "stage": self.stage,
            "replica": replica,
            "start": start,
            "resumed": resume,
            "stop": reached,
            "losses": losses,
            "seconds": round(time.monotonic() - began, 6),
            "storage": {k: v - counted.get(k, 0) for k, v in getattr(self.channel, "counts", {}).items()},
            "spans": spans,
        }
        self.channel.put(done_key, json.dumps(result, sort_keys=True).encode())
        return result

    @staticmethod
    def _span(spans: list[list[Any]], name: str) -> _Span:
        return _Span(spans, name)

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
                key = self._key(iteration, "act", f"s{self.stage - 1}", f"mb{m}")
            elif kind == "backward" and not self.last:
                key = self._key(iteration, "grad", f"s{self.stage + 1}", f"mb{m}")
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
        if self.last:
            # Progress for the controller: this replica's losses and when its micro-batches were
            # done, sent in the background (a crash may lose the last few; the controller copes).
            while len(self._reports) > 2:
                self._reports.pop(0).result()
            record = json.dumps({"losses": values, "time": time.time()}).encode()
            key = self._key(iteration, "metrics", f"r{replica}")
            self._reports.append(self._background().submit(self.channel.put, key, record))
        with self._span(spans, "sync"):
            self._synchronise(iteration, replica, timeout)
        with self._span(spans, "step"), self.cpu.compute():
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        if self.inter_region and self.round_iterations and (iteration + 1) % self.round_iterations == 0:
            with self._span(spans, self.inter_region):
                self._meet((iteration + 1) // self.round_iterations - 1, replica, timeout)
        return values

    # -- between regions ---------------------------------------------------------------------------
    # Keys of the run (not of a region) are "<run>/<region>/..." of the region that writes them; a
    # local run keeps every region in one storage, a deployment reads a peer's keys across the WAN.
    def _run_key(self, region: str, *parts: object) -> str:
        run = self.namespace.rsplit("/", 1)[0] if "/" in self.namespace else ""
        return "/".join([p for p in (run, region) if p] + [str(p) for p in parts])

    def _model(self) -> dict[str, torch.Tensor]:
        """What regions share: parameters and floating-point buffers (optimizer state stays local)."""
        return {k: v for k, v in self.module.state_dict().items() if v.is_floating_point()}

    def _adopt(self, values: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, tensor in self.module.state_dict().items():
                if name in values:
                    tensor.copy_(values[name])

    def _meet(self, round_index: int, replica: int, timeout: float) -> None:
        """This stage's round-end sync with the other regions. Replica 0 talks across regions and
        leaves the result in its own region's storage; the other replicas read it there."""
        local = self._run_key(self.region, self.inter_region, f"s{self.stage}", f"round{round_index}")
        if replica != 0:
            result = unpack(self.channel.get(f"{local}/result", timeout))
            self.base_version = int(result.pop("meta/version", torch.tensor(0)))
            self._adopt(result)
            return
        if self.inter_region == "model-average":
            merged = self._model_average(round_index, local, timeout)
        else:
            merged = self._asgd_push(round_index, timeout)
        self._adopt(merged)
        if self.replicas > 1:
            extra = {"meta/version": torch.tensor(self.base_version)} if self.inter_region == "asgd-ga" else {}
            self.channel.put(f"{local}/result", pack({**merged, **extra}))

    def _model_average(self, round_index: int, local: str, timeout: float) -> dict[str, torch.Tensor]:
        """Every region writes its model for the round, reads the others' and takes the mean
        weighted by the samples of their rounds, in region order (so every region gets the same bits)."""
        mine = self._model()
        self.channel.put(f"{local}/model", pack(mine))
        total: dict[str, torch.Tensor] = {}
        for region, weight in self.peers:
            if region == self.region:
                theirs = mine
            else:
                key = self._run_key(region, self.inter_region, f"s{self.stage}", f"round{round_index}", "model")
                theirs = unpack(self.channel.get(key, timeout))
            for name, value in theirs.items():
                total[name] = total[name] + weight * value if name in total else weight * value
        return {name: value.to(mine[name].dtype) for name, value in total.items()}

    def _global_key(self, version: int, part: str) -> str:
        assert self.server is not None
        return self._run_key(self.server, "global", f"s{self.stage}", f"v{version}", part)

    def _global(self, version: int, timeout: float) -> dict[str, torch.Tensor]:
        if version == 0:  # every region starts from the package's weights
            initial = load_file(self.package / "weights.safetensors")
            return {k: v for k, v in initial.items() if k in self._model()}
        return unpack(self.channel.get(self._global_key(version, "model"), timeout))

    def _asgd_push(self, round_index: int, timeout: float) -> dict[str, torch.Tensor]:
        """ASGD-GA: add this round's accumulated update (the model now minus the global version it
        started from) to the newest global version, as the next version, without waiting for any
        other region. Versions are claimed with create-if-absent; a retried push finds its own claim
        and rewrites the same bytes, so an update is never applied twice."""
        me = f"{self.region}/round{round_index}".encode()
        base = self._global(self.base_version, timeout)
        mine = self._model()
        delta = {name: mine[name] - base[name] for name in mine}
        version = self.base_version + 1
        while True:
            owner = self.channel.try_get(self._global_key(version, "owner"))
            if owner is None and self.channel.claim(self._global_key(version, "owner"), me):
                owner = me
            elif owner is None:
                owner = self.channel.get(self._global_key(version, "owner"), timeout)
            if owner == me:
                previous = self._global(version - 1, timeout)
                merged = {name: previous[name] + delta[name] for name in delta}
                self.channel.put(self._global_key(version, "model"), pack(merged))
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
        with self.cpu.compute():
            outputs = tuple(self.module(*[taken[name] for name in self.inputs]))
        if self.last:
            assert self.loss is not None
            indices = self._indices(iteration, m)
            assert self._reader is not None
            targets = self._reader.gather(indices, "target")
            with self.cpu.compute():
                (losses[m],) = self.loss(*outputs, *targets)
        else:
            key = self._key(iteration, "act", f"s{self.stage}", f"mb{m}")
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
            with self.cpu.compute():
                (losses[m] / self.micro_batches).backward()
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
                with self.cpu.compute():
                    torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        if not self.first:
            sent = {
                name: value.grad
                for name, value in taken.items()
                if isinstance(value, torch.Tensor) and value.grad is not None
            }
            key = self._key(iteration, "grad", f"s{self.stage}", f"mb{m}")
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
                self._key(iteration, "sync", f"s{self.stage}"),
                flat,
                replica,
                self.replicas,
                piece_bytes=self.sync["piece_bytes"],
                max_pieces=self.sync["max_pieces"],
                pipelined=self.pipelined_sync,
                timeout=timeout,
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
            mine = {
                n: (by_name[n].grad if by_name[n].grad is not None else torch.zeros_like(by_name[n]))
                for n in self.holders
            }
            if replica == 0:
                self.channel.put(self._key(iteration, "shared", f"s{self.stage}"), pack(mine))
            partners: dict[int, dict[str, Any]] = {}
            for name, stages in self.holders.items():
                total_grad: torch.Tensor | None = None
                for s in sorted(stages):
                    if s == self.stage:
                        part = mine[name]
                    else:
                        if s not in partners:
                            partners[s] = unpack(self.channel.get(self._key(iteration, "shared", f"s{s}"), timeout))
                        part = partners[s][name]
                    total_grad = part.clone() if total_grad is None else total_grad + part
                by_name[name].grad = total_grad


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
_IDLE: dict[tuple[str, str], list[StageWorker]] = {}
_IDLE_LOCK = threading.Lock()


def handle_request(package: Path, event: Any, storage: str | None = None) -> dict[str, Any]:
    """Run the invocation `event` on the function in `package`; a warm process reuses its worker.

    The event: {"start": a, "stop": b} (or {"iteration": i}), "replica" (default 0), and optionally
    "run" (namespaces the keys), "attempt" (a duplicate of the same attempt does nothing),
    "time_limit_s" (end early, where every function agrees, before this many seconds) and "timeout"
    (how long to wait for any one key)."""
    if not isinstance(event, dict):
        raise ValueError(f'expected a JSON object like {{"iteration": 0, "replica": 0}}, got {type(event).__name__}')
    location = storage or os.environ.get(STORAGE_ENV)
    if not location:
        raise ValueError(f"no storage: set {STORAGE_ENV} (a folder, s3://bucket/prefix or redis://host:port/db)")
    if "iteration" in event:
        fields = {"start": event["iteration"], "replica": event.get("replica", 0)}
    else:
        fields = {"start": event.get("start"), "stop": event.get("stop"), "replica": event.get("replica", 0)}
    if event.get("attempt") is not None:
        fields["attempt"] = event["attempt"]
    for name, value in fields.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name}: expected an integer, got {value!r}")
    run = event.get("run", "")
    if not isinstance(run, str) or "/" in run or ".." in run:
        raise ValueError(f"run: expected a name without '/', got {run!r}")
    numbers = {}
    for name in ("time_limit_s", "timeout"):
        value = event.get(name)
        if value is not None and (not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0):
            raise ValueError(f"{name}: expected a positive number of seconds, got {value!r}")
        numbers[name] = value
    start, replica = fields["start"], fields["replica"]
    stop = fields.get("stop", start + 1)
    cache_key = (str(package), location)
    with _IDLE_LOCK:
        idle = _IDLE.setdefault(cache_key, [])
        # Prefer the one warm for this replica (its state in memory is that replica's).
        worker = next((w for w in idle if w._ready and w._ready[1] == replica), idle[-1] if idle else None)
        if worker is not None:
            idle.remove(worker)
    if worker is None:
        emulate = os.environ.get(EMULATE_ENV)
        resources = Resources.from_json(json.loads(emulate)) if emulate else None
        worker = StageWorker(package, open_channel(location), resources=resources)
    try:
        return worker.run(
            start,
            stop,
            replica,
            timeout=float(numbers["timeout"] or 600.0),
            time_limit_s=numbers["time_limit_s"],
            run=run,
            attempt=fields.get("attempt"),
        )
    finally:
        with _IDLE_LOCK:
            idle.append(worker)
