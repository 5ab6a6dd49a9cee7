"""The stage worker: what one function runs for a range of training iterations.

A function package holds its stage's generated module (`stage.py`), weights (`weights.safetensors`),
the loss module on the last stage (`loss.py`) and `function.json` (its name, region and the whole
workflow). An invocation `{"start": a, "stop": b, "replica": k}` (or `{"iteration": i, ...}`, one
iteration) runs iterations a..b-1 as replica k: for each, its micro-batches in schedule order,
activations forward and gradients backward through storage, the stage's scatter-reduce, the sum of
tied parameters' gradients with the other stages holding them, and the optimizer step.

State between invocations: the parameters, buffers and optimizer state before iteration i are at
`state/s<stage>/it<i>` (replica 0 writes them at each checkpoint and when the invocation returns);
a warm process keeps them in memory. Every key and every value is a function of the iteration,
stage, replica and micro-batch, and the computation is deterministic, so a duplicate or retried
invocation writes the same bytes and changes nothing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from safetensors.torch import load_file

from .data import SplitReader, sample_indices
from .schedule import compute_order, local_micro_batches, one_f_one_b_windows
from .storage import Channel, open_channel
from .sync import scatter_reduce
from .tensors import pack, unpack

STORAGE_ENV = "CLOUDLESS_STORAGE"


def _load_module(path: Path, name: str) -> ModuleType:
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
    def __init__(self, package: Path, channel: Channel, *, pipelined_sync: bool = True) -> None:
        self.package = Path(package)
        self.channel = channel
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
        self.optimizer_spec = workflow["optimizer"]
        self.holders = {
            name: [f["stage"] for f in functions if name in f["shared_parameters"]]
            for name in self.function["shared_parameters"]
        }
        stage_module = _load_module(self.package / "stage.py", f"cloudless_stage_{self.stage}")
        self.inputs, self.outputs = list(stage_module.INPUTS), list(stage_module.OUTPUTS)
        self.module: torch.nn.Module = stage_module.Stage()
        self.loss: torch.nn.Module | None = None
        if self.last:
            self.loss = _load_module(self.package / f"{workflow['data']['loss']}.py", "cloudless_loss").Stage()
        self.optimizer = getattr(torch.optim, self.optimizer_spec["class"])(
            list(self.module.parameters()), **self.optimizer_spec["options"]
        )
        self._reader: SplitReader | None = None
        self._ready: tuple[int, int] | None = None  # (replica, iteration) the state in memory is before

    # -- keys --------------------------------------------------------------------------------------
    def _key(self, iteration: int, *parts: object) -> str:
        return "/".join([self.region, f"it{iteration}", *map(str, parts)])

    def state_key(self, iteration: int) -> str:
        return f"{self.region}/state/s{self.stage}/it{iteration}"

    # -- state -------------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        values: dict[str, Any] = {f"module/{k}": v for k, v in self.module.state_dict().items()}
        names = {id(p): n for n, p in self.module.named_parameters()}
        for param, state in self.optimizer.state.items():
            for key, value in state.items():
                values[f"optimizer/{names[id(param)]}/{key}"] = value
        return values

    def save_state(self, iteration: int) -> None:
        self.channel.put(self.state_key(iteration), pack(self._state()))

    def load_state(self, iteration: int, timeout: float) -> None:
        if iteration == 0:
            self.module.load_state_dict(load_file(self.package / "weights.safetensors"), strict=True)
            self.optimizer.state.clear()
            return
        values = unpack(self.channel.get(self.state_key(iteration), timeout))
        self.module.load_state_dict(
            {k.removeprefix("module/"): v for k, v in values.items() if k.startswith("module/")}, strict=True
        )
        params = dict(self.module.named_parameters())
        self.optimizer.state.clear()
        for key, value in values.items():
            if key.startswith("optimizer/"):
                name, field = key.removeprefix("optimizer/").rsplit("/", 1)
                self.optimizer.state[params[name]][field] = value

    # -- one invocation ----------------------------------------------------------------------------
    def run(self, start: int, stop: int, replica: int, timeout: float = 600.0) -> dict[str, Any]:
        if not 0 <= replica < self.replicas:
            raise ValueError(f"replica {replica}: {self.function['name']} has replicas 0..{self.replicas - 1}")
        if not 0 <= start < stop:
            raise ValueError(f"iterations {start}..{stop}: expected 0 <= start < stop")
        began = time.monotonic()
        if self._ready != (replica, start):
            self.load_state(start, timeout)
        losses: list[float] = []
        for iteration in range(start, stop):
            losses.extend(self.iteration(iteration, replica, timeout))
            self._ready = (replica, iteration + 1)
            if replica == 0 and ((iteration + 1) % self.checkpoint_every == 0 or iteration + 1 == stop):
                self.save_state(iteration + 1)
        return {
            "status": "done",
            "function": self.function["name"],
            "stage": self.stage,
            "replica": replica,
            "start": start,
            "stop": stop,
            "losses": losses,
            "seconds": round(time.monotonic() - began, 6),
        }

    def iteration(self, iteration: int, replica: int, timeout: float) -> list[float]:
        """Forward and backward of this replica's micro-batches, sync, step; the last stage's losses."""
        local = local_micro_batches(self.micro_batches, self.replicas, replica)
        received: dict[int, dict[str, Any]] = {}
        produced: dict[int, tuple[Any, ...]] = {}
        losses: dict[int, torch.Tensor] = {}
        for kind, m in compute_order(self.schedule, local, self.window):
            if kind == "forward":
                received[m], produced[m] = self._forward(iteration, m, timeout, losses)
            else:
                self._backward(iteration, m, timeout, received.pop(m), produced.pop(m), losses)
        self._synchronise(iteration, replica, timeout)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return [float(losses[m]) for m in sorted(losses)]

    def _indices(self, iteration: int, m: int) -> list[int]:
        if self._reader is None:
            self._reader = SplitReader(self.channel, self.region)
        return sample_indices(iteration, m, self.micro_batch, self.global_batch, self._reader.samples, self.seed)

    def _forward(
        self, iteration: int, m: int, timeout: float, losses: dict[int, torch.Tensor]
    ) -> tuple[dict[str, Any], tuple[Any, ...]]:
        if self.first:
            indices = self._indices(iteration, m)
            assert self._reader is not None
            taken = dict(zip(self.inputs, self._reader.gather(indices, "input"), strict=True))
        else:
            values = unpack(self.channel.get(self._key(iteration, "act", f"s{self.stage - 1}", f"mb{m}"), timeout))
            taken = {name: _receive(values[name]) for name in self.inputs}
        # Ops that draw random numbers (dropout) draw the same ones on a retry.
        torch.manual_seed((((self.seed * 1_000_003 + iteration) * 1_000_003 + self.stage) * 1_000_003 + m) % 2**63)
        outputs = tuple(self.module(*[taken[name] for name in self.inputs]))
        if self.last:
            assert self.loss is not None
            indices = self._indices(iteration, m)
            assert self._reader is not None
            (losses[m],) = self.loss(*outputs, *self._reader.gather(indices, "target"))
        else:
            self.channel.put(
                self._key(iteration, "act", f"s{self.stage}", f"mb{m}"),
                pack(dict(zip(self.outputs, outputs, strict=True))),
            )
        return taken, outputs

    def _backward(
        self,
        iteration: int,
        m: int,
        timeout: float,
        taken: dict[str, Any],
        outputs: tuple[Any, ...],
        losses: dict[int, torch.Tensor],
    ) -> None:
        if self.last:
            # The global batch's loss is the mean of its micro-batches' (equal-sized) mean losses.
            (losses[m] / self.micro_batches).backward()
            losses[m] = losses[m].detach()
        else:
            grads = unpack(self.channel.get(self._key(iteration, "grad", f"s{self.stage + 1}", f"mb{m}"), timeout))
            pairs = [
                (value, grads[name])
                for name, value in zip(self.outputs, outputs, strict=True)
                if name in grads and isinstance(value, torch.Tensor) and value.requires_grad
            ]
            if pairs:
                torch.autograd.backward([p[0] for p in pairs], [p[1] for p in pairs])
        if not self.first:
            sent = {
                name: value.grad
                for name, value in taken.items()
                if isinstance(value, torch.Tensor) and value.grad is not None
            }
            self.channel.put(self._key(iteration, "grad", f"s{self.stage}", f"mb{m}"), pack(sent))

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


_WORKERS: dict[tuple[str, str], StageWorker] = {}


def handle_request(package: Path, event: Any, storage: str | None = None) -> dict[str, Any]:
    """Run the invocation `event` on the function in `package`; a warm process reuses its worker."""
    if not isinstance(event, dict):
        raise ValueError(f'expected a JSON object like {{"iteration": 0, "replica": 0}}, got {type(event).__name__}')
    location = storage or os.environ.get(STORAGE_ENV)
    if not location:
        raise ValueError(f"no storage: set {STORAGE_ENV} (a folder, s3://bucket/prefix or redis://host:port/db)")
    if "iteration" in event:
        fields = {"start": event["iteration"], "replica": event.get("replica", 0)}
    else:
        fields = {"start": event.get("start"), "stop": event.get("stop"), "replica": event.get("replica", 0)}
    for name, value in fields.items():
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"{name}: expected an integer, got {value!r}")
    start, replica = fields["start"], fields["replica"]
    stop = fields.get("stop", start + 1)
    cache_key = (str(package), location)
    if cache_key not in _WORKERS:
        _WORKERS[cache_key] = StageWorker(package, open_channel(location))
    return _WORKERS[cache_key].run(start, stop, replica, timeout=float(event.get("timeout", 600.0)))
